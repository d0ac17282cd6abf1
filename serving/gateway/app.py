"""The gateway: an OpenAI-compatible proxy that captures every generation and accepts feedback.

``create_app(settings, bus_producer, http_client)`` builds the app once with its clients injected.

Invariants:
- A generation is on the bus (durably) before its response is returned; if it cannot be recorded
  the client gets a 503 and may retry: capture never loses an event it acknowledged.
- A stream (``stream: true``, chat or text) is proxied chunk by chunk as the upstream sends it and
  recorded as exactly one event, once the upstream's last chunk has arrived and before the client
  gets ``data: [DONE]``; ``[DONE]`` is the acknowledgement. A stream that breaks off (upstream
  error event, dropped connection, missing ``[DONE]``, uncapturable chunk, bus refusal) ends with
  an OpenAI error envelope as its last event, no ``[DONE]``, and nothing recorded. Errors found
  before the first byte (bad input, upstream 4xx, unreachable upstream) are ordinary HTTP errors.
- Streams send ``X-Flywheel-Session``, ``X-Flywheel-Generation`` and ``X-Flywheel-Model-Version``
  with their headers: the version comes from the upstream's response header, or its first chunk.
- Rejected requests (too large, malformed JSON, invalid fields) never reach the upstream or the
  bus; they get a 4xx OpenAI envelope naming the offending field.
- Feedback event ids derive from the tenant and the client's ``feedback_id``: a retried
  submission is the same event, so downstream consumers count it once.
- Every response carries ``X-Flywheel-Session`` (the client's or a generated one).

Seams for later issues: :meth:`Gateway.tenant` (auth), :meth:`Gateway.route` (sticky sessions and
canaries pick the upstream per session).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import ValidationError

from flywheel.events import new_id
from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic, install_error_handlers
from serving.gateway import capture
from serving.protocol import (
    GENERATION_HEADER,
    MODEL_VERSION_HEADER,
    SESSION_HEADER,
    SSE_DONE,
    FeedbackBatch,
    FeedbackItem,
    check_session_id,
    parse_chat_request,
    parse_completion_request,
    read_json_body,
    sse_data,
    sse_event,
)

log = logging.getLogger(__name__)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.generations = Counter(
            "flywheel_generations_captured", "Generations recorded on the bus", registry=self.registry
        )
        self.feedback = Counter("flywheel_feedback_captured", "Feedback events recorded on the bus", registry=self.registry)
        self.rejected = Counter(
            "flywheel_gateway_rejected", "Requests answered with an error", ["status"], registry=self.registry
        )
        self.capture_failures = Counter(
            "flywheel_capture_failures", "Events the bus refused (answered 503)", registry=self.registry
        )
        self.upstream_latency = Histogram(
            "flywheel_upstream_latency_seconds", "Upstream completion latency (whole stream for streams)",
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "flywheel_stream_errors", "Streams that ended with an error event (nothing recorded)", registry=self.registry
        )


@dataclass
class _Call:
    """One completion request on its way through the gateway."""

    kind: capture.Kind
    body: dict[str, Any]  # the client's, recorded untouched
    request: capture.Request
    tenant: str
    session_id: str
    generation_id: str
    url: str
    upstream_body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # for the client


class _UpstreamStreamError(Exception):
    """The upstream sent an error event inside its stream."""

class Gateway:
    """The serving class behind the routes; built once at start-up."""

    def __init__(self, settings: Settings, bus_producer: Any, http_client: httpx.AsyncClient) -> None:
        if settings.gateway.auth == "on":
            # Tenant API keys arrive with the auth issue; refusing to start beats serving unauthenticated.
            raise NotImplementedError("gateway.auth = 'on' is not implemented yet; use 'off'")
        self.settings = settings
        self.http = http_client
        self.recorder = capture.Recorder(
            bus_producer, settings.topic("generations"), settings.topic("feedback")
        )
        self.metrics = _Metrics()
        self.upstream = (settings.gateway.upstream or f"http://{settings.node.host}:{settings.node.port}").rstrip("/")

    # Seams -------------------------------------------------------------------------------------

    def tenant(self, request: Request) -> str:
        """The tenant a request acts for (auth off: the default tenant)."""
        return self.settings.gateway.default_tenant

    def route(self, session_id: str) -> str:
        """The upstream base URL serving this session (one upstream for now)."""
        return self.upstream

    # Helpers -----------------------------------------------------------------------------------

    async def read_json(self, request: Request) -> Any:
        return await read_json_body(request, self.settings.gateway.max_body_bytes)

    def session_id(self, request: Request, explicit: str | None = None) -> str:
        return check_session_id(explicit or request.headers.get(SESSION_HEADER) or uuid.uuid4().hex)

    async def record(self, events: list[Any]) -> None:
        try:
            await run_in_threadpool(self.recorder.send, events)
        except Exception as exc:  # the bus is down or refused: the client must retry, nothing acknowledged
            self.metrics.capture_failures.inc(len(events))
            log.error("could not record %d event(s) on the bus: %s", len(events), exc)
            raise APIError(
                503, "the event bus is unavailable; the request was not recorded, retry later", code="capture_unavailable"
            ) from exc

    # Endpoints ---------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        return await self.complete(request, body, parse_chat_request(body), "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        return await self.complete(request, body, parse_completion_request(body), "text", "/v1/completions")

    async def complete(
        self, request: Request, body: dict[str, Any], parsed: capture.Request, kind: capture.Kind, path: str
    ) -> Response:
        session_id = self.session_id(request)
        call = _Call(
            kind=kind,
            body=body,
            request=parsed,
            tenant=self.tenant(request),
            session_id=session_id,
            generation_id=new_id(),
            url=f"{self.route(session_id)}{path}",
            upstream_body=capture.upstream_request(body, self.settings.model.line, kind),
            headers={SESSION_HEADER: session_id},
        )
        if parsed.stream:
            return await self.stream(call)

        start = time.perf_counter()
        try:
            upstream = await self.http.post(
                call.url,
                json=call.upstream_body,
                headers={SESSION_HEADER: session_id},
                timeout=self.settings.gateway.upstream_timeout_s,
            )
        except httpx.HTTPError as exc:
            raise _unreachable(call.url, exc) from exc
        latency_ms = (time.perf_counter() - start) * 1000.0
        self.metrics.upstream_latency.observe(latency_ms / 1000.0)

        if upstream.status_code >= 400:
            raise _upstream_error(upstream, call.headers)
        try:
            response_body = upstream.json()
            if not isinstance(response_body, dict):
                raise ValueError("not a JSON object")
            served = capture.extract_served(response_body, upstream.headers, kind)
        except (ValueError, capture.CaptureError) as exc:
            raise _uncapturable(exc, call.headers) from None

        await self.record([self.event(call, response_body, served, latency_ms)])
        self.metrics.generations.inc()
        headers = {**call.headers, GENERATION_HEADER: call.generation_id, MODEL_VERSION_HEADER: str(served.model_version)}
        return JSONResponse(capture.client_response(response_body, parsed), headers=headers)

    def event(self, call: _Call, response_body: dict[str, Any], served: capture.Served, latency_ms: float) -> Any:
        try:
            return capture.generation_event(
                generation_id=call.generation_id,
                tenant=call.tenant,
                session_id=call.session_id,
                model_line=self.settings.model.line,
                request_body=call.body,
                request=call.request,
                response_body=response_body,
                served=served,
                latency_ms=latency_ms,
            )
        except ValidationError as exc:  # e.g. non-finite logprobs: never a partial or lossy event
            raise _uncapturable(exc, call.headers) from None

    async def stream(self, call: _Call) -> Response:
        """Proxy an upstream event stream; see the module docstring for what is recorded when."""
        start = time.perf_counter()
        upstream_request = self.http.build_request(
            "POST",
            call.url,
            json=call.upstream_body,
            headers={SESSION_HEADER: call.session_id},
            timeout=self.settings.gateway.upstream_timeout_s,
        )
        try:
            upstream = await self.http.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            raise _unreachable(call.url, exc) from exc

        assembler = capture.StreamAssembler(call.kind, upstream.headers)

        def relay(data: str) -> bytes | None:
            """Fold one upstream event into the capture; what the client gets of it."""
            try:
                chunk = json.loads(data)
            except ValueError:
                raise capture.CaptureError(f"upstream stream event is not JSON: {data[:200]!r}") from None
            if isinstance(chunk, dict) and chunk.get("error") is not None:
                raise _UpstreamStreamError(chunk["error"])
            assembler.feed(chunk)
            out = capture.client_chunk(chunk, call.request)
            return None if out is None else sse_event(out)

        events = sse_data(upstream.aiter_lines())
        first: bytes | None = None
        try:
            if upstream.status_code >= 400:
                await upstream.aread()
                raise _upstream_error(upstream, call.headers)
            content_type = upstream.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                raise APIError(502, f"upstream answered a stream request with content-type {content_type!r}, "
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
            await upstream.aclose()
            raise _uncapturable(exc, call.headers) from None
        except _UpstreamStreamError as exc:
            await upstream.aclose()
            raise _stream_failure(exc, call.headers) from None
        except httpx.HTTPError as exc:
            await upstream.aclose()
            raise APIError(502, f"upstream stream broke off: {type(exc).__name__}: {exc}", code="upstream_error",
                           headers=call.headers) from exc
        except BaseException:
            await upstream.aclose()
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
                latency_ms = (time.perf_counter() - start) * 1000.0
                self.metrics.upstream_latency.observe(latency_ms / 1000.0)
                response_body, served = assembler.finish()
                await self.record([self.event(call, response_body, served, latency_ms)])
                self.metrics.generations.inc()
                yield SSE_DONE
            except (APIError, capture.CaptureError, _UpstreamStreamError, httpx.HTTPError) as exc:
                error = _stream_failure(exc, {})
                self.metrics.stream_errors.inc()
                log.warning("stream %s for session %s failed, nothing recorded: %s",
                            call.generation_id, call.session_id, error.message)
                yield error.sse()
            finally:
                await upstream.aclose()

        headers = {
            **call.headers,
            GENERATION_HEADER: call.generation_id,
            MODEL_VERSION_HEADER: str(assembler.version),
            "Cache-Control": "no-cache",
        }
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def feedback(self, request: Request) -> JSONResponse:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object (one feedback item or {\"feedback\": [...]})")
        batch = "feedback" in body
        try:
            items = FeedbackBatch.model_validate(body).feedback if batch else [FeedbackItem.model_validate(body)]
        except ValidationError as exc:
            raise from_pydantic(exc) from None

        tenant = self.tenant(request)
        header_session = request.headers.get(SESSION_HEADER)
        events = []
        for i, item in enumerate(items):
            prefix = f"feedback.{i}." if batch else ""
            problem = capture.feedback_problem(item)
            if problem:
                raise APIError(400, problem, param=f"{prefix}signal", code="invalid_value")
            session_id = item.session_id or header_session
            if not session_id:
                raise APIError(
                    400,
                    f"feedback needs a session: set {prefix}session_id or the {SESSION_HEADER} header",
                    param=f"{prefix}session_id",
                    code="missing_required_parameter",
                )
            events.append(capture.feedback_event(item, tenant=tenant, session_id=self.session_id(request, session_id)))

        await self.record(events)
        self.metrics.feedback.inc(len(events))
        headers = {SESSION_HEADER: events[0].session_id} if len(events) == 1 else {}
        return JSONResponse(
            {"accepted": len(events), "event_ids": [e.event_id for e in events]}, status_code=202, headers=headers
        )


def _unreachable(url: str, exc: httpx.HTTPError) -> APIError:
    return APIError(502, f"upstream {url} failed: {type(exc).__name__}: {exc}", code="upstream_unreachable")


def _uncapturable(exc: Exception, headers: dict[str, str]) -> APIError:
    return APIError(502, f"upstream response cannot be captured: {exc}", code="bad_upstream_response", headers=headers)


def _stream_failure(exc: Exception, headers: dict[str, str]) -> APIError:
    """The envelope a stream that broke off ends with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, capture.CaptureError):
        return _uncapturable(exc, headers)
    if isinstance(exc, _UpstreamStreamError):
        err = exc.args[0]
        message = err.get("message") if isinstance(err, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        return APIError(502, f"upstream failed mid-stream: {message or err!r}",
                        code=code if isinstance(code, str) else "upstream_error", headers=headers)
    return APIError(502, f"upstream stream broke off: {type(exc).__name__}: {exc}", code="upstream_error",
                    headers=headers)


def _upstream_error(upstream: httpx.Response, headers: dict[str, str]) -> APIError:
    """Upstream 4xx pass through (their envelope kept); anything else is a 502."""
    try:
        err = upstream.json().get("error")
    except (ValueError, AttributeError):
        err = None
    message = (err or {}).get("message") if isinstance(err, dict) else None
    message = message or upstream.text[:500] or f"HTTP {upstream.status_code}"
    if 400 <= upstream.status_code < 500:
        return APIError(
            upstream.status_code,
            message,
            param=err.get("param") if isinstance(err, dict) else None,
            code=err.get("code") if isinstance(err, dict) else None,
            type=err.get("type") if isinstance(err, dict) and err.get("type") else None,
            headers=headers,
        )
    return APIError(502, f"upstream returned HTTP {upstream.status_code}: {message}", code="upstream_error", headers=headers)


def create_app(settings: Settings, bus_producer: Any, http_client: httpx.AsyncClient) -> FastAPI:
    """The gateway app. It owns ``http_client`` from now on: the client is closed at shutdown, inside
    the event loop that used it. ``bus_producer`` stays the caller's to flush and close."""
    gateway = Gateway(settings, bus_producer, http_client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await http_client.aclose()

    app = FastAPI(title="flywheel gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)

    @app.middleware("http")
    async def _echo_session_and_count_errors(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        session = request.headers.get(SESSION_HEADER)
        if session and SESSION_HEADER not in response.headers:
            response.headers[SESSION_HEADER] = session
        if response.status_code >= 400:
            gateway.metrics.rejected.labels(status=str(response.status_code)).inc()
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.completions(request)

    @app.post("/v1/feedback", status_code=202)
    async def feedback(request: Request) -> JSONResponse:
        return await gateway.feedback(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        url = f"{gateway.upstream}/v1/models"
        try:
            upstream = await gateway.http.get(url, timeout=settings.gateway.upstream_timeout_s)
        except httpx.HTTPError as exc:
            raise _unreachable(url, exc) from exc
        if upstream.status_code >= 400:
            raise _upstream_error(upstream, {})
        return JSONResponse(upstream.json())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "upstream": gateway.upstream, "model_line": settings.model.line}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
