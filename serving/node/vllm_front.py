"""The HTTP front of a full-mode vLLM node: vLLM's answers, stamped with the version that produced them.

A vLLM server reloaded in place (``node.vllm_mode = "full"``) names no weight version in its answers,
so the node process serves this front on ``node.host:node.port`` (the URL its heartbeat carries)
and the gateway talks to it exactly as to a built-in node (``serving/node/app.py``):
``/v1/chat/completions`` and ``/v1/completions`` (whole or streamed) are forwarded to vLLM at
``node.vllm_url`` with ``model`` = vLLM's served model name, and every answer, and every stream
chunk, comes back with ``model`` = the line, ``model_version`` = the version, and the headers
``X-Flywheel-Model-Version`` and ``X-Flywheel-Node``. ``/v1/models``, ``/health`` and the loopback
``POST /admin/update_weights`` answer as the built-in node's do.

Exactness comes from :class:`VersionGate`, a reader/writer lock on the live version shared with
the :class:`~serving.node.vllm_adapter.VllmAdapter`:

- Every request holds it shared from before it reads the live version until vLLM's answer has been
  relayed to the end (a stream: until its last event, or until it breaks off). A full-weight reload
  holds it exclusively from before vLLM is paused until the adapter has recorded the new (or
  restored, or unknown) version. So the version a request is stamped with is the one vLLM held for
  the whole generation: an in-flight request finishes on the version it started with, and the
  reload waits for it.
- The lock prefers the writer: once a reload waits, new requests queue behind it. They wait at most
  ``wait_s``, then get 503 ``version_loading`` with ``Retry-After``; a reload waits at most
  ``VersionGate.drain_timeout_s`` for requests in flight, then fails without touching vLLM (the
  node keeps serving, and stamping, the old version; the Updater reports ``failed_update``).
- A request naming a version (``X-Flywheel-Model-Version``, the gateway's sticky session) that is
  not the live one gets the built-in node's 409 ``version_unavailable``. While the adapter does not
  know vLLM's weights (a failed reload whose restore failed too), requests get 503 ``not_ready``
  and ``/health`` answers 503 ``unknown``: nothing is served under a version it may not be.
- vLLM's errors come back in the one OpenAI envelope: a 4xx keeps its status, message, type and
  param; anything else is a 502 (``upstream_error``), a 504 when vLLM did not answer in time. An
  answer that names another model than the one sent is a 502 ``bad_upstream_response``. Inside a
  stream the same envelope is the last event, with no ``[DONE]``.

On a vLLM that labels its weights (0.33, the adapter's ``weight_versions``), every forwarded request
asks for ``return_weight_versions`` and each choice's labels (``weight_versions``: the label that
sampled each range of its tokens) must all be the stamped version's (``adapter.weight_label``):
otherwise the answer is a 502 ``weight_version_mismatch``, never a mislabelled one (in a stream:
the error event, no ``[DONE]``). The field reaches the client only when the client asked for it.
Calls to vLLM carry ``Authorization: Bearer node.vllm_api_key`` when it is set.

The front neither validates sampling options beyond the shared request models (vLLM does) nor
rewrites anything else of the body: vendor fields reach vLLM untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic, install_error_handlers
from serving.node.app import UpdateWeightsRequest, is_loopback, requested_version
from serving.node.engine import VersionUnavailable
from serving.protocol import (
    MODEL_VERSION_HEADER,
    NODE_HEADER,
    SSE_DONE,
    parse_chat_request,
    parse_completion_request,
    read_json_body,
    sse_data,
    sse_event,
)

#: How long a new request waits for a reload under way before it is answered 503.
WAIT_S = 30.0
#: How long a reload waits for the requests in flight before it gives up (weights untouched); the
#: adapter's default bound on vLLM's own drain (``/pause?mode=wait``), which this one replaces.
DRAIN_TIMEOUT_S = 600.0
#: Read time-out of a call to vLLM (a whole answer, or the gap between two stream events).
REQUEST_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 5.0


class DrainTimeout(TimeoutError):
    """A reload gave up waiting for the requests in flight; nothing was changed."""


class VersionGate:
    """A reader/writer lock on the live version, preferring the writer.

    Readers are requests on the front's event loop (:meth:`acquire_shared`, :meth:`release_shared`);
    they never block the loop: a reader that must wait parks a future that the writer resolves.
    The writer is the thread that reloads vLLM (:meth:`exclusive`). The internal mutex is held only
    for bookkeeping, never across IO."""

    def __init__(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.drain_timeout_s = drain_timeout_s
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False  # a writer holds the lock or waits for the readers to leave
        self._queued: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def readers(self) -> int:
        """Requests holding the live version now."""
        with self._cond:
            return self._readers

    @property
    def queued(self) -> int:
        """Requests waiting for a reload to finish."""
        with self._cond:
            return len(self._queued)

    @property
    def reloading(self) -> bool:
        """A reload holds the lock or waits for the requests in flight."""
        with self._cond:
            return self._writer

    async def acquire_shared(self, timeout_s: float) -> bool:
        """Hold the live version; False if a reload kept it for more than ``timeout_s``."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._writer:
                self._readers += 1
                return True
            entry = (loop, loop.create_future())
            self._queued.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), timeout_s)
            return True
        except BaseException as exc:  # timed out or cancelled: leave the queue, or give back what was granted
            with self._cond:
                granted = entry not in self._queued
                if not granted:
                    self._queued.remove(entry)
            if granted:
                self.release_shared()
            if isinstance(exc, TimeoutError):
                return False
            raise

    def release_shared(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the live version alone: wait for the requests in flight (new ones queue), at most
        ``drain_timeout_s``, else raise :class:`DrainTimeout` and let the queued requests in."""
        with self._cond:
            while self._writer:  # one writer at a time
                self._cond.wait()
            self._writer = True
            if not self._cond.wait_for(lambda: self._readers == 0, timeout=self.drain_timeout_s):
                left = self._readers
                self._open()
                raise DrainTimeout(f"{left} request(s) still in flight after {self.drain_timeout_s:g}s; "
                                   "the reload was not started")
        try:
            yield
        finally:
            with self._cond:
                self._open()

    def _open(self) -> None:
        """Let every queued reader in (the mutex is held)."""
        self._writer = False
        queued, self._queued = self._queued, []
        for loop, future in queued:
            self._readers += 1
            try:
                loop.call_soon_threadsafe(_grant, future)
            except RuntimeError:  # its event loop has closed: nobody will release it
                self._readers -= 1
        self._cond.notify_all()


def _grant(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Hold:
    """One request's shared hold on the gate, released exactly once."""

    def __init__(self, gate: VersionGate) -> None:
        self._gate: VersionGate | None = gate

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release_shared()


class VllmFront:
    """The serving class behind the front's routes (see the module docstring); :meth:`start` opens
    its HTTP client to vLLM on the serving event loop, :meth:`close` closes it."""

    def __init__(self, adapter: Any, gate: VersionGate, settings: Settings, updater: Any = None, *,
                 wait_s: float = WAIT_S, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.adapter = adapter
        self.gate = gate
        self.settings = settings
        self.updater = updater
        self.line = settings.model.line
        self.node_id = settings.node.node_id
        self.served_model = adapter.served_model_name or self.line
        self.vllm_url = settings.node.vllm_url.rstrip("/")
        self.wait_s = wait_s
        self.requests = 0  # forwarded to vLLM
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._transport = transport
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        key = self.settings.node.vllm_api_key
        self.http = httpx.AsyncClient(base_url=self.vllm_url, timeout=self._timeout, transport=self._transport,
                                      headers={"Authorization": f"Bearer {key}"} if key else None,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    # Completions -------------------------------------------------------------------------------

    async def complete(self, request: Request, path: str) -> Response:
        body = await read_json_body(request, self.settings.node.max_body_bytes)
        parse = parse_chat_request if path.endswith("chat/completions") else parse_completion_request
        parsed = parse(body, max_n=self.settings.node.max_n)
        if parsed.model is not None and parsed.model != self.line:
            raise APIError(404, f"the model `{parsed.model}` does not exist; this node serves `{self.line}`",
                           param="model", code="model_not_found")
        wanted = requested_version(request)
        hold, version = await self.hold(wanted)
        relayed = False
        labels = _Labels(self.adapter, version, body.get("return_weight_versions") is True)
        try:
            forwarded = {**body, "model": self.served_model}
            if labels.check:
                forwarded["return_weight_versions"] = True
            response = await self.send(path, forwarded)
            try:
                if response.status_code != 200:
                    raise _vllm_error(response.status_code, await response.aread())
                headers = {MODEL_VERSION_HEADER: str(version), NODE_HEADER: self.node_id}
                if parsed.stream:
                    content_type = response.headers.get("content-type", "")
                    if not content_type.startswith("text/event-stream"):
                        raise APIError(502, f"vLLM answered a stream request with content-type {content_type[:80]!r}",
                                       code="bad_upstream_response")
                    relayed = True
                    return _HeldStream(self.relay(response, version, hold, labels), hold, response,
                                       headers={**headers, "Cache-Control": "no-cache"})
                raw = await response.aread()
            except httpx.HTTPError as exc:
                raise _broken(exc) from None
            finally:
                if not relayed:
                    await response.aclose()
            try:
                answer = json.loads(raw)
                if not isinstance(answer, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                raise APIError(502, f"vLLM's answer is not a JSON object: {exc}", code="bad_upstream_response") from None
            return JSONResponse(labels.checked(self.stamp(answer, version)), headers=headers)
        finally:
            if not relayed:
                hold.release()

    async def hold(self, wanted: int | None) -> tuple[_Hold, int]:
        """Hold the live version for one request (see the module docstring): the hold and the version."""
        if not await self.gate.acquire_shared(self.wait_s):
            retry = max(1, math.ceil(self.wait_s))
            raise APIError(503, f"the node is loading a new version and was still loading it after {self.wait_s:g}s; "
                           f"retry in {retry} s", code="version_loading", headers={"Retry-After": str(retry)})
        hold = _Hold(self.gate)
        version, _ = self.adapter.current()
        if version is None:
            hold.release()
            detail = getattr(self.updater, "detail", "") or "a weight update failed"
            raise APIError(503, f"this node does not know which weights vLLM holds ({detail}); it serves again "
                           "once an update succeeds", code="not_ready", headers={"Retry-After": "5"})
        if wanted is not None and wanted != version:
            hold.release()
            raise APIError(409, f"{VersionUnavailable(wanted, [version])}; start a new session or ask for one of those",
                           param=MODEL_VERSION_HEADER, code="version_unavailable")
        return hold, version

    async def send(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST ``body`` to vLLM; the response with its body unread."""
        assert self.http is not None, "VllmFront.start() was not called"
        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except ValueError as exc:  # NaN and the like cannot be forwarded as JSON
            raise APIError(400, f"request body cannot be forwarded: {exc}", code="invalid_value") from None
        request = self.http.build_request("POST", path, content=payload, headers={"content-type": "application/json"})
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _broken(exc) from None
        self.requests += 1
        return response

    def stamp(self, answer: dict[str, Any], version: int) -> dict[str, Any]:
        """vLLM's answer (or one stream chunk) as the line's, produced by ``version``."""
        model = answer.get("model")
        if model is not None and model != self.served_model:
            raise APIError(502, f"vLLM answered for model {model!r}, sent {self.served_model!r}",
                           code="bad_upstream_response")
        return {**answer, "model": self.line, "model_version": version}

    async def relay(self, response: httpx.Response, version: int, hold: _Hold,
                    labels: _Labels | None = None) -> AsyncIterator[bytes]:
        """vLLM's event stream, each chunk stamped; the hold is released when it ends, however."""
        try:
            async for data in sse_data(response.aiter_lines()):
                if data.strip() == "[DONE]":
                    yield SSE_DONE
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    chunk = None
                if not isinstance(chunk, dict):
                    raise APIError(502, "vLLM sent a stream event that is not a JSON object",
                                   code="bad_upstream_response")
                if chunk.get("error") is not None or chunk.get("object") == "error":
                    yield _vllm_error(_status_of(chunk), json.dumps(chunk).encode()).sse()
                    return
                stamped = self.stamp(chunk, version)
                yield sse_event(labels.checked(stamped, stream=True) if labels is not None else stamped)
            raise APIError(502, "vLLM's stream ended before data: [DONE]", code="upstream_error")
        except APIError as exc:
            yield exc.sse()
        except httpx.HTTPError as exc:
            yield _broken(exc).sse()
        finally:
            hold.release()
            await response.aclose()

    # The rest of the surface -------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        version, _ = self.adapter.current()
        return {"object": "list", "data": [{"id": self.line, "object": "model", "created": 0, "owned_by": "flywheel",
                                            "model_version": version, "versions": self.adapter.versions()}]}

    def health(self) -> JSONResponse:
        version, sha = self.adapter.current()
        node = self.settings.node
        body: dict[str, Any] = {
            "status": "ok" if version is not None else "unknown",
            "node_id": node.node_id,
            "region": node.region,
            "url": getattr(self.updater, "url", ""),
            "model_line": self.line,
            "version": version,
            "sha256": sha,
            "versions": self.adapter.versions(),
            "engine": {"kind": "vllm", "mode": "full", "requests": self.requests, "in_flight": self.gate.readers,
                       "queued": self.gate.queued, "reloading": self.gate.reloading},
        }
        if self.updater is not None:
            body["update_status"] = self.updater.status
            body["update_detail"] = self.updater.detail
        return JSONResponse(body, status_code=200 if version is not None else 503)

    async def update_weights(self, request: Request) -> dict[str, Any]:
        if not is_loopback(request):
            raise APIError(403, "the admin API only answers loopback clients", code="forbidden")
        if self.updater is None:
            raise APIError(409, "this node has no updater (no registry configured)", code="no_updater")
        try:
            req = UpdateWeightsRequest.model_validate_json((await request.body()) or b"{}")
        except ValidationError as exc:
            raise from_pydantic(exc) from None
        if req.version is not None:
            outcome = await run_in_threadpool(self.updater.update_to, req.version)
        else:
            outcome = await run_in_threadpool(self.updater.check_once)
        version, sha = self.adapter.current()
        if not outcome.ok:
            raise APIError(409, f"update failed, still serving version {version}: {outcome.detail}", code="update_failed")
        return {"version": version, "sha256": sha, "status": self.updater.status, "detail": self.updater.detail}


class _Labels:
    """One request's check of vLLM's per-choice weight-version labels (module docstring)."""

    def __init__(self, adapter: Any, version: int, client_asked: bool) -> None:
        self.check = bool(getattr(adapter, "weight_versions", False))
        self.expected = adapter.weight_label(version) if self.check else ""
        self.client_asked = client_asked

    def checked(self, answer: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
        """``answer`` with every choice's labels checked, and removed unless the client asked."""
        choices = answer.get("choices")
        if not isinstance(choices, list):
            return answer
        out = []
        for choice in choices:
            if not isinstance(choice, dict):
                out.append(choice)
                continue
            spans = choice.get("weight_versions")
            if self.check and (spans is not None or not stream or choice.get("finish_reason") is not None):
                found = [s.get("version") if isinstance(s, dict) else s for s in spans] if isinstance(spans, list) else spans
                if not isinstance(found, list) or any(label != self.expected for label in found):
                    raise APIError(502, f"vLLM says choice {choice.get('index')} was sampled by weights labelled "
                                   f"{found!r}, not {self.expected!r}, the version this node holds; nothing is "
                                   "answered under a version that may not have produced it", code="weight_version_mismatch")
            if not self.client_asked and "weight_versions" in choice:
                choice = {k: v for k, v in choice.items() if k != "weight_versions"}
            out.append(choice)
        return {**answer, "choices": out}


class _HeldStream(StreamingResponse):
    """The relayed event stream; however the response ends (finished, broken off, the client gone
    before it started), the request's hold is released and vLLM's response closed."""

    def __init__(self, content: AsyncIterator[bytes], hold: _Hold, upstream: httpx.Response,
                 headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._hold, self._upstream = hold, upstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._hold.release()
            with contextlib.suppress(RuntimeError):  # still running: its own finally closes it
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._upstream.aclose()


def _broken(exc: httpx.HTTPError) -> APIError:
    if isinstance(exc, httpx.TimeoutException):
        return APIError(504, f"vLLM did not answer in time ({type(exc).__name__})", code="upstream_timeout")
    return APIError(502, f"vLLM cannot be reached or broke off: {type(exc).__name__}: {exc}", code="upstream_error")


def _status_of(chunk: dict[str, Any]) -> int:
    """The HTTP status an error event of a vLLM stream stands for (its ``code``), else 500."""
    error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
    code = error.get("code")
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def _vllm_error(status: int, raw: bytes) -> APIError:
    """vLLM's error answer in the front's envelope: current ``{"error": {...}}``, older flat
    ``{"message", "type", "code"}``, or FastAPI's ``{"detail": ...}``."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error: dict[str, Any] = {}
    if isinstance(body, dict):
        error = body["error"] if isinstance(body.get("error"), dict) else body
    message = error.get("message") or error.get("detail") or raw[:500].decode("utf-8", "replace") or f"HTTP {status}"
    if 400 <= status < 500:
        code, kind, param = error.get("code"), error.get("type"), error.get("param")
        return APIError(status, f"vLLM: {message}", code=code if isinstance(code, str) else None,
                        type=kind if isinstance(kind, str) and kind else None,
                        param=param if isinstance(param, str) else None)
    return APIError(502, f"vLLM answered HTTP {status}: {message}", code="upstream_error")


def create_front(adapter: Any, gate: VersionGate, settings: Settings, updater: Any = None, **options: Any) -> FastAPI:
    """The front app for ``adapter`` (full mode), whose reloads take ``gate`` exclusively; ``options``
    go to :class:`VllmFront` (``wait_s``, ``request_timeout_s``, ``connect_timeout_s``, ``transport``)."""
    front = VllmFront(adapter, gate, settings, updater, **options)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await front.start()
        try:
            yield
        finally:
            await front.close()

    # No trailing-slash redirects: their Location is built from the Host header (docs/security.md).
    app = FastAPI(title=f"flywheel node {settings.node.node_id} (vLLM)", docs_url=None, redoc_url=None,
                  lifespan=lifespan, redirect_slashes=False)
    app.state.front = front
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.complete(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.complete(request, "/v1/completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return front.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        return front.health()

    @app.post("/admin/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        return await front.update_weights(request)

    return app
