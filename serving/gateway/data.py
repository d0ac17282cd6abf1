"""Serving end users' data rights over HTTP: erase a data subject (audited, completed in the
background), read an erasure's state, and export a subject's rows as JSON Lines.

``DataServing(settings, sessions, user_secret)`` is built once at start-up
(``serving/gateway/services.py``) with the database and the deployment's user-id secret, and
started there (its erasure worker); the routes (``serving/gateway/data_router.py``) say who is
asking and for which tenant, and call it. The work is the kernel's: ``flywheel.subjects`` (which
rows are the subject's, the export) and ``flywheel.erasure`` (the tombstone, the deletion, the
audit), exactly as ``flywheel data export|forget`` runs them.

Invariants:
- A subject is one tenant's end user, named by the raw id the client sent (hashed here with the
  deployment's secret as the gateway hashes it, ``flywheel.subjects.user_subject``; the raw id is
  never stored or logged), or one tenant's session: exactly one of ``user`` and ``session``. An
  empty or overlong id, both or neither, or a bad tenant name is a 400 naming the field.
- :meth:`DataServing.forget` answers once the erasure's row is written (the tombstone and the
  versions trained on the subject, read before anything is deleted); the deletion runs after, one
  erasure at a time, in the worker thread. A failed or interrupted deletion leaves the row
  ``pending``: the janitor completes it once it is :data:`flywheel.erasure.STALE_AFTER` old, and
  ``flywheel data forget --resume`` at once (a deletion is idempotent).
- An erasure is read only with its tenant's scope: another tenant's erasure is the same 404 as
  one that does not exist.
- An export streams: the rows are read :data:`flywheel.subjects.BATCH` at a time in a thread and
  handed over in chunks through a bounded queue, so memory stays bounded whatever the subject's
  size. A failure before the first chunk is a 503; after it, the response is cut off (no final
  chunk), so a client never mistakes a partial export for a whole one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from flywheel import erasure
from flywheel.db.models import Erasure
from flywheel.identity import MAX_USER_CHARS
from flywheel.keys import check_tenant
from flywheel.settings import Settings
from flywheel.subjects import KINDS, MAX_SESSION_CHARS, Subject, export, user_subject
from serving.errors import APIError
from serving.protocol import check_session_id

log = logging.getLogger(__name__)

#: Erasures of one tenant pending at once: beyond them a request is a 429 (one worker deletes them
#: one at a time, each at least ``flywheel.erasure.SETTLE_S``; a flood must not bury other tenants').
MAX_PENDING_ERASURES = 16
#: Exports streaming at once, per tenant and in all: each holds a reading thread and a database connection.
MAX_EXPORTS_PER_TENANT = 2
MAX_EXPORTS = 4
#: An export's bytes per chunk, and the chunks the queue holds between the reading thread and the response.
CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 8
#: How the audit names a tenant's key (``serving.gateway.data_router``); a tenant sees any other
#: requester, an admin key or a ``flywheel data forget --by`` name, as "the operator".
TENANT_CALLER = "API key "
#: The export stream's media type: JSON Lines.
NDJSON = "application/x-ndjson"


class SubjectRequest(BaseModel):
    """Whose data: ``{"tenant": T, "user": U}`` or ``{"tenant": T, "session": S}`` (the body of
    ``POST .../data/forget`` and ``POST .../data/export``). ``tenant`` is required on the
    admin routes; on a tenant's routes it may be left out and must otherwise be the key's own."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tenant: str | None = Field(None, max_length=128)
    #: The end user's id exactly as the client sends it (OpenAI's ``user``, ``X-Flywheel-User``).
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    session: str | None = Field(None, max_length=MAX_SESSION_CHARS)


class ExportAbandoned(Exception):
    """The response reading an export went away (the client disconnected)."""


_END = object()


