"""Serving ``POST /v1/feedback``: one item or a batch, each checked against its metric and the
caller's tenant, each feedback id held to one signal, then handed to the capture like a generation event.

``FeedbackServing(settings, state, ownership, submit, metrics)`` is built once at start-up
(``serving/gateway/services.py``) with its clients (the live state, the ownership checks, the
capture's ``submit`` as :meth:`CompletionServing.submit <serving.gateway.completions.CompletionServing.submit>`
does it, the gateway's metrics); the route (``serving/gateway/api_router.py``) authenticates and
rate-limits, then calls it with the caller's tenant. Feedback is acknowledged (202) only once the
capture spool accepted its events.

Invariants:
- Each item reports one metric (``flywheel.metrics``): a built-in, or one declared in
  ``[metrics.declared]``. An unknown name, a wrong type or a value out of bounds is a 400 whose
  ``param`` names the field (``feedback.2.value`` in a batch), and nothing of the request is
  accepted. The event's signal is the metric's name, its kind the metric's (``custom`` if declared).
- Feedback targets only what the tenant owns (``Ownership``): a generation (its session is the
  event's) or a session named by ``session_id`` or the session header (which a session URL,
  ``/sessions/{id}/v1/feedback``, sets: ``serving/gateway/app.py``).
- A batch holds each feedback id once: a repeat is a 400 naming it, even with identical items.
- A feedback id names one signal per tenant (``GatewayState.claim_feedback``, kept
  ``gateway.ownership_ttl_s``): an identical replay gets the first answer again (the same event
  ids); other content is a 409 ``feedback_id_conflict`` with the first submission under ``stored``,
  and nothing of the request is accepted.
- A claim is released when nothing was recorded (the capture refused or dropped the events), so a
  retry may carry other content.
- Consent (``flywheel.consent``): feedback is a request like any other, under its tenant's policy
  and its own ``X-Flywheel-Data`` header (an unknown value is a 400 naming it). Under ``none`` the
  items are checked as any is (metric, target: the same 400s) and counted, and nothing else happens:
  no ownership look-up, no claim, no event; the answer is a 202 with no ``event_ids``. So a client
  keeps a session out of storage by sending ``no-store`` on its feedback too: feedback without it
  that names a ``no-store`` generation is a 404 (the gateway never recorded its owner), while
  feedback that names only the session is stored (ingest keeps feedback of a session without
  generations as an ``empty`` session's; nothing is trained on it). ``store_only`` feedback is
  stored as usual: the trajectory is marked by its generations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from flywheel import consent
from flywheel.events import FeedbackEvent
from flywheel.metrics import MetricProblem, Metrics
from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic
from serving.gateway import capture
from serving.gateway.auth import Ownership
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.state import GatewayState, StateUnavailable
from serving.protocol import (
    SESSION_HEADER,
    FeedbackBatch,
    FeedbackItem,
    check_data_use,
    check_session_id,
    read_json_body,
)


class FeedbackServing:
    """The work of ``POST /v1/feedback`` (module docstring)."""

    def __init__(self, settings: Settings, state: GatewayState, ownership: Ownership,
                 submit: Callable[[list[Any], dict[str, str]], Awaitable[bool]], metrics: GatewayMetrics) -> None:
        self.gateway_settings = settings.gateway
        self.tenants = settings.tenants
        self.metrics = Metrics(settings.metrics.declared, undeclared_custom=settings.metrics.undeclared_custom)
        self.state = state
        self.ownership = ownership
        self.submit = submit
        self.gateway_metrics = metrics

    async def __call__(self, request: Request, tenant: str) -> JSONResponse:
        use = check_data_use(consent.policy_for(self.tenants, tenant), request.headers.get(consent.HEADER))
        body = await read_json_body(request, self.gateway_settings.max_body_bytes,
                                    self.gateway_settings.body_read_timeout_s)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object (one feedback item or {\"feedback\": [...]})")
        batch = "feedback" in body
        try:
            items = FeedbackBatch.model_validate(body).feedback if batch else [FeedbackItem.model_validate(body)]
        except ValidationError as exc:
            raise from_pydantic(exc) from None

        header_session = request.headers.get(SESSION_HEADER)
        events = []
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            prefix = f"feedback.{i}." if batch else ""
            if item.feedback_id in first:
                raise APIError(400, f"feedback.{i}.feedback_id repeats feedback.{first[item.feedback_id]}.feedback_id "
                               f"({item.feedback_id!r}): a batch holds each feedback id once",
                               param=f"{prefix}feedback_id", code="duplicate_feedback_id")
            first[item.feedback_id] = i
            try:
                checked = self.metrics.check(metric=item.metric, kind=item.kind, signal=item.signal, value=item.value,
                                             comment=item.comment, generation_id=item.generation_id)
            except MetricProblem as exc:
                raise APIError(400, f"feedback.{i}: {exc.message}" if batch else exc.message,
                               param=f"{prefix}{exc.field}", code=exc.code) from None
            item = item.model_copy(update={"kind": checked.kind, "signal": checked.signal, "value": checked.value})
            session_id = item.session_id or header_session
            if use == "none":  # checked as any item is, never looked up or recorded
                if item.generation_id is None and not session_id:
                    raise self.no_target(prefix)
                if session_id:
                    check_session_id(session_id)
                continue
            if item.generation_id is not None:
                session_id = await self.ownership.check_generation(
                    tenant, item.generation_id, session_id, param=f"{prefix}generation_id")
            elif not session_id:
                raise self.no_target(prefix)
            else:
                session_id = check_session_id(session_id)
                await self.ownership.check_session(tenant, session_id, param=f"{prefix}session_id")
            events.append(capture.feedback_event(item, tenant=tenant, session_id=session_id))

        self.gateway_metrics.data_use.labels("feedback", use).inc()
        if use == "none":
            self.gateway_metrics.unstored.labels("feedback").inc(len(items))
            return JSONResponse({"accepted": len(items), "event_ids": []}, status_code=202,
                                headers={consent.USE_HEADER: use})
        claims = await self.claim(tenant, events, batch)
        try:
            submitted = await self.submit(events, {})
        except BaseException:
            await self.release(tenant, claims)
            raise
        if submitted:
            self.gateway_metrics.feedback.inc(len(events))
        else:  # dropped by the spool's drop policy: nothing was recorded, a retry may differ
            await self.release(tenant, claims)
        headers = {SESSION_HEADER: events[0].session_id} if len(events) == 1 else {}
        headers[consent.USE_HEADER] = use
        # An identical replay gets the first answer again (the same event ids): a retry is harmless.
        return JSONResponse(
            {"accepted": len(events), "event_ids": [e.event_id for e in events]}, status_code=202, headers=headers
        )

    @staticmethod
    def no_target(prefix: str) -> APIError:
        return APIError(400, f"feedback needs a target: set {prefix}generation_id, {prefix}session_id or the "
                        f"{SESSION_HEADER} header", param=f"{prefix}session_id", code="missing_required_parameter")

    async def claim(self, tenant: str, events: list[FeedbackEvent], batch: bool) -> list[tuple[str, str]]:
        """Claim each event's feedback id for its content (``capture.feedback_content``); the
        claims this call made (an identical earlier submission is no conflict and no claim). A
        feedback id already claimed with other content is a 409 holding the stored content (and
        this call's claims are released: nothing of the request was accepted)."""
        claims: list[tuple[str, str]] = []
        for i, event in enumerate(events):
            content = capture.feedback_content(event)
            held = await self.state.claim_feedback(tenant, event.feedback_id, content,
                                                   self.gateway_settings.ownership_ttl_s)
            if held is None:
                claims.append((event.feedback_id, content))
            elif held != content:
                await self.release(tenant, claims)
                raise APIError(409, f"feedback_id {event.feedback_id!r} was already submitted with other content "
                               "(kind, signal, value, comment, data or target); a feedback id names one signal: "
                               "send a new feedback_id for a new one. `stored` holds what was accepted first",
                               param=f"feedback.{i}.feedback_id" if batch else "feedback_id",
                               code="feedback_id_conflict", extra={"stored": orjson.loads(held)})
        return claims

    async def release(self, tenant: str, claims: list[tuple[str, str]]) -> None:
        for feedback_id, content in claims:
            with contextlib.suppress(StateUnavailable):
                await self.state.release_feedback(tenant, feedback_id, content)
