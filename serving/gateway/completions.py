"""Serving ``POST /v1/chat/completions`` and ``POST /v1/completions``: pin the session to a
version, send the call to a node that holds it, capture the answer, release it to the client.

``CompletionServing(settings, metrics, capture, state, router, http, user_secret)`` is built once at
start-up with its clients (the capture spool, the live state, the version router, the upstream pool)
and the deployment's user-id secret (``flywheel.identity.load_secret``); the
route authenticates and rate-limits, then calls it with the caller. It also owns :meth:`submit`,
the one way events reach the capture (feedback is handed it too).

Invariants:
- A request for ``n`` choices (at most ``gateway.max_n``) is ``n`` generations, one event each, the
  request's choices one group (``serving.gateway.capture``); the client learns their ids from the
  ``X-Flywheel-Generation`` header (comma-separated, in index order) and may send feedback on any.
- A response that carries generations is released only after their events are accepted by the capture
  spool (written, fsynced or acknowledged by the bus, per ``gateway.capture_ack``): a gateway killed
  right after answering still ships it at its next start. When the spool is full the configured
  policy applies (``drop``: serve and count the lost event; ``reject``: 503 before the upstream is
  called).
- A stream (``stream: true``, chat or text) is proxied chunk by chunk as the upstream sends it and
  recorded (one event per choice) once the upstream's last chunk has arrived and before the client
  gets ``data: [DONE]``; ``[DONE]`` is the acknowledgement. A stream that breaks off ends with an
  OpenAI error envelope as its last event, no ``[DONE]``, and nothing recorded.
- Sessions are scoped by tenant: the same session id sent by two tenants names two sessions. A
  session keeps the model version it was first routed to (sticky, ``gateway.session_ttl_s`` after
  its last request); new sessions follow the rollout (tenant pin, canary share, stable). If no node
  holds the session's version any more, it moves to the current one and the move is counted.
- Rejected requests (malformed, invalid fields, unknown model) never reach the upstream or the
  bus; they get a 4xx OpenAI envelope naming the offending field (capture full: a 503).
- While the fleet is starting (``routing.Router.starting``: no node has answered yet) a node that
  refuses the connection is a 503 ``fleet_starting`` with ``Retry-After``, never a 502.
- A node that serves each version under its own model name (a vLLM server in LoRA mode, whose
  heartbeat carries ``model_names``) is sent ``model = <its name for the session's version>``; its
  answer is turned back into the line's before anything else reads it (``routing.as_line``:
  ``model`` the line, ``model_version`` the version, the node id from its heartbeat), so the client
  and the captured event see exactly what a built-in node's answer gives. When such a node does not
  hold the version (no name for it, or vLLM's 404 for the model) the session moves on as after a
  409 ``version_unavailable``.
- The end user a request names (OpenAI's ``user`` or the ``X-Flywheel-User`` header; both only if
  equal, else a 400 naming ``user``: ``flywheel.identity.end_user``) is kept only as its keyed hash
  (``flywheel.identity.user_hash``): the upstream gets the hash as ``user``, the event carries it as
  ``user_hash`` and its recorded request has no ``user`` (``capture.recorded_request``).
- Consent (``flywheel.consent``): the request's data use is the tightest of its tenant's policy
  (``[tenants.<name>]``) and its ``X-Flywheel-Data`` header (a looser header is not applied; an
  unknown value is a 400 naming the header, before anything is routed), then the tenant's training
  sample by session. ``none`` is served and counted (``flywheel_gateway_data_use``,
  ``flywheel_gateway_unstored``) and nothing of it is captured: no event, no generation owner in
  the live state (feedback naming such a generation is a 404, it was never stored), and a full
  capture does not refuse it. ``store_only`` is captured with ``data_use = "store_only"`` on each
  event. Every answer says which use applied in ``X-Flywheel-Data-Use``.
- Prompts and completions are never logged at INFO or above.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from flywheel import consent, identity, jsonpolicy
from flywheel.events import new_id
from flywheel.settings import Settings
from serving.errors import (
    APIError,
    UpstreamStreamError,
    bad_upstream_response,
    fleet_starting,
    state_unavailable,
    upstream_error,
    upstream_error_field,
    upstream_stream_error,
)
from serving.gateway import capture
from serving.gateway.auth import Principal
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.routing import Router, Upstream, as_line, new_session_version
from serving.gateway.shipper import Capture, CaptureFull
from serving.gateway.state import GatewayState, StateUnavailable
from serving.gateway.upstream import Pool, UpstreamError, UpstreamUnreachable
from serving.gateway.upstream import Response as UpstreamResponse
from serving.protocol import (
    GENERATION_GROUP_HEADER,
    GENERATION_HEADER,
    MODEL_VERSION_HEADER,
    NODE_HEADER,
    SESSION_HEADER,
    SSE_DONE,
    check_data_use,
    check_session_id,
    parse_chat_request,
    parse_completion_request,
    read_json_body,
    sse_data,
    sse_event,
)

log = logging.getLogger(__name__)

#: How long a request waits for a node to finish loading the session's (just promoted) version:
#: nodes follow a promotion within their poll interval (1 s by default) plus the load.
LOADING_WAIT_S = 3.0
LOADING_RETRY_S = 0.2

#: The upstream path of each kind of completion (the same as the gateway's).
PATHS: dict[capture.Kind, str] = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


@dataclass
class Call:
    """One completion request on its way through the gateway."""

    kind: capture.Kind
    body: dict[str, Any]  # the client's, recorded as it came but for the raw ``user`` (capture.recorded_request)
    request: capture.Request
    principal: Principal
    session_id: str
    version: int | None  # the session's pinned version (None: let the upstream choose)
    upstream_body: bytes
    upstream_request: dict[str, Any] = field(default_factory=dict)  # what upstream_body encodes
    target: Upstream = Upstream("")  # where post() sent it (set by post)
    generation_id: str = field(default_factory=new_id)
    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] = field(default_factory=dict)  # for the client
    user_hash: str | None = None  # the end user's keyed hash (flywheel.identity), if one was named
    data_use: consent.DataUse = "train"  # what may be done with it (flywheel.consent)

    @property
    def tenant(self) -> str:
        return self.principal.tenant

    @property
    def generation_ids(self) -> list[str]:
        """The generation id of each choice, in index order (``capture.generation_ids``)."""
        return capture.generation_ids(self.generation_id, self.request.choices)

    def answer_headers(self, version: int) -> dict[str, str]:
        """The headers of a served answer: the session, the choices' generation ids (comma-separated,
        in index order), their group's id when there are several, and the version that sampled them."""
        headers = {**self.headers, GENERATION_HEADER: ", ".join(self.generation_ids),
                   MODEL_VERSION_HEADER: str(version)}
        if self.request.choices > 1:
            headers[GENERATION_GROUP_HEADER] = self.generation_id
        return headers

    @property
    def path(self) -> str:
        return PATHS[self.kind]


