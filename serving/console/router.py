"""The console's HTTP routes: log in, the four pages and their forms, its static files.

``GET /console`` (overview), ``/console/versions`` (``?before=N`` pages back), ``/console/versions/{v}``,
``/console/canary``, ``/console/sessions`` (``?tenant=T`` or ``?q=SESSION_ID``), ``/console/session``
(``?tenant=T&id=S``); ``GET|POST /console/login``, ``POST /console/logout``; ``POST
/console/canary/{promote|rollback|pin|clear}`` and ``POST /console/unpin`` (form fields ``version``,
``reason``, ``force``, ``csrf_token``), audited exactly like the admin API
(:func:`serving.rollout_actions.operate`); ``GET /console/static/{name}``.

Invariants:
- Who may look: :mod:`serving.console.login` (a login cookie; or an admin Bearer key; tenant keys
  get 403). Forms need the login's CSRF token.
- Every page is rendered on the server with autoescaping on: prompts, completions, comments and
  reasons are text, never markup. Pages send a ``Content-Security-Policy`` allowing only this
  origin's scripts and styles, ``X-Frame-Options: DENY``, ``Cache-Control: no-store`` and a
  ``Server-Timing`` header with the time spent building them.
- A page's reads run in a worker thread; a query is never issued on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from serving.console import pages
from serving.console.login import ConsoleLogin, ConsoleUser, check_form, set_cookie
from serving.errors import APIError
from serving.gateway.services import Services, services
from serving.protocol import read_body

#: The most a console form may hold.
MAX_FORM_BYTES = 8192
STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

templates = Environment(loader=PackageLoader("serving.console", "templates"),
                        autoescape=select_autoescape(default=True, default_for_string=True), trim_blocks=True,
                        lstrip_blocks=True)
templates.filters["age"] = pages.fmt_age
templates.filters["num"] = pages.fmt_num

router = APIRouter(include_in_schema=False)


def _console(request: Request) -> tuple[Services, ConsoleLogin]:
    gateway = services(request)
    return gateway, ConsoleLogin(gateway.access, gateway.sessions)


def _registry_factory(gateway: Services) -> Any:
    def make() -> Any:
        from serving.gateway.admin_router import line_registry

        return line_registry(gateway.settings, gateway.sessions)
    return make


async def _who(request: Request) -> tuple[ConsoleUser | None, str | None]:
    """The caller's login (and a new token to set when auth is off and this is its first visit);
    ``(None, None)`` sends the caller to the login form."""
    gateway, login = _console(request)
    if request.headers.get("authorization"):  # an admin key on the request itself (curl, scripts)
        who = await gateway.access.admin(request)
        return ConsoleUser(who, "", None), None
    user = await login.current(request)
    if user is not None:
        return user, None
    if not login.auth_on:
        return await login.login(request, "")
    return None, None


def _render(request: Request, name: str, context: dict[str, Any], user: ConsoleUser | None, token: str | None,
            started: float, status: int = 200) -> Response:
    fragment = request.query_params.get("fragment") == "1"
    html = templates.get_template(name).render(**context, user=user, fragment=fragment, page=name.split(".")[0],
                                               auth_on=services(request).access.keys is not None)
    headers = {**SECURITY_HEADERS, "Server-Timing": f"app;dur={(time.perf_counter() - started) * 1000:.1f}"}
    response = HTMLResponse(html, status_code=status, headers=headers)
    if token is not None:
        set_cookie(response, request, token)
    return response


async def _page(request: Request, name: str, build: Any, *args: Any) -> Response:
    started = time.perf_counter()
    user, token = await _who(request)
    if user is None:
        return RedirectResponse("/console/login", status_code=303)
    context = await asyncio.to_thread(build, *args)
    if context is None:
        raise APIError(404, "not found", code="not_found")
    return _render(request, name, context, user, token, started)


@router.get("/console")
async def overview(request: Request) -> Response:
    gateway = services(request)
    lag: pages.LagReader = request.app.state.console_lag
    m = gateway.metrics
    counters = {"generations": pages.counter_total(m.generations), "feedback": pages.counter_total(m.feedback),
                "rejected": pages.counter_total(m.rejected)}
    lags = await asyncio.to_thread(lag.read)
    return await _page(request, "overview.html", pages.overview, gateway.settings, gateway.sessions,
                       _registry_factory(gateway), gateway.capture.depth(), counters, lags)


@router.get("/console/versions")
async def versions(request: Request) -> Response:
    gateway = services(request)
    before = _int(request.query_params.get("before"), "before")
    return await _page(request, "versions.html", pages.versions, gateway.settings, gateway.sessions, before)


@router.get("/console/versions/{number}")
async def version(number: int, request: Request) -> Response:
    gateway = services(request)
    if not 0 <= number < 2**31:
        raise APIError(404, "not found", code="not_found")
    return await _page(request, "version.html", pages.version, gateway.settings, gateway.sessions, number)


@router.get("/console/canary")
async def canary(request: Request) -> Response:
    gateway = services(request)
    flash = {"request_ok": _short(request.query_params.get("ok"), "ok", 2000),
             "request_error": _short(request.query_params.get("error"), "error", 2000)}

    def build() -> dict[str, Any]:
        return {**pages.canary(gateway.settings, gateway.sessions, _registry_factory(gateway)), **flash}
    return await _page(request, "canary.html", build)


@router.get("/console/sessions")
async def session_list(request: Request) -> Response:
    gateway = services(request)
    tenant = _short(request.query_params.get("tenant"), "tenant", 128)
    query = _short(request.query_params.get("q"), "q", 256)
    before = _time(request.query_params.get("before"), "before")
    return await _page(request, "sessions.html", pages.session_list, gateway.settings, gateway.sessions,
                       tenant, query.strip() if query else None, before)


@router.get("/console/session")
async def session(request: Request) -> Response:
    gateway = services(request)
    tenant = _short(request.query_params.get("tenant"), "tenant", 128)
    session_id = _short(request.query_params.get("id"), "id", 256)
    if not tenant or not session_id:
        raise APIError(400, "name the session: ?tenant=T&id=S", code="invalid_value")
    return await _page(request, "session.html", pages.session, gateway.settings, gateway.sessions, tenant, session_id)


@router.post("/console/canary/{action}")
async def version_action(action: str, request: Request) -> Response:
    """A rollout action from the Canary page's forms, audited like ``POST /admin/versions/{v}/{action}``."""
    gateway, user, form = await _posted(request)
    from serving.rollout_actions import VERSION_ACTIONS

    if action not in VERSION_ACTIONS:
        raise APIError(404, f"unknown version action {action!r}", code="not_found")
    number = _int(form.get("version"), "version")
    if number is None:
        raise APIError(400, "the form names no version", param="version", code="invalid_value")
    return await _act(request, gateway, user, action, number, _reason(form), form.get("force") == "on")


