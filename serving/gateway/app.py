"""The gateway: an OpenAI-compatible proxy that captures every generation and accepts feedback.

``create_app(settings)`` builds the app; its lifespan opens what it needs from ``settings`` (the
write-ahead capture spool and its shipper to the bus, the database for API keys and ownership,
the live state for sessions, rate limits and routing, the upstream HTTP client) and closes them
in reverse order. ``producer_factory`` replaces the bus producer (tests inject a broken one).

Invariants:
- A response that carries a generation is released only after its event is accepted by the capture
  spool (written, fsynced or acknowledged by the bus, per ``gateway.capture_ack``): a gateway killed
  right after answering still ships it at its next start. Feedback is acknowledged (202) the same way.
  When the spool is full the configured policy applies (``drop``: serve and count the lost event;
  ``reject``: 503 before the upstream is called).
- A stream (``stream: true``, chat or text) is proxied chunk by chunk as the upstream sends it and
  recorded as exactly one event, once the upstream's last chunk has arrived and before the client
  gets ``data: [DONE]``; ``[DONE]`` is the acknowledgement. A stream that breaks off ends with an
  OpenAI error envelope as its last event, no ``[DONE]``, and nothing recorded.
- Every request acts for one tenant: the owner of its API key (``gateway.auth = "on"``) or
  ``gateway.default_tenant``. Sessions are scoped by tenant: the same session id sent by two tenants
  names two sessions. Feedback may only target the caller's own generations and sessions; anything
  else is a 404, the same answer as for an id that never existed.
- A session keeps the model version it was first routed to (sticky, ``gateway.session_ttl_s`` after
  its last request); new sessions follow the rollout (tenant pin, canary share, stable). If no node
  holds the session's version any more, it moves to the current one and the move is counted.
- Rejected requests (auth, rate limit, too large, too slow, malformed, invalid fields, unknown model)
  never reach the upstream or the bus; they get a 4xx OpenAI envelope naming the offending field. A
  body must arrive whole within ``gateway.body_read_timeout_s`` (else 408 and the connection is
  closed; request heads are bounded by serving/server.py, docs/security.md).
- A node that serves each version under its own model name (a vLLM server in LoRA mode, whose
  heartbeat carries ``model_names``) is sent ``model = <its name for the session's version>``; its
  answer is turned back into the line's before anything else reads it (``routing.as_line``:
  ``model`` the line, ``model_version`` the version, the node id from its heartbeat), so the client
  and the captured event see exactly what a built-in node's answer gives. When such a node does not
  hold the version (no name for it, or vLLM's 404 for the model) the session moves on as after a
  409 ``version_unavailable``.
- Keys, prompts and completions are never logged at INFO or above.
- Admin routes need an admin key (auth on) or a loopback caller (auth off): capture depth, tenant
  pins, and the line's versions (``GET /admin/versions``; ``POST /admin/versions/{v}/promote``,
  ``.../rollback`` and ``.../pin``, and ``POST /admin/unpin``, the same as ``flywheel rollout
  promote|rollback|pin|unpin``; an optional JSON body ``{"reason": ..., "force": ...}``, where
  ``force`` only applies to promote and rollback). A refused action is a 409 whose code says why
  (``line_pinned``, ``not_pinned``, ``rollout_conflict``); the audit log names the admin key id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flywheel.events import new_id
from flywheel.keys import check_tenant
from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic, install_error_handlers
from serving.gateway import capture
from serving.gateway.auth import KeyStore, Ownership, Principal, require_admin
from serving.gateway.feedback import FeedbackServing
from serving.gateway.routing import Router, Upstream, as_line, new_session_version
from serving.gateway.shipper import Capture, CaptureFull, bus_producer_factory
from serving.gateway.state import GatewayState, StateUnavailable, make_state
from serving.gateway.upstream import Pool, Response as UpstreamResponse, UpstreamError
from serving.protocol import (
    GENERATION_HEADER,
    MODEL_VERSION_HEADER,
    NODE_HEADER,
    SESSION_HEADER,
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackItem,
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

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.generations = Counter("flywheel_generations_captured", "Generations accepted by the capture spool",
                                   ["model_version"], registry=registry)
        self.feedback = Counter("flywheel_feedback_captured", "Feedback events accepted by the capture spool",
                                registry=registry)
        self.rejected = Counter("flywheel_gateway_rejected", "Requests answered with an error", ["status"],
                                registry=registry)
        self.added = Histogram("flywheel_gateway_added_seconds",
                               "Time a completion spent in the gateway itself (total minus upstream)",
                               ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.upstream = Histogram("flywheel_upstream_seconds", "Upstream completion time (whole stream for streams)",
                                  ["model_version"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.stream_errors = Counter("flywheel_stream_errors", "Streams that ended with an error event (nothing recorded)",
                                     registry=registry)
        self.repinned = Counter("flywheel_sessions_repinned",
                                "Sessions moved to another version because no node held theirs any more",
                                registry=registry)


@dataclass
class _Call:
    """One completion request on its way through the gateway."""

    kind: capture.Kind
    body: dict[str, Any]  # the client's, recorded untouched
    request: capture.Request
    principal: Principal
    session_id: str
    version: int | None  # the session's pinned version (None: let the upstream choose)
    path: str
    upstream_body: bytes
    upstream_request: dict[str, Any] = field(default_factory=dict)  # what upstream_body encodes
    target: Upstream = Upstream("")  # where post() sent it (set by post)
    generation_id: str = field(default_factory=new_id)
    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] = field(default_factory=dict)  # for the client

    @property
    def tenant(self) -> str:
        return self.principal.tenant


class _UpstreamStreamError(Exception):
    """The upstream sent an error event inside its stream."""


class PinRequest(BaseModel):
    """``{"version": N}`` pins a tenant; clearing it takes an explicit ``{"version": null}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: int | None = Field(ge=0, le=2**31 - 1)