def stream_failure(exc: BaseException, headers: dict[str, str]) -> APIError:
    """The envelope a stream that broke off ends with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StateUnavailable):
        return state_unavailable(exc)
    if isinstance(exc, capture.CaptureError):
        return bad_upstream_response(exc, headers)
    if isinstance(exc, UpstreamStreamError):
        return upstream_stream_error(exc, headers)
    return APIError(502, f"upstream stream broke off: {exc}", code="upstream_error", headers=headers)


class CompletionServing:
    """The work of the completion routes (module docstring)."""

    def __init__(self, settings: Settings, metrics: GatewayMetrics, capture: Capture, state: GatewayState,
                 router: Router, http: Pool, user_secret: str) -> None:
        self.settings = settings
        self.user_secret = user_secret
        self.metrics = metrics
        self.capture = capture
        self.state = state
        self.router = router
        self.http = http

    async def __call__(self, request: Request, principal: Principal, kind: capture.Kind, *, started: float) -> Response:
        """Serve one completion for ``principal``; ``started``: when the request reached the gateway."""
        policy = consent.policy_for(self.settings.tenants, principal.tenant)
        use = check_data_use(policy, request.headers.get(consent.HEADER))
        if use != "none":  # nothing of it is captured: a full capture does not concern it
            try:
                self.capture.admit()
            except CaptureFull as exc:
                raise APIError(503, f"capture is unavailable ({exc}); the request was not served, retry later",
                               code="capture_unavailable") from None
        body = await read_json_body(request, self.settings.gateway.max_body_bytes,
                                    self.settings.gateway.body_read_timeout_s)
        parse = parse_chat_request if kind == "chat" else parse_completion_request
        parsed = parse(body, max_n=self.settings.gateway.max_n)
        self.check_model(parsed.model)
        user_hash = self.end_user_hash(principal.tenant, parsed.user, request.headers.get(identity.USER_HEADER))
        session_id = check_session_id(request.headers.get(SESSION_HEADER) or uuid.uuid4().hex)
        use = consent.sampled(use, policy, principal.tenant, session_id)
        self.metrics.data_use.labels(kind, use).inc()
        version = await self.pin(principal.tenant, session_id)
        upstream_request = capture.upstream_request(body, self.settings.model.line, kind, user_hash)
        upstream_body = orjson.dumps(upstream_request)  # read_json_body kept every integer within 64 bits
        call = Call(kind, capture.recorded_request(body), parsed, principal, session_id, version, upstream_body,
                    upstream_request, started=started, headers={SESSION_HEADER: session_id, consent.USE_HEADER: use},
                    user_hash=user_hash, data_use=use)
        if parsed.stream:
            return await self.stream(call)
        return await self.complete_whole(call)

    def check_model(self, model: str | None) -> None:
        line = self.settings.model.line
        if model is not None and model != line:
            raise APIError(404, f"the model `{model}` does not exist; this gateway serves `{line}` (GET /v1/models)",
                           param="model", code="model_not_found")

    def end_user_hash(self, tenant: str, body_user: str | None, header_user: str | None) -> str | None:
        """The keyed hash of the end user the request names, or None; a 400 naming ``user`` when
        its body field and header disagree or it is no id (``flywheel.identity.end_user``)."""
        try:
            user = identity.end_user(body_user, header_user)
        except identity.EndUserError as exc:
            raise APIError(400, str(exc), param="user", code=exc.code) from None
        return None if user is None else identity.user_hash(self.user_secret, tenant, user)

    # Sessions and upstreams --------------------------------------------------------------------

    async def pin(self, tenant: str, session_id: str) -> int | None:
        """The session's version: its sticky one, or the rollout's choice for a new session."""
        # pin_session keeps a concrete pin that exists (first writer wins) and refreshes its TTL.
        proposal = new_session_version(await self.router.table(), tenant, session_id)
        return await self.state.pin_session(tenant, session_id, proposal, self.settings.gateway.session_ttl_s)

    async def repin(self, call: Call) -> bool:
        """After a node said it no longer holds the session's version: move the session to the
        rollout's current choice. False if that is the same version (nothing to retry)."""
        proposal = new_session_version(await self.router.table(), call.tenant, call.session_id)
        if proposal is None or proposal == call.version:
            return False
        await self.state.set_session_version(call.tenant, call.session_id, proposal, self.settings.gateway.session_ttl_s)
        log.warning("session moved from version %s to %s: no node holds %s any more", call.version, proposal, call.version)
        self.metrics.repinned.inc()
        call.version = proposal
        return True

    def upstream_headers(self, call: Call) -> dict[str, str]:
        headers = {SESSION_HEADER: call.session_id, "content-type": "application/json"}
        if call.version is not None:
            headers[MODEL_VERSION_HEADER] = str(call.version)
        key = self.settings.node.vllm_api_key
        if call.target.names_versions and key:  # vLLM itself (LoRA mode), started with --api-key
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def post(self, call: Call) -> UpstreamResponse:
        """Send the call upstream; ``call.target`` says where it went and under which model name.

        A node that no longer holds the session's version (409 ``version_unavailable``, or a
        version-naming node without it) moves the session to the rollout's current version, once.
        A node that does not hold it *yet* (the version just became stable and the node is still
        loading it: the rollout's choice is the session's version already) is asked again for up to
        ``LOADING_WAIT_S``, so a promotion never turns into an error for the user."""
        moved = False
        deadline = time.monotonic() + LOADING_WAIT_S
        while True:
            target = call.target = self.router.target_for(call.version)
            if target.unavailable:  # a node that names versions by model, and has no name for this one
                if not moved and await self.repin(call):
                    moved = True
                    continue
                raise self.not_served(call)
            url = f"{target.url}{call.path}"
            body = call.upstream_body
            if target.model is not None:
                body = orjson.dumps({**call.upstream_request, "model": target.model})
            try:
                response = await self.http.post(url, body, self.upstream_headers(call))
            except UpstreamUnreachable as exc:
                if self.router.starting(target):  # its port is not open yet: a 503 to retry, not a 502
                    raise fleet_starting(self.settings.model.line, call.headers) from None
                raise APIError(502, f"upstream {url} failed: {exc}", code="upstream_unreachable") from None
            except UpstreamError as exc:
                raise APIError(502, f"upstream {url} failed: {exc}", code="upstream_unreachable") from None
            self.router.answered()
            model_gone = target.names_versions and response.status == 404  # vLLM: "The model `…` does not exist."
            if response.status != 409 and not model_gone:
                return response
            try:
                raw = await response.read()
            except UpstreamError as exc:
                raise APIError(502, f"upstream {url} broke off: {exc}", code="upstream_error") from None
            model_gone = model_gone and upstream_error_field(raw, "type") == "NotFoundError"
            if upstream_error_field(raw, "code") != "version_unavailable" and not model_gone:
                return response  # read() keeps the body for the caller
            if not moved and await self.repin(call):
                moved = True
                continue
            if model_gone:
                raise self.not_served(call)
            if time.monotonic() >= deadline:
                return response  # read() keeps the body for the caller
            response.release()
            await asyncio.sleep(LOADING_RETRY_S)

    def not_served(self, call: Call) -> APIError:
        """The answer when no node can serve the session's version under a model name."""
        line = self.settings.model.line
        if call.version is None:
            return APIError(503, f"no node serves a version of `{line}` yet; retry shortly",
                            code="version_unavailable", headers=call.headers)
        return APIError(409, f"no node holds version {call.version} of `{line}` any more; start a new session",
                        code="version_unavailable", headers=call.headers)

    @staticmethod
    def served_headers(headers: dict[str, str], target: Upstream) -> dict[str, str]:
        """The upstream's response headers, naming the node a version-naming node's heartbeat named
        (vLLM sends no ``X-Flywheel-Node``)."""
        if target.names_versions and not any(k.lower() == NODE_HEADER.lower() for k in headers):
            return {**headers, NODE_HEADER: target.node_id}
        return headers

    # Capture -----------------------------------------------------------------------------------

    async def complete_whole(self, call: Call) -> Response:
        upstream_start = time.perf_counter()
        response = await self.post(call)
        try:
            raw = await response.read()
        except UpstreamError as exc:
            raise APIError(502, f"upstream response broke off: {exc}", code="upstream_error") from None
        upstream_s = time.perf_counter() - upstream_start
        if response.status >= 400:
            raise upstream_error(response.status, raw, call.headers)
        try:
            response_body = orjson.loads(raw)
            if not isinstance(response_body, dict):
                raise ValueError("not a JSON object")
            response_body = as_line(response_body, call.target, self.settings.model.line)
            served = capture.extract_served(response_body, self.served_headers(response.headers, call.target),
                                            call.kind, call.request.choices)
        except (ValueError, capture.CaptureError) as exc:
            raise bad_upstream_response(exc, call.headers) from None
        await self.record_generation(call, response_body, served, upstream_s)
        out = Response(orjson.dumps(capture.client_response(response_body, call.request)),
                       media_type="application/json", headers=call.answer_headers(served[0].model_version))
        self.metrics.added.labels(call.kind).observe(max(0.0, time.perf_counter() - call.started - upstream_s))
        return out

    async def record_generation(self, call: Call, response_body: dict[str, Any], served: list[capture.Served],
                                upstream_s: float) -> None:
        """Hand the call's events (one per choice, all or none) to the capture, after recording
        which tenant and session own each generation id; for data use ``none``, only count them."""
        try:
            events = capture.generation_events(
                request_id=call.generation_id, tenant=call.tenant, session_id=call.session_id,
                model_line=self.settings.model.line, request_body=call.body, response_body=response_body,
                served=served, latency_ms=upstream_s * 1000.0, sampling_defaults=dict(call.target.sampling_defaults),
                user_hash=call.user_hash, data_use="store_only" if call.data_use == "store_only" else "train",
            )
        except ValidationError as exc:  # e.g. non-finite logprobs: never a partial or lossy event
            raise bad_upstream_response(exc, call.headers) from None
        model_version = served[0].model_version
        version = str(model_version)
        self.metrics.upstream.labels(version).observe(upstream_s)
        if call.version is None:  # nothing to follow yet: the session stays on what served it
            await self.state.pin_session(call.tenant, call.session_id, model_version,
                                         self.settings.gateway.session_ttl_s)
        if call.data_use == "none":  # served and counted; nothing of it is recorded anywhere
            self.metrics.unstored.labels("generation").inc(len(events))
            return
        for event in events:
            await self.state.record_generation(event.generation_id, call.tenant, call.session_id,
                                               self.settings.gateway.ownership_ttl_s)
        if await self.submit(events, call.headers):
            self.metrics.generations.labels(version).inc(len(events))

    async def submit(self, events: list[Any], headers: dict[str, str]) -> bool:
        """True once the spool accepted ``events``; False if the drop policy dropped them (counted
        by the capture); a 503 under the reject policy."""
        items = [(self.settings.topic(type(e).topic), e.session_id, e.to_bytes(),
                  {"event_type": type(e).__name__, "event_id": e.event_id}) for e in events]
        try:
            return await self.capture.submit(items)
        except CaptureFull as exc:
            raise APIError(503, f"capture is unavailable ({exc}); nothing was recorded, retry later",
                           code="capture_unavailable", headers=headers) from None

    # Streams -----------------------------------------------------------------------------------

    async def stream(self, call: Call) -> Response:
        """Proxy an upstream event stream; see the module docstring for what is recorded when."""
        upstream_start = time.perf_counter()
        upstream = await self.post(call)
        assembler = capture.StreamAssembler(call.kind, self.served_headers(upstream.headers, call.target),
                                            call.request.choices)

        def relay(data: str) -> bytes | None:
            """Fold one upstream event into the capture; what the client gets of it."""
            try:  # the JSON policy: what the event carries on, every reader of the bus can decode
                chunk = jsonpolicy.loads(data)
            except ValueError as exc:
                raise capture.CaptureError(f"upstream stream event is not JSON that flywheel can carry: {exc}") from None
            if isinstance(chunk, dict) and chunk.get("error") is not None:
                raise UpstreamStreamError(chunk["error"])
            if isinstance(chunk, dict):
                chunk = as_line(chunk, call.target, self.settings.model.line)
            assembler.feed(chunk)
            out = capture.client_chunk(chunk, call.request)
            return None if out is None else sse_event(out)

        events = sse_data(upstream.lines())
        first: bytes | None = None
        try:
            if upstream.status >= 400:
                raise upstream_error(upstream.status, await upstream.read(), call.headers)
            content_type = upstream.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                raise APIError(502, f"upstream answered a stream request with content-type {content_type[:80]!r}, "
                               "not text/event-stream", code="bad_upstream_response", headers=call.headers)
            if assembler.version is None:  # no version header: the first chunk must name it
                data = await anext(events, "[DONE]")
                if data.strip() == "[DONE]":
                    raise APIError(502, "upstream stream ended before its first chunk", code="upstream_error",
                                   headers=call.headers)
                first = relay(data)
                if assembler.version is None:
                    raise capture.CaptureError(
                        f"upstream names no model version (header {MODEL_VERSION_HEADER} or field model_version)")
        except capture.CaptureError as exc:
            upstream.release()
            raise bad_upstream_response(exc, call.headers) from None
        except UpstreamStreamError as exc:
            upstream.release()
            raise upstream_stream_error(exc, call.headers) from None
        except UpstreamError as exc:
            upstream.release()
            raise APIError(502, f"upstream stream broke off: {exc}", code="upstream_error",
                           headers=call.headers) from None
        except BaseException:
            upstream.release()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield first
                async for data in events:
                    if data.strip() == "[DONE]":
                        break
                    out = relay(data)
                    if out is not None:
                        yield out
                else:
                    raise APIError(502, "upstream stream ended before data: [DONE]", code="upstream_error")
                response_body, served = assembler.finish()
                await self.record_generation(call, response_body, served, time.perf_counter() - upstream_start)
                yield SSE_DONE
            except (APIError, capture.CaptureError, UpstreamStreamError, UpstreamError, StateUnavailable) as exc:
                error = stream_failure(exc, {})
                self.metrics.stream_errors.inc()
                log.warning("stream %s failed, nothing recorded: %s", call.generation_id, error.code or error.type)
                yield error.sse()
            finally:
                upstream.release()

        assert assembler.version is not None
        headers = {**call.answer_headers(assembler.version), "Cache-Control": "no-cache"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