@router.post("/console/unpin")
async def unpin(request: Request) -> Response:
    gateway, user, form = await _posted(request)
    return await _act(request, gateway, user, "unpin", None, _reason(form), False)


async def _posted(request: Request) -> tuple[Services, ConsoleUser, dict[str, str]]:
    """A form post's login and fields: 403 without a login, or without its CSRF token."""
    gateway, login = _console(request)
    user = await login.current(request)
    if user is None:
        raise APIError(403, "log in to the console first", code="admin_required")
    form = await _form(request)
    check_form(request, user, form)
    return gateway, user, form


def _reason(form: dict[str, str]) -> str:
    return form.get("reason", "")[:1000].replace("\x00", "")


async def _act(request: Request, gateway: Services, user: ConsoleUser, action: str, number: int | None, reason: str,
               force: bool) -> Response:
    from flywheel.weights.registry import VersionNotFound
    from serving.gateway.admin_router import line_registry
    from serving.rollout_actions import RolloutError, manual_unpin, operate

    registry = line_registry(gateway.settings, gateway.sessions)
    try:
        if action == "unpin":
            await asyncio.to_thread(manual_unpin, registry, user.who, reason)
            message = "line unpinned"
        else:
            result = await asyncio.to_thread(operate, gateway.settings, registry, action, number, user.who, reason, force)
            changed = ", ".join(f"v{c['version']} {c['status']}" for c in result["changed"]) or "nothing changed"
            message = f"{action} v{number}: {changed}"
        kind = "ok"
    except VersionNotFound:
        message, kind = f"version {number} is not in the registry", "error"
    except RolloutError as exc:
        message, kind = f"{action} refused: {exc}", "error"
    await gateway.router.refresh()
    return RedirectResponse("/console/canary?" + urlencode({kind: message}), status_code=303)


@router.get("/console/login")
async def login_form(request: Request) -> Response:
    started = time.perf_counter()
    _, login = _console(request)
    if not login.auth_on:
        return RedirectResponse("/console", status_code=303)
    return _render(request, "login.html", {"error": None}, None, None, started)


@router.post("/console/login")
async def login_post(request: Request) -> Response:
    started = time.perf_counter()
    _, login = _console(request)
    form = await _form(request)
    try:
        _, token = await login.login(request, form.get("key", ""))
    except APIError as exc:
        return _render(request, "login.html", {"error": exc.message}, None, None, started, status=exc.status)
    response = RedirectResponse("/console", status_code=303)
    set_cookie(response, request, token)
    return response


@router.post("/console/logout")
async def logout(request: Request) -> Response:
    _, login = _console(request)
    user = await login.current(request)
    if user is not None:
        check_form(request, user, await _form(request))
        await login.logout(request)
    response = RedirectResponse("/console/login" if login.auth_on else "/console", status_code=303)
    set_cookie(response, request, None)
    return response


@router.get("/console/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        raise APIError(404, "not found", code="not_found")
    body = resources.files("serving.console").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "max-age=300",
                                                            "X-Content-Type-Options": "nosniff"})


async def _form(request: Request) -> dict[str, str]:
    """A urlencoded form body (first value of each field), bounded like every other body."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise APIError(415, "send the form as application/x-www-form-urlencoded", code="unsupported_media_type")
    raw = await read_body(request, MAX_FORM_BYTES, services(request).settings.gateway.body_read_timeout_s)
    try:
        fields = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=20, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise APIError(400, "the form is not valid UTF-8 urlencoded data", code="invalid_value") from None
    out: dict[str, str] = {}
    for key, value in fields:
        out.setdefault(key, value)
    return out


def _int(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    if not value.isdigit() or len(value) > 10 or int(value) >= 2**31:
        raise APIError(400, f"{name} must be a version number", param=name, code="invalid_value")
    return int(value)


def _time(value: str | None, name: str) -> datetime | None:
    if not value:
        return None
    try:
        at = datetime.fromisoformat(value[:64])
    except ValueError:
        raise APIError(400, f"{name} must be an ISO 8601 time", param=name, code="invalid_value") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _short(value: str | None, name: str, limit: int) -> str | None:
    if value is not None and (len(value) > limit or "\x00" in value):
        raise APIError(400, f"{name} is longer than {limit} characters", param=name, code="invalid_value")
    return value
