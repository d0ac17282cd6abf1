"""Who may use the console: the login that trades an admin key for a session cookie, and CSRF.

With ``gateway.auth = "on"`` the login form takes an admin API key (checked exactly like the admin
API's Bearer header, :class:`serving.gateway.auth.KeyStore`) and answers with a cookie holding a
random token; the gateway's live state keeps the login under the token's SHA-256 (never the token)
for :data:`SESSION_TTL_S`. With auth off the console, like ``/admin``, answers loopback callers
only, and a loopback caller is logged in on its first visit.

Invariants:
- The cookie is ``HttpOnly``, ``SameSite=Strict``, ``Path=/console`` (``Secure`` behind https):
  no script reads it, no other site's page sends it.
- Every form post carries the login's CSRF token (a second random value, stored with the login)
  and is refused with 403 without it; a post whose ``Origin`` names another origin is refused too.
- A key revoked after its login ends that login at the next page (the key's row is read each time).
- Each login attempt spends a token of the caller's address's bucket (:data:`LOGIN_RPM`): a wrong
  key is answered like the API's (one message for every refusal).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from flywheel.db.models import ApiKey
from serving.errors import APIError
from serving.gateway.auth import Access, require_admin

#: The cookie that carries a console login's token.
COOKIE = "flywheel_console"
#: How long a login lasts.
SESSION_TTL_S = 8 * 3600
#: Login attempts a minute per caller address.
LOGIN_RPM = 30
LOOPBACK = ("127.0.0.1", "::1", "localhost", "testclient")


@dataclass(frozen=True)
class ConsoleUser:
    """A logged-in operator: ``who`` is what the audit log names, ``csrf`` the token forms carry."""

    who: str
    csrf: str
    key_id: str | None  # None with auth off


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class ConsoleLogin:
    """Console logins on top of the gateway's :class:`Access` and live state."""

    def __init__(self, access: Access, sessions: sessionmaker[Session]) -> None:
        self.access = access
        self.sessions = sessions

    @property
    def auth_on(self) -> bool:
        return self.access.keys is not None

    def check_loopback(self, request: Request) -> None:
        """403 unless the caller is on this host (the rule while ``gateway.auth`` is off)."""
        host = request.client.host if request.client else ""
        if host not in LOOPBACK:
            raise APIError(403, "the console answers loopback callers only while gateway.auth is off",
                           code="admin_required")

    async def current(self, request: Request) -> ConsoleUser | None:
        """The login the request's cookie names, if it is live and its key still valid."""
        if not self.auth_on:
            self.check_loopback(request)
        token = request.cookies.get(COOKIE)
        if not token or len(token) > 128:
            return None
        raw = await self.access.state.console(_sha(token))
        if raw is None:
            return None
        record = json.loads(raw)
        if record["key_id"] is not None and not await run_in_threadpool(self._key_valid, record["key_id"]):
            await self.access.state.drop_console(_sha(token))
            return None
        return ConsoleUser(record["who"], record["csrf"], record["key_id"])

    def _key_valid(self, key_id: str) -> bool:
        with self.sessions() as db:
            row = db.execute(select(ApiKey.role, ApiKey.revoked_at).where(ApiKey.key_id == key_id)).first()
        return row is not None and row.revoked_at is None and row.role == "admin"

    async def login(self, request: Request, key: str) -> tuple[ConsoleUser, str]:
        """A new login for ``key`` (auth on) or for the loopback caller (auth off), and its token."""
        host = request.client.host if request.client else "-"
        await self.access.limit_by(f"console-login:{host}", LOGIN_RPM)
        if self.auth_on:
            principal = await self.access.keys.authenticate(f"Bearer {key.strip()}")  # type: ignore[union-attr]
            require_admin(principal)
            who, key_id = f"console: admin API key {principal.key_id}", principal.key_id
        else:
            self.check_loopback(request)
            who, key_id = f"console (loopback {host}, gateway.auth off)", None
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        record = json.dumps({"who": who, "csrf": csrf, "key_id": key_id})
        await self.access.state.put_console(_sha(token), record, SESSION_TTL_S)
        return ConsoleUser(who, csrf, key_id), token

    async def logout(self, request: Request) -> None:
        token = request.cookies.get(COOKIE)
        if token and len(token) <= 128:
            await self.access.state.drop_console(_sha(token))


def set_cookie(response: Response, request: Request, token: str | None) -> None:
    """Put the login's cookie on ``response`` (None: clear it)."""
    secure = request.url.scheme == "https"
    if token is None:
        response.delete_cookie(COOKIE, path="/console", secure=secure, httponly=True, samesite="strict")
    else:
        response.set_cookie(COOKIE, token, max_age=SESSION_TTL_S, path="/console", secure=secure, httponly=True,
                            samesite="strict")


def check_form(request: Request, user: ConsoleUser, form: dict[str, str]) -> None:
    """403 unless the form carries ``user``'s CSRF token and comes from this origin."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
        raise APIError(403, "cross-origin form post refused", code="csrf_failed")
    sent = form.get("csrf_token", "")
    if not sent or not hmac.compare_digest(sent.encode(), user.csrf.encode()):
        raise APIError(403, "form refused: missing or wrong CSRF token (reload the page and retry)", code="csrf_failed")