class ChunkPipe:
    """The bytes an export writes, handed to the response in chunks of about :data:`CHUNK_BYTES`
    through a bounded queue; once the reader is closed, the writer's next chunk raises
    :class:`ExportAbandoned`."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self.buffer = bytearray()
        self.closed = threading.Event()

    def write(self, data: bytes) -> int:
        self.buffer += data
        if len(self.buffer) >= self.chunk_bytes:
            self.put(bytes(self.buffer))
            self.buffer.clear()
        return len(data)

    def finish(self, failure: BaseException | None = None) -> None:
        """The end of the export: what is buffered, then the end (or the failure that stopped it)."""
        if failure is None and self.buffer:
            self.put(bytes(self.buffer))
        self.put(_END if failure is None else failure)

    def put(self, item: Any) -> None:
        while not self.closed.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        raise ExportAbandoned

    def chunks(self) -> Iterator[bytes]:
        try:
            while (item := self.queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """No more chunks are read: the writer stops at its next one (thread-safe, repeatable)."""
        self.closed.set()


class DataServing:
    """End users' data rights for the gateway's data routes (see the module docstring)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], user_secret: str) -> None:
        self.settings = settings
        self.sessions = sessions
        self.user_secret = user_secret
        #: Seconds between an erasure's two deletion passes (``flywheel.erasure.SETTLE_S``).
        self.settle_s = erasure.SETTLE_S
        self.chunk_bytes = CHUNK_BYTES
        self.pending: queue.Queue[int | None] = queue.Queue()
        self.stopping = threading.Event()
        #: tenant -> exports streaming now (``MAX_EXPORTS_PER_TENANT``, ``MAX_EXPORTS``)
        self.exporting: dict[str, int] = {}
        self.exporting_lock = threading.Lock()
        self.worker = threading.Thread(target=self.work, name="erasures", daemon=True)

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        """Stop after the erasure being deleted, waiting ``gateway.drain_timeout_s`` at most; those
        not finished stay ``pending`` for ``flywheel data forget --resume``."""
        self.stopping.set()
        self.pending.put(None)
        self.worker.join(self.settings.gateway.drain_timeout_s)
        if self.worker.is_alive() or self.pending.qsize():
            log.warning("gateway stopped with erasures not completed; they stay pending until the janitor "
                        "or `flywheel data forget --resume` completes them")

    def subject(self, request: SubjectRequest, tenant: str) -> Subject:
        """The subject ``request`` names within ``tenant``; a 400 naming the field when it names none."""
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tenant", code="invalid_value") from None
        if request.user is not None and request.session is not None:
            raise APIError(400, "name the subject with exactly one of user and session, not both",
                           param="session", code="invalid_value")
        if request.user is None and request.session is None:
            raise APIError(400, "name the subject with exactly one of user (the end user's id as the client sends "
                           "it) and session", param="user", code="missing_required_parameter")
        if request.user is not None:
            if not request.user:
                raise APIError(400, "an empty user id names no one", param="user", code="invalid_value")
            return user_subject(self.user_secret, tenant, request.user)
        assert request.session is not None
        if not request.session:
            raise APIError(400, "an empty session id names no session", param="session", code="invalid_value")
        try:
            return Subject(tenant, session_id=check_session_id(request.session))
        except APIError as exc:
            raise APIError(400, exc.message, param="session", code="invalid_value") from None

    async def forget(self, subject: Subject, requested_by: str, *, operator: bool = False) -> dict[str, Any]:
        """Tombstone ``subject`` and queue its deletion; the erasure as :meth:`erasure` shows it. A
        subject with an erasure still pending gets that one (asking twice is not two deletions);
        a tenant with :data:`MAX_PENDING_ERASURES` pending gets a 429."""
        same, pending = await db(erasure.pending_for, self.sessions, subject)
        if same is not None:
            log.info("erasure %d asked again by %s: still pending", same, requested_by)
            found = await self.erasure(same, subject.tenant, operator=operator)
            assert found is not None
            return found
        if pending >= MAX_PENDING_ERASURES:
            raise APIError(429, f"tenant {subject.tenant!r} has {pending} erasures pending; retry once they are done",
                           code="too_many_pending_erasures", headers={"Retry-After": "10"})
        erasure_id = await db(erasure.request, self.sessions, subject, requested_by)
        log.info("erasure %d requested by %s: %s", erasure_id, requested_by, who(subject))
        self.pending.put(erasure_id)
        found = await self.erasure(erasure_id, subject.tenant, operator=operator)
        assert found is not None
        return found

    def work(self) -> None:
        while (erasure_id := self.pending.get()) is not None and not self.stopping.is_set():
            try:
                outcome = erasure.complete(self.sessions, erasure_id, settle_s=self.settle_s)
            except Exception:  # the row stays pending (the tombstone holds): logged with the way to finish it
                log.exception("erasure %d failed; it stays pending: the janitor or `flywheel data forget --resume` "
                              "completes it",
                              erasure_id)
                continue
            log.info("erasure %d done: %d rows deleted (%s)", erasure_id, sum(outcome.counts.values()),
                     ", ".join(f"{outcome.counts[kind]} {kind}" for kind in KINDS))

    async def erasure(self, erasure_id: int, tenant: str | None, *, operator: bool = False) -> dict[str, Any] | None:
        """Erasure ``erasure_id`` (state, counts, versions, audit), or None where there is none or
        it is not ``tenant``'s (``None``: any tenant's, for an admin). Shown to a tenant (not
        ``operator``), a requester other than a tenant key reads "the operator"."""
        return await db(self.read_erasure, erasure_id, tenant, operator)

    def read_erasure(self, erasure_id: int, tenant: str | None, operator: bool = False) -> dict[str, Any] | None:
        if not 0 < erasure_id < 2**63:
            return None
        with self.sessions() as session:
            row = session.get(Erasure, erasure_id)
            if row is None or (tenant is not None and row.tenant != tenant):
                return None
            counts = {kind: int(row.counts.get(kind, 0)) for kind in KINDS}
            by = row.requested_by
            if not operator and not by.startswith(TENANT_CALLER):  # an operator's key id or name is theirs
                by = "the operator"
            return {"object": "erasure", "id": row.id, "tenant": row.tenant, "user_hash": row.user_hash,
                    "session_id": row.session_id, "state": row.state, "counts": counts, "rows": sum(counts.values()),
                    "trained_into": list(row.trained_into), "requested_by": by,
                    "requested_at": row.requested_at.isoformat(),
                    "completed_at": row.completed_at.isoformat() if row.completed_at else None}

    async def export(self, subject: Subject, requested_by: str) -> tuple[Iterator[bytes], Callable[[], None]]:
        """``subject``'s rows as JSON Lines (``flywheel.subjects.export``), chunk by chunk, and what
        stops the reading thread once the response is over (sent, or its client gone). The first
        chunk is read before this returns: a 503 if the database fails before it."""
        log.info("export requested by %s: %s", requested_by, who(subject))
        self.begin_export(subject.tenant)
        pipe = ChunkPipe(self.chunk_bytes)

        def run() -> None:
            failure = None
            try:
                export(self.sessions, subject, cast(Any, pipe))
            except ExportAbandoned:
                return
            except Exception as exc:  # handed to the response, which is cut off
                log.exception("export for %s failed", requested_by)
                failure = exc
            finally:
                self.end_export(subject.tenant)
            with contextlib.suppress(ExportAbandoned):
                pipe.finish(failure)

        try:
            threading.Thread(target=run, name="data-export", daemon=True).start()
        except BaseException:
            self.end_export(subject.tenant)
            raise
        chunks = pipe.chunks()
        try:
            first = await db(next, chunks, b"")
        except BaseException:
            pipe.close()
            raise
        return prepend(first, chunks), pipe.close


    def begin_export(self, tenant: str) -> None:
        """Count an export in, or a 429 when the tenant or the gateway streams the most it may."""
        with self.exporting_lock:
            mine, everyone = self.exporting.get(tenant, 0), sum(self.exporting.values())
            if mine >= MAX_EXPORTS_PER_TENANT or everyone >= MAX_EXPORTS:
                raise APIError(429, f"{mine if mine >= MAX_EXPORTS_PER_TENANT else everyone} exports are streaming "
                               f"{'for this tenant' if mine >= MAX_EXPORTS_PER_TENANT else 'on this gateway'}; "
                               "retry once one is done", code="too_many_exports", headers={"Retry-After": "5"})
            self.exporting[tenant] = mine + 1

    def end_export(self, tenant: str) -> None:
        with self.exporting_lock:
            left = self.exporting.get(tenant, 0) - 1
            if left > 0:
                self.exporting[tenant] = left
            else:
                self.exporting.pop(tenant, None)


def prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def who(subject: Subject) -> str:
    """A subject for a log line: by hash or session, never the raw user id."""
    named = f"user hash {subject.user_hash}" if subject.user_hash is not None else f"session {subject.session_id!r}"
    return f"tenant {subject.tenant}, {named}"


async def db(call: Any, *args: Any) -> Any:
    """``call(*args)`` off the event loop; a database failure is a 503."""
    try:
        return await run_in_threadpool(call, *args)
    except SQLAlchemyError as exc:
        log.error("data rights: database error %s", type(exc).__name__)
        raise APIError(503, "the database is unavailable right now; retry later", code="database_unavailable") from None
