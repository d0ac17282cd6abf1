"""Who is calling, and may they touch this generation or session: API keys and tenant ownership.

:class:`KeyStore` turns an ``Authorization: Bearer fwk_...`` header into a :class:`Principal`;
:class:`Access` is what the routers ask (the caller, within its rate limit; an admin);
:class:`Ownership` answers whether a tenant may send feedback on a generation or a session.

Invariants:
- Every request acts for one tenant: the owner of its API key (``gateway.auth = "on"``) or
  ``gateway.default_tenant``.
- Admin routes need an admin key (auth on) or a loopback caller (auth off).
- Every refusal of a key (missing, not a Bearer header, malformed, unknown, wrong secret, revoked)
  is the same 401 with the same message, and no message or log line ever contains a key.
- Malformed keys are refused without a database query. Well-formed ones are looked up off the
  event loop (a worker thread); results are cached, keyed by the key's SHA-256, for ``cache_s``:
  valid keys so requests cost no query, unknown ones so a flood of one bad key costs one query per
  ``cache_s``. A revoked key therefore stops working within ``cache_s``. Concurrent lookups of one
  key share a single query; the cache holds at most ``max_entries`` keys (oldest dropped first).
- A database failure while checking a key is a 503 ``auth_unavailable``, never a pass.
- Ownership gives the same 404 whether a generation or session belongs to another tenant or does
  not exist at all. It asks the live state first and the database (generations, sessions tables)
  when the live entry expired; a generation found in the database is put back in the live state.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import exists, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from flywheel.db.models import Generation, SessionState
from flywheel.keys import KeyInfo, find_key, key_id_of
from flywheel.settings import GatewaySettings
from serving.errors import APIError
from serving.gateway.state import GatewayState

log = logging.getLogger(__name__)

INVALID_KEY_MESSAGE = (
    "invalid or missing API key: send the header 'Authorization: Bearer fwk_...' with a key from `flywheel keys create`"
)


@dataclass(frozen=True)
class Principal:
    """The caller behind a valid key."""

    key_id: str
    tenant: str
    role: str  # tenant | admin
    rate_limit_rpm: int | None  # None: the gateway's default applies

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def invalid_key() -> APIError:
    return APIError(401, INVALID_KEY_MESSAGE, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_admin(principal: Principal) -> None:
    """403 unless ``principal`` holds an admin key."""
    if not principal.is_admin:
        raise APIError(403, "this route needs an admin API key (`flywheel keys create --admin`)", code="admin_required")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyStore:
    """API keys from the database, cached per process (see the module invariants)."""

    def __init__(self, session_factory: sessionmaker[Session], cache_s: float, *, max_entries: int = 10_000) -> None:
        self._sessions = session_factory
        self.cache_s = cache_s
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[KeyInfo | None, float]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[KeyInfo | None]] = {}

    async def authenticate(self, authorization_header: str | None) -> Principal:
        key = bearer_token(authorization_header)
        if key is None or key_id_of(key) is None:
            raise invalid_key()
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > time.monotonic():
            info = cached[0]
        else:
            future = self._inflight.get(digest)
            if future is None:
                future = asyncio.ensure_future(self._load(key, digest))
                self._inflight[digest] = future
                future.add_done_callback(lambda _: self._inflight.pop(digest, None))
            info = await asyncio.shield(future)
        if info is None:
            raise invalid_key()
        return Principal(info.key_id, info.tenant, info.role, info.rate_limit_rpm)

    async def _load(self, key: str, digest: str) -> KeyInfo | None:
        try:
            info = await run_in_threadpool(find_key, self._sessions, key)
        except SQLAlchemyError as exc:
            log.error("cannot check API key %s: database error %s", key_id_of(key), type(exc).__name__)
            raise APIError(503, "API keys cannot be checked right now (database unavailable); retry later",
                           code="auth_unavailable") from None
        if self.cache_s > 0:
            self._cache[digest] = (info, time.monotonic() + self.cache_s)
            self._cache.move_to_end(digest)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return info


class Access:
    """The caller of a request: authenticated (:class:`KeyStore`, or the default tenant while
    ``gateway.auth`` is off), rate-limited per key, or refused."""

    def __init__(self, settings: GatewaySettings, keys: KeyStore | None, state: GatewayState) -> None:
        self.settings = settings
        self.keys = keys
        self.state = state

    async def principal(self, request: Request) -> Principal:
        if self.keys is None:
            return Principal("-", self.settings.default_tenant, "tenant", None)
        return await self.keys.authenticate(request.headers.get("authorization"))

    async def caller(self, request: Request) -> Principal:
        """:meth:`principal`, admitted by :meth:`limit`."""
        principal = await self.principal(request)
        await self.limit(principal)
        return principal

    async def limit(self, principal: Principal) -> None:
        """A 429 with ``Retry-After`` once the key used up its requests per minute (and burst)."""
        rpm = principal.rate_limit_rpm if principal.rate_limit_rpm is not None else self.settings.rate_limit_rpm
        await self.limit_by(principal.key_id, rpm, self.settings.rate_limit_burst, "this API key")

    async def limit_by(self, bucket: str, rpm: int, burst: int = 0, what: str = "this caller") -> None:
        """A 429 with ``Retry-After`` once ``bucket`` used up ``rpm`` requests per minute (and burst)."""
        if rpm <= 0:
            return
        retry = await self.state.admit(bucket, rpm, burst)
        if retry is not None:
            seconds = max(1, int(retry + 0.999))
            raise APIError(429, f"rate limit of {rpm} requests per minute reached for {what}; "
                           f"retry in {seconds} s", code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})

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


class Ownership:
    """Feedback targets only what the calling tenant owns (see the module invariants)."""

    def __init__(
        self,
        state: GatewayState,
        session_factory: sessionmaker[Session],
        ttl_s: float = GatewaySettings.model_fields["ownership_ttl_s"].default,
    ) -> None:
        self.state = state
        self._sessions = session_factory
        self.ttl_s = ttl_s

    async def check_generation(
        self, tenant: str, generation_id: str, session_id: str | None = None, *, param: str | None = None
    ) -> str:
        """The session of ``tenant``'s generation ``generation_id``; 404 if it is not ``tenant``'s.

        With ``session_id``, the generation must belong to that session too (else 400).
        """
        owner = await self.state.generation_owner(generation_id)
        if owner is None:
            owner = await self._db(self._generation_owner, generation_id)
            if owner is not None:
                await self.state.record_generation(generation_id, owner[0], owner[1], self.ttl_s)
        if owner is None or owner[0] != tenant:
            raise APIError(404, f"generation {generation_id!r} not found for this API key",
                           param=param, code="generation_not_found")
        if session_id is not None and owner[1] != session_id:
            raise APIError(400, f"generation {generation_id!r} belongs to another session than {session_id!r}; "
                           "omit session_id to use the generation's own", param=param, code="session_mismatch")
        return owner[1]

    async def check_session(self, tenant: str, session_id: str, *, param: str | None = None) -> None:
        """404 unless ``tenant`` has a session ``session_id`` (live, or in the database)."""
        if await self.state.session_exists(tenant, session_id):
            return
        if not await self._db(self._session_known, tenant, session_id):
            raise APIError(404, f"session {session_id!r} not found for this API key",
                           param=param, code="session_not_found")

    async def _db(self, query: Any, *args: Any) -> Any:
        try:
            return await run_in_threadpool(query, *args)
        except SQLAlchemyError as exc:
            log.error("ownership lookup failed: database error %s", type(exc).__name__)
            raise APIError(503, "ownership cannot be checked right now (database unavailable); retry later",
                           code="ownership_unavailable") from None

    def _generation_owner(self, generation_id: str) -> tuple[str, str] | None:
        with self._sessions() as session:
            row = session.execute(
                select(Generation.tenant, Generation.session_id).where(Generation.generation_id == generation_id)
            ).first()
            return None if row is None else (row[0], row[1])

    def _session_known(self, tenant: str, session_id: str) -> bool:
        in_generations = exists().where(Generation.tenant == tenant, Generation.session_id == session_id)
        in_sessions = exists().where(SessionState.tenant == tenant, SessionState.session_id == session_id)
        with self._sessions() as session:
            return bool(session.scalar(select(in_generations | in_sessions)))
