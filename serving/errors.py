"""The OpenAI error envelope and the one mapping from exceptions to HTTP responses.

Every error either serving app returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``; inside a
Server-Sent Events stream (once headers and a 200 are gone) the same envelope is one event,
``data: {"error": {...}}`` (:meth:`APIError.sse`), and the stream ends without ``[DONE]``.

Invariants:
- Bad input is a 4xx with a message a person can act on and ``param`` naming the offending field
  as a dotted path (``messages.0.role``); it is never a 500.
- :func:`install_error_handlers` is the only place that turns exceptions into responses, for both
  the gateway and the node; routers raise :class:`APIError` (or let FastAPI raise its own).
- What a proxy passes on from its upstream is built here too (:func:`upstream_error`,
  :func:`upstream_stream_error`, :func:`bad_upstream_response`): an upstream 4xx keeps its envelope,
  anything else the upstream does wrong is a 502. The one exception is start-up: while no node of
  the fleet has ever answered and the one chosen refuses the connection, the answer is
  :func:`fleet_starting`, a 503 with ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

#: Error ``type`` by HTTP status, as OpenAI names them.
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_error",
}


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "bytes"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")


class APIError(Exception):
    """An error with an HTTP status that a client should see as an OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers or {}
        #: Top-level fields beside ``error`` (a 409's ``stored``: what the server holds already).
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {**error_body(self.message, type=self.type, param=self.param, code=self.code), **self.extra}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> bytes:
        """The envelope as one Server-Sent Event, for errors after a stream has started."""
        return b"data: " + json.dumps(self.body(), separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def loc_path(loc: Iterable[Any], prefix: str | None = None) -> str | None:
    """Dotted field path of a pydantic error location, without FastAPI's ``body`` root."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # Union members appear in locations as type tags (``content.str``, ``content.list[TextPart]``).
    parts = [p for p in parts if p not in _UNION_TAGS and "[" not in p]
    if prefix:
        parts = [prefix, *parts]
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]], *, prefix: str | None = None) -> APIError:
    """One 400 naming the first offending field; the message lists every problem found."""
    if not errors:
        return APIError(400, "invalid request")
    described: list[str] = []
    for err in errors[:10]:
        path = loc_path(err.get("loc", ()), prefix)
        msg = err.get("msg", "invalid value")
        line = f"{path}: {msg}" if path else msg
        if line not in described:
            described.append(line)
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    first = errors[0]
    return APIError(
        400,
        "; ".join(described) + more,
        param=loc_path(first.get("loc", ()), prefix),
        code="invalid_value" if first.get("type") != "missing" else "missing_required_parameter",
    )


def from_pydantic(exc: ValidationError, *, prefix: str | None = None) -> APIError:
    return validation_error(exc.errors(include_url=False), prefix=prefix)


def state_unavailable(exc: BaseException) -> APIError:
    """The store that holds sessions and rate limits (Redis) is down: a 503, as a response or mid-stream."""
    log.error("gateway state unavailable: %s", type(exc.__cause__ or exc).__name__)
    return APIError(503, "session and rate-limit state is unavailable right now; retry shortly",
                    code="state_unavailable")


def upstream_error_field(raw: bytes, key: str) -> Any:
    """A field of an upstream error body: ``{"error": {...}}`` or vLLM's older flat envelope."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    return err.get(key) if isinstance(err, dict) else body.get(key)


def upstream_error(status: int, raw: bytes, headers: dict[str, str]) -> APIError:
    """An upstream's error answer: a 4xx passes through (its envelope kept); anything else is a 502."""
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


#: Seconds a client is told to wait (``Retry-After``) while the fleet is starting.
STARTING_RETRY_AFTER_S = 2


def fleet_starting(model_line: str, headers: dict[str, str]) -> APIError:
    """The 503 while the fleet is starting (no node listens yet): retry shortly, never a 502."""
    return APIError(503, f"the fleet is starting: no node serves `{model_line}` yet; retry in "
                    f"{STARTING_RETRY_AFTER_S} s", code="fleet_starting",
                    headers={**headers, "Retry-After": str(STARTING_RETRY_AFTER_S)})


class UpstreamStreamError(Exception):
    """The upstream sent an error event inside its stream; ``args[0]`` is its ``error`` value."""


def upstream_stream_error(exc: UpstreamStreamError, headers: dict[str, str]) -> APIError:
    """The 502 for an error event the upstream sent mid-stream, keeping its code when it has one."""
    err = exc.args[0]
    message = err.get("message") if isinstance(err, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return APIError(502, f"upstream failed mid-stream: {message or err!r}",
                    code=code if isinstance(code, str) else "upstream_error", headers=headers)


def bad_upstream_response(exc: Exception, headers: dict[str, str]) -> APIError:
    """The 502 for an upstream answer that cannot be captured (no token ids, no version, not JSON...)."""
    return APIError(502, f"upstream response cannot be captured: {exc}", code="bad_upstream_response", headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception an endpoint can raise to the envelope; unknown ones become a logged 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_pydantic(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
