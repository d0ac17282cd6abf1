"""The gateway app factory: an OpenAI-compatible proxy that captures every generation and accepts
feedback, assembled from its parts.

``create_app(settings)`` builds the app: its lifespan opens the clients and serving classes
(:func:`serving.gateway.services.open_services`) and closes them in reverse order; the error
handlers (:mod:`serving.errors`) turn every exception into one OpenAI envelope; the routers are
mounted: :mod:`serving.gateway.api_router` (the OpenAI API, health, metrics),
:mod:`serving.gateway.admin_router` (capture depth, pins, the line's versions),
:mod:`serving.gateway.data_router` (end users' data: erase, export) and
:mod:`serving.console.router` (the operator console under ``/console``); the OpenAPI
document gains the request bodies (:mod:`serving.gateway.openapi`). ``producer_factory`` replaces
the bus producer (tests inject a broken one).

Session URLs, for agents that cannot set headers: ``/sessions/{id}/v1/...`` is the public API of
``/v1/...`` (chat and text completions, feedback, models) with ``X-Flywheel-Session: {id}`` set
from the path, so an OpenAI client with ``base_url = http://host/sessions/{id}/v1`` keeps one
session. The middleware (:class:`SessionEcho`) rewrites such a request before any route sees it.

Invariants:
- Every response names the client's session (``X-Flywheel-Session``), errors included, and every
  error response is counted by status (``flywheel_gateway_rejected``).
- A session URL is exactly the header: the id is the path segment percent-decoded to bytes (the
  bytes a header would carry) and meets the same checks (``check_session_id``; empty is refused);
  a session header that names another session is a 400 ``session_mismatch`` (``param``
  ``session_id``). Auth, tenancy (sessions are the tenant's) and everything after are unchanged.
- No trailing-slash redirects: their ``Location`` is built from the Host header (docs/security.md).
  Request heads are bounded by ``serving/server.py``; a body must arrive whole within
  ``gateway.body_read_timeout_s`` (else 408 and the connection is closed).
- Keys, prompts and completions are never logged at INFO or above.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from flywheel.settings import Settings
from serving.console import router as console_router
from serving.console.pages import LagReader
from serving.errors import APIError, install_error_handlers, state_unavailable
from serving.gateway import admin_router, api_router, data_router, openapi
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.services import open_services
from serving.gateway.state import StateUnavailable
from serving.protocol import SESSION_HEADER, check_session_id

_SESSION_HEADER = SESSION_HEADER.lower().encode("latin-1")
#: ``/sessions/{id}/v1/...``, on the raw (still percent-encoded) path: an id may hold an encoded ``/``.
_SESSION_URL = re.compile(rb"^/sessions/([^/]*)(/v1/.*)$", re.DOTALL)


def session_url(scope: dict[str, Any]) -> dict[str, Any] | None:
    """For a session URL: the scope of the same request to ``/v1/...`` with the session header set
    from the path (module docstring); None for any other path. A 400 :class:`APIError` for an id
    that fails the header's checks or a session header that disagrees with it."""
    if not scope["path"].startswith("/sessions/"):
        return None
    match = _SESSION_URL.match(scope.get("raw_path") or quote(scope["path"]).encode("ascii"))
    if match is None:
        return None
    session = unquote_to_bytes(match.group(1))
    if not session:
        raise APIError(400, "the session URL names no session: use /sessions/{id}/v1/...", param="session_id")
    check_session_id(session.decode("latin-1"))
    sent = [v for k, v in scope["headers"] if k == _SESSION_HEADER]
    if any(v != session for v in sent):
        raise APIError(400, f"the {SESSION_HEADER} header names another session than the URL "
                       f"({sent[0].decode('latin-1')[:80]!r} against {session.decode('latin-1')[:80]!r}): "
                       "send one of them, or the same id in both", param="session_id", code="session_mismatch")
    rest = match.group(2)
    headers = [(k, v) for k, v in scope["headers"] if k != _SESSION_HEADER] + [(_SESSION_HEADER, session)]
    return {**scope, "path": unquote_to_bytes(rest).decode("utf-8", "replace"), "raw_path": rest, "headers": headers}


class SessionEcho:
    """ASGI middleware: session URLs become the API with the session header (:func:`session_url`),
    every response names the client's session (errors included), and error responses are counted
    by status. Pure ASGI: a BaseHTTPMiddleware costs more than the gateway."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = None
        try:
            scope = session_url(scope) or scope
        except APIError as exc:
            refused = exc
        session = next((v for k, v in scope["headers"] if k == _SESSION_HEADER), None)

        async def send_with_session(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400:
                    self.metrics.rejected.labels(str(status)).inc()
                headers = message.get("headers") or []
                if session is not None and not any(k.lower() == _SESSION_HEADER for k, _ in headers):
                    message = {**message, "headers": [*headers, (_SESSION_HEADER, session)]}
            await send(message)

        if refused is not None:
            return await refused.response()(scope, receive, send_with_session)
        await self.app(scope, receive, send_with_session)


def create_app(settings: Settings, *, producer_factory: Callable[[], Any] | None = None) -> FastAPI:
    """The gateway app; see the module docstring for what its lifespan opens and closes."""
    metrics = GatewayMetrics(CollectorRegistry())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_services(settings, metrics, producer_factory) as services:
            app.state.services = services
            app.state.console_lag = LagReader(settings)  # the console's bus client, opened on first read
            try:
                yield
            finally:
                app.state.console_lag.close()

    app = FastAPI(title="flywheel gateway", docs_url=None, redoc_url=None, lifespan=lifespan, redirect_slashes=False)
    install_error_handlers(app)

    @app.exception_handler(StateUnavailable)
    async def _state_unavailable(_: Request, exc: StateUnavailable) -> JSONResponse:
        return state_unavailable(exc).response()

    app.add_middleware(SessionEcho, metrics=metrics)
    app.include_router(api_router.router)
    app.include_router(admin_router.router)
    app.include_router(data_router.router)
    app.include_router(console_router.router)
    openapi.install(app)
    return app