class RolloutActionRequest(BaseModel):
    """The optional body of ``POST /admin/versions/{v}/promote|rollback``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    #: Added to the audited reason.
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")
    #: On a pinned line: act anyway; the pin follows the new stable version (else 409 ``line_pinned``).
    force: bool = False


class LinePinRequest(BaseModel):
    """The optional body of ``POST /admin/versions/{v}/pin`` and ``POST /admin/unpin``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")


class Gateway:
    """The serving class behind the routes; its clients are opened by :meth:`start`."""

    def __init__(self, settings: Settings, producer_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.metrics = _Metrics(CollectorRegistry())
        self._producer_factory = producer_factory
        self._cleanup = contextlib.AsyncExitStack()
        self.capture: Capture
        self.state: GatewayState
        self.keys: KeyStore | None = None
        self.ownership: Ownership
        self.feedback_serving: FeedbackServing
        self.router: Router
        self.sessions: Any = None  # the database's session factory (admin version routes)
        self.http = Pool(settings.gateway.upstream_timeout_s)

    # Lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        from flywheel.db.session import make_session_factory, open_database
        from flywheel.live import make_live

        settings = self.settings
        stack = self._cleanup
        # The shipper makes producers itself: a bus that is down does not stop the gateway serving.
        producer_factory = self._producer_factory or bus_producer_factory(settings)
        self.capture = Capture(settings, producer_factory, self.metrics.registry)
        self.capture.start()
        stack.callback(self.capture.close, settings.gateway.drain_timeout_s)

        db = await asyncio.to_thread(open_database, settings.database_url, settings.db.wait_s)
        stack.callback(db.dispose)
        sessions = make_session_factory(db)
        self.state = make_state(settings)
        stack.push_async_callback(self.state.close)
        if settings.gateway.auth == "on":
            self.keys = KeyStore(sessions, settings.gateway.key_cache_s)
        self.ownership = Ownership(self.state, sessions, settings.gateway.ownership_ttl_s)
        self.feedback_serving = FeedbackServing(settings, self.state, self.ownership, self.submit,
                                                self.metrics.feedback.inc)
        live = make_live(settings)
        stack.callback(live.close)
        self.router = Router(settings, sessions, live, self.state.get_pins)
        stack.push_async_callback(self.router.close)
        self.sessions = sessions
        stack.callback(self.http.close)

    async def stop(self) -> None:
        await self._cleanup.aclose()

    # Who is asking -----------------------------------------------------------------------------

    async def principal(self, request: Request) -> Principal:
        if self.keys is None:
            return Principal("-", self.settings.gateway.default_tenant, "tenant", None)
        return await self.keys.authenticate(request.headers.get("authorization"))

    async def admin(self, request: Request) -> str:
        """Refuses anyone but an admin; returns who it is, for audit logs."""
        if self.keys is None:
            host = request.client.host if request.client else ""
            if host not in ("127.0.0.1", "::1", "localhost", "testclient"):
                raise APIError(403, "admin routes answer loopback callers only while gateway.auth is off",
                               code="admin_required")
            return f"admin API (loopback {host}, gateway.auth off)"
        principal = await self.keys.authenticate(request.headers.get("authorization"))
        require_admin(principal)
        return f"admin API key {principal.key_id}"

    async def limit(self, principal: Principal) -> None:
        rpm = principal.rate_limit_rpm if principal.rate_limit_rpm is not None else self.settings.gateway.rate_limit_rpm
        if rpm <= 0:
            return
        retry = await self.state.admit(principal.key_id, rpm, self.settings.gateway.rate_limit_burst)
        if retry is not None:
            seconds = max(1, int(retry + 0.999))
            raise APIError(429, f"rate limit of {rpm} requests per minute reached for this API key; "
                           f"retry in {seconds} s", code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})

    # Completions -------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "text", "/v1/completions")

    async def complete(self, request: Request, kind: capture.Kind, path: str) -> Response:
        started = time.perf_counter()
        principal = await self.principal(request)
        await self.limit(principal)
        try:
            self.capture.admit()
        except CaptureFull as exc:
            raise APIError(503, f"capture is unavailable ({exc}); the request was not served, retry later",
                           code="capture_unavailable") from None
        body = await read_json_body(request, self.settings.gateway.max_body_bytes,
                                    self.settings.gateway.body_read_timeout_s)
        parsed = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
        self.check_model(parsed.model)
        session_id = check_session_id(request.headers.get(SESSION_HEADER) or uuid.uuid4().hex)
        version = await self.pin(principal.tenant, session_id)
        upstream_request = capture.upstream_request(body, self.settings.model.line, kind)
        try:
            upstream_body = orjson.dumps(upstream_request)
        except TypeError as exc:  # e.g. an integer beyond 64 bits in a vendor field
            raise APIError(400, f"request body cannot be forwarded: {exc}", code="invalid_value") from None
        call = _Call(kind, body, parsed, principal, session_id, version, path, upstream_body, upstream_request,
                     started=started, headers={SESSION_HEADER: session_id})
        if parsed.stream:
            return await self.stream(call)
        return await self.complete_whole(call)

    def check_model(self, model: str | None) -> None:
        line = self.settings.model.line
        if model is not None and model != line:
            raise APIError(404, f"the model `{model}` does not exist; this gateway serves `{line}` (GET /v1/models)",
                           param="model", code="model_not_found")

    async def pin(self, tenant: str, session_id: str) -> int | None:
        """The session's version: its sticky one, or the rollout's choice for a new session."""
        # pin_session keeps a concrete pin that exists (first writer wins) and refreshes its TTL.
        proposal = new_session_version(await self.router.table(), tenant, session_id)
        return await self.state.pin_session(tenant, session_id, proposal, self.settings.gateway.session_ttl_s)

    async def repin(self, call: _Call) -> bool:
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

    def upstream_headers(self, call: _Call) -> dict[str, str]:
        headers = {SESSION_HEADER: call.session_id, "content-type": "application/json"}
        if call.version is not None:
            headers[MODEL_VERSION_HEADER] = str(call.version)
        return headers

    async def post(self, call: _Call) -> UpstreamResponse:
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
            except UpstreamError as exc:
                raise APIError(502, f"upstream {url} failed: {exc}", code="upstream_unreachable") from None
            model_gone = target.names_versions and response.status == 404  # vLLM: "The model `…` does not exist."
            if response.status != 409 and not model_gone:
                return response
            try:
                raw = await response.read()
            except UpstreamError as exc:
                raise APIError(502, f"upstream {url} broke off: {exc}", code="upstream_error") from None
            model_gone = model_gone and _error_field(raw, "type") == "NotFoundError"
            if _error_field(raw, "code") != "version_unavailable" and not model_gone:
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

    def not_served(self, call: _Call) -> APIError:
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

    async def complete_whole(self, call: _Call) -> Response:
        upstream_start = time.perf_counter()
        response = await self.post(call)
        try:
            raw = await response.read()
        except UpstreamError as exc:
            raise APIError(502, f"upstream response broke off: {exc}", code="upstream_error") from None
        upstream_s = time.perf_counter() - upstream_start
        if response.status >= 400:
            raise _upstream_error(response.status, raw, call.headers)
        try:
            response_body = orjson.loads(raw)
            if not isinstance(response_body, dict):
                raise ValueError("not a JSON object")
            response_body = as_line(response_body, call.target, self.settings.model.line)
            served = capture.extract_served(response_body, self.served_headers(response.headers, call.target),
                                            call.kind)
        except (ValueError, capture.CaptureError) as exc:
            raise _uncapturable(exc, call.headers) from None
        await self.record_generation(call, response_body, served, upstream_s)
        headers = {**call.headers, GENERATION_HEADER: call.generation_id, MODEL_VERSION_HEADER: str(served.model_version)}
        out = Response(orjson.dumps(capture.client_response(response_body, call.request)),
                       media_type="application/json", headers=headers)
        self.metrics.added.labels(call.kind).observe(max(0.0, time.perf_counter() - call.started - upstream_s))
        return out

    async def record_generation(self, call: _Call, response_body: dict[str, Any], served: capture.Served,
                                upstream_s: float) -> None:
        try:
            event = capture.generation_event(
                generation_id=call.generation_id, tenant=call.tenant, session_id=call.session_id,
                model_line=self.settings.model.line, request_body=call.body, request=call.request,
                response_body=response_body, served=served, latency_ms=upstream_s * 1000.0,
            )
        except ValidationError as exc:  # e.g. non-finite logprobs: never a partial or lossy event
            raise _uncapturable(exc, call.headers) from None
        version = str(served.model_version)
        self.metrics.upstream.labels(version).observe(upstream_s)
        if call.version is None:  # nothing to follow yet: the session stays on what served it
            await self.state.pin_session(call.tenant, call.session_id, served.model_version,
                                         self.settings.gateway.session_ttl_s)
        await self.state.record_generation(call.generation_id, call.tenant, call.session_id,
                                           self.settings.gateway.ownership_ttl_s)
        if await self.submit([event], call.headers):
            self.metrics.generations.labels(version).inc()

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

    async def stream(self, call: _Call) -> Response:
        """Proxy an upstream event stream; see the module docstring for what is recorded when."""
        upstream_start = time.perf_counter()
        upstream = await self.post(call)
        assembler = capture.StreamAssembler(call.kind, self.served_headers(upstream.headers, call.target))

        def relay(data: str) -> bytes | None:
            """Fold one upstream event into the capture; what the client gets of it."""
            try:
                chunk = json.loads(data)
            except ValueError:
                raise capture.CaptureError("upstream stream event is not JSON") from None
            if isinstance(chunk, dict) and chunk.get("error") is not None:
                raise _UpstreamStreamError(chunk["error"])
            if isinstance(chunk, dict):
                chunk = as_line(chunk, call.target, self.settings.model.line)
            assembler.feed(chunk)
            out = capture.client_chunk(chunk, call.request)
            return None if out is None else sse_event(out)

        events = sse_data(_lines(upstream))
        first: bytes | None = None
        try:
            if upstream.status >= 400:
                raise _upstream_error(upstream.status, await upstream.read(), call.headers)
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
            raise _uncapturable(exc, call.headers) from None
        except _UpstreamStreamError as exc:
            upstream.release()
            raise _stream_failure(exc, call.headers) from None
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
            except (APIError, capture.CaptureError, _UpstreamStreamError, UpstreamError, StateUnavailable) as exc:
                error = _stream_failure(exc, {})
                self.metrics.stream_errors.inc()
                log.warning("stream %s failed, nothing recorded: %s", call.generation_id, error.code or error.type)
                yield error.sse()
            finally:
                upstream.release()

        headers = {
            **call.headers,
            GENERATION_HEADER: call.generation_id,
            MODEL_VERSION_HEADER: str(assembler.version),
            "Cache-Control": "no-cache",
        }
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    # Feedback ----------------------------------------------------------------------------------

    async def feedback(self, request: Request) -> JSONResponse:
        principal = await self.principal(request)
        await self.limit(principal)
        return await self.feedback_serving(request, principal.tenant)

    # Models ------------------------------------------------------------------------------------

    async def models(self, request: Request) -> JSONResponse:
        await self.limit(await self.principal(request))
        await self.router.table()
        live = self.router.live_versions()
        line = self.settings.model.line
        return JSONResponse({"object": "list", "data": [
            {"id": line, "object": "model", "created": 0, "owned_by": "flywheel", "flywheel": live},
        ]})


async def _lines(response: UpstreamResponse) -> AsyncIterator[str]:
    """The lines of a response body without their line endings; no line-length limit (a chunk may
    carry a long prompt's token ids)."""
    pending = b""
    async for data in response.chunks():
        pending += data
        *whole, pending = pending.split(b"\n")
        for line in whole:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


def _error_field(raw: bytes, key: str) -> Any:
    """A field of an upstream error body: ``{"error": {...}}`` or vLLM's older flat envelope."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    return err.get(key) if isinstance(err, dict) else body.get(key)


def _uncapturable(exc: Exception, headers: dict[str, str]) -> APIError:
    return APIError(502, f"upstream response cannot be captured: {exc}", code="bad_upstream_response", headers=headers)


def _stream_failure(exc: BaseException, headers: dict[str, str]) -> APIError:
    """The envelope a stream that broke off ends with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StateUnavailable):
        return _state_unavailable(exc)
    if isinstance(exc, capture.CaptureError):
        return _uncapturable(exc, headers)
    if isinstance(exc, _UpstreamStreamError):
        err = exc.args[0]
        message = err.get("message") if isinstance(err, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        return APIError(502, f"upstream failed mid-stream: {message or err!r}",
                        code=code if isinstance(code, str) else "upstream_error", headers=headers)
    return APIError(502, f"upstream stream broke off: {exc}", code="upstream_error", headers=headers)


def _state_unavailable(exc: StateUnavailable) -> APIError:
    """Redis (or whatever holds sessions and rate limits) is down: a 503, here or mid-stream."""
    log.error("gateway state unavailable: %s", type(exc.__cause__ or exc).__name__)
    return APIError(503, "session and rate-limit state is unavailable right now; retry shortly",
                    code="state_unavailable")


def _upstream_error(status: int, raw: bytes, headers: dict[str, str]) -> APIError:
    """Upstream 4xx pass through (their envelope kept); anything else is a 502."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    err = err if isinstance(err, dict) else {}
    message = err.get("message") or raw[:500].decode("utf-8", errors="replace") or f"HTTP {status}"
    if 400 <= status < 500:
        return APIError(status, message, param=err.get("param"), code=err.get("code"),
                        type=err.get("type") or None, headers=headers)
    return APIError(502, f"upstream returned HTTP {status}: {message}", code="upstream_error", headers=headers)


class _SessionEcho:
    """ASGI middleware: every response names the client's session (errors included), and error
    responses are counted by status. Pure ASGI: a BaseHTTPMiddleware costs more than the gateway."""

    def __init__(self, app: Any, metrics: _Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        session = next((v for k, v in scope["headers"] if k == b"x-flywheel-session"), None)

        async def send_with_session(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400:
                    self.metrics.rejected.labels(str(status)).inc()
                headers = message.get("headers") or []
                if session is not None and not any(k.lower() == b"x-flywheel-session" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-flywheel-session", session)]}
            await send(message)

        await self.app(scope, receive, send_with_session)


def create_app(settings: Settings, *, producer_factory: Callable[[], Any] | None = None) -> FastAPI:
    """The gateway app; see the module docstring for what its lifespan opens and closes."""
    gateway = Gateway(settings, producer_factory)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await gateway.start()
            yield
        finally:
            await gateway.stop()

    # No trailing-slash redirects: their Location is built from the Host header (docs/security.md).
    app = FastAPI(title="flywheel gateway", docs_url=None, redoc_url=None, lifespan=lifespan, redirect_slashes=False)
    app.state.gateway = gateway
    install_error_handlers(app)

    @app.exception_handler(StateUnavailable)
    async def _state_unavailable_response(_: Request, exc: StateUnavailable) -> JSONResponse:
        return _state_unavailable(exc).response()
    app.add_middleware(_SessionEcho, metrics=gateway.metrics)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gateway.chat_completions(request)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gateway.completions(request)

    @app.post("/v1/feedback", status_code=202, openapi_extra=_body_schema(FeedbackItem))
    async def feedback(request: Request) -> JSONResponse:
        return await gateway.feedback(request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return await gateway.models(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model_line": settings.model.line, "capture": gateway.capture.depth()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/capture")
    async def admin_capture(request: Request) -> dict[str, Any]:
        await gateway.admin(request)
        return gateway.capture.depth()

    @app.get("/admin/pins")
    async def admin_pins(request: Request) -> dict[str, Any]:
        await gateway.admin(request)
        return {"pins": await gateway.state.get_pins()}

    @app.get("/admin/versions")
    async def admin_versions(request: Request) -> dict[str, Any]:
        await gateway.admin(request)
        from serving.rollout import status_report

        registry = _registry(settings, gateway.sessions)
        return await asyncio.to_thread(lambda: json.loads(json.dumps(
            status_report(registry, gateway.sessions, settings.rollout), default=str)))

    @app.post("/admin/versions/{version}/{action}", openapi_extra=_optional_body_schema(RolloutActionRequest))
    async def admin_version_action(version: int, action: str, request: Request) -> dict[str, Any]:
        """``promote``, ``rollback`` or ``pin`` a version, exactly as ``flywheel rollout promote|rollback|pin``."""
        who = await gateway.admin(request)
        from flywheel.weights.registry import VersionNotFound
        from serving.rollout import RolloutError, announce, manual_pin, manual_promote, manual_rollback, pin_figures

        if action not in ("promote", "rollback", "pin"):
            raise APIError(404, f"unknown version action {action!r}; promote, rollback or pin", code="not_found")
        body = await _optional_body(request, LinePinRequest if action == "pin" else RolloutActionRequest,
                                    settings.gateway.body_read_timeout_s)
        if not 0 <= version < 2**31:
            raise APIError(404, f"version {version} of {settings.model.line} is not in the registry",
                           param="version", code="version_not_found")
        registry = _registry(settings, gateway.sessions)

        def apply() -> dict[str, Any]:
            pin = None
            if isinstance(body, LinePinRequest):
                pin, changed = manual_pin(registry, version, who, body.reason)
            else:
                act = manual_promote if action == "promote" else manual_rollback
                note = f"{who}: {body.reason}" if body.reason else who
                changed = act(registry, version, note, force=body.force, by=who)
            infos = [registry.get(v) for v in changed]
            try:
                announce(settings, infos)
            except Exception as exc:  # the bus is down: the change stands (nodes follow the registry)
                log.warning("version change not announced on the bus: %s", exc)
            result: dict[str, Any] = {"changed": [{"version": i.version, "status": i.status} for i in infos]}
            if pin is not None:
                result["pin"] = pin_figures(pin)
            return result

        try:
            result = await asyncio.to_thread(apply)
        except VersionNotFound:
            raise APIError(404, f"version {version} of {settings.model.line} is not in the registry",
                           param="version", code="version_not_found") from None
        except RolloutError as exc:
            raise APIError(409, str(exc), code=exc.code) from None
        await gateway.router.refresh()
        return result

    @app.post("/admin/unpin", openapi_extra=_optional_body_schema(LinePinRequest))
    async def admin_unpin(request: Request) -> dict[str, Any]:
        """Lift the line's rollout pin, exactly as ``flywheel rollout unpin``."""
        who = await gateway.admin(request)
        from serving.rollout import RolloutError, manual_unpin, pin_figures

        body = await _optional_body(request, LinePinRequest, settings.gateway.body_read_timeout_s)
        registry = _registry(settings, gateway.sessions)
        try:
            lifted = await asyncio.to_thread(manual_unpin, registry, who, body.reason)
        except RolloutError as exc:
            raise APIError(409, str(exc), code="not_pinned") from None
        return {"unpinned": pin_figures(lifted)}

    @app.put("/admin/pins/{tenant}", openapi_extra=_body_schema(PinRequest))
    async def admin_set_pin(tenant: str, request: Request) -> dict[str, Any]:
        await gateway.admin(request)
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tenant", code="invalid_value") from None
        body = await read_json_body(request, 4096, settings.gateway.body_read_timeout_s)
        try:
            pin = PinRequest.model_validate(body)
        except ValidationError as exc:
            raise from_pydantic(exc) from None
        if pin.version is not None and not await gateway.router.registered(pin.version):
            raise APIError(404, f"version {pin.version} of {settings.model.line} is not in the registry",
                           param="version", code="version_not_found")
        await gateway.state.set_pin(tenant, pin.version)
        await gateway.router.refresh()
        held = pin.version is None or any(pin.version in n["versions"] for n in gateway.router.live_versions()["nodes"])
        return {"tenant": tenant, "version": pin.version, "served": held}

    openapi = app.openapi

    def openapi_with_bodies() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _BODIES:
                components.update(model.model_json_schema(ref_template=_REF).get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi_with_bodies  # type: ignore[method-assign]
    return app


def _registry(settings: Settings, sessions: Any) -> Any:
    """The line's registry for the admin version routes (status changes only: no weights move)."""
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store
    from serving.rollout import node_waker

    return Registry(sessions, make_store(settings), settings.model.line, announce=node_waker(settings))


_REF = "#/components/schemas/{model}"
_Body = TypeVar("_Body", bound=BaseModel)
_BODIES: list[type[BaseModel]] = []


def _optional_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """:func:`_body_schema` for a route whose body may be left out (every field has a default)."""
    extra = _body_schema(model)
    extra["requestBody"]["required"] = False
    return extra


async def _optional_body(request: Request, model: type[_Body], timeout_s: float) -> _Body:
    """The request body as ``model``; no body at all gives ``model()`` (its defaults)."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return model()
    try:
        return model.model_validate(await read_json_body(request, 4096, timeout_s))
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its own body, so the schema (and schema
    fuzzers) know what it accepts; the models it refers to are added to the components."""
    if model not in _BODIES:
        _BODIES.append(model)
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
