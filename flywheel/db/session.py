"""Database connections: engines, sessions, start-up wait, migrations and the idempotent insert.

One engine per process (never share one across ``fork``). The same code runs on PostgreSQL
(production) and on an SQLite file (embedded default).

Invariants:
- SQLite engines use WAL, a 30 s busy timeout, foreign keys, and take the write lock when a
  transaction begins (``BEGIN IMMEDIATE``), so several processes can read-modify-write one file
  without "database is locked" failures or lost updates: writers queue instead of failing.
- The schema is owned by Alembic (``flywheel/db/migrations/``, beside the models it migrates);
  :func:`upgrade` brings any database to head and works from any working directory.
- :func:`insert_ignore` never raises on a duplicate key and never commits; it reports how many rows
  were actually new.
- Error messages name the database without its password (or any part of it, even from the driver's
  own message) or secret query parameters: :func:`safe_url`.
- :func:`is_db_outage` is True only for a database that cannot be reached (a connection refused,
  dropped or terminated), never for a statement the database refused: a worker that rides out an
  outage (:class:`OutageWait`) never retries a deadlock, a constraint or a bad query in a loop.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from flywheel.bus.base import BAD_RECORD
from flywheel.jsonpolicy import db_dumps, db_loads
from flywheel.settings import redact_url, scrub, url_secrets

log = logging.getLogger(__name__)

#: A record whose rows cannot be stored: the database refuses them, or the record cannot be applied
#: (:data:`flywheel.bus.base.BAD_RECORD`). A worker dead-letters such a record and goes on.
BAD_ROW: tuple[type[Exception], ...] = (DataError, IntegrityError, *BAD_RECORD)

SQLITE_BUSY_TIMEOUT_S = 30.0
PG_CONNECT_TIMEOUT_S = 10


class DatabaseUnavailable(RuntimeError):
    """The database could not be reached in time."""


def safe_url(url: str | URL) -> str:
    """The URL as text with its password (and secret query parameters, such as libpq's
    ``?password=``) masked, for logs and error messages; never raises, even on an unparsable URL."""
    return redact_url(url if isinstance(url, str) else url.render_as_string(hide_password=False))


def _scrubbed(message: str, url: str | URL) -> str:
    """A driver's error message about ``url`` without any part of its secrets."""
    raw = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    return scrub(message, url_secrets(raw))


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


class JSONText(str):
    """A JSON column value already serialised (e.g. ``model.model_dump_json()``): stored as is."""


def json_dumps(value: Any) -> str:
    """The engines' JSON serialiser: :class:`JSONText` as is, the rest through
    :func:`flywheel.jsonpolicy.db_dumps`, whose reader :func:`flywheel.jsonpolicy.db_loads` is the
    engines' deserialiser: a row the writer wrote is never a poison pill for its reader."""
    if isinstance(value, JSONText):
        return value
    return db_dumps(value)


def make_engine(url: str | URL, *, connect_timeout_s: float | None = None) -> Engine:
    """An engine for ``url`` configured for concurrent use (see the module invariants)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _make_sqlite_engine(parsed, connect_timeout_s)
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "json_serializer": json_dumps, "json_deserializer": db_loads}
    if backend == "postgresql":
        timeout = PG_CONNECT_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
        kwargs["connect_args"] = {"connect_timeout": max(1, int(round(timeout)))}
    return create_engine(parsed, **kwargs)


def _make_sqlite_engine(url: URL, connect_timeout_s: float | None) -> Engine:
    path = _sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    busy_s = SQLITE_BUSY_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
    engine = create_engine(url, connect_args={"timeout": busy_s}, json_serializer=json_dumps,
                           json_deserializer=db_loads)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver autocommit: pysqlite's own implicit BEGIN is off; the "begin" hook below issues ours.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_s * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if path is not None:
                mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() != "wal":
                    cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (``expire_on_commit=False``)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def wait_for_db(url: str | URL, timeout_s: float, between: Callable[[], object] | None = None) -> None:
    """Block until ``SELECT 1`` succeeds on ``url``, retrying with backoff for up to ``timeout_s``.

    ``between`` is called after every failed attempt, before the pause (at least every 7 s: an
    attempt's connect timeout is at most 5 s, a pause at most 2 s): a waiting worker keeps its
    heartbeat and its bus membership alive there. Raises :class:`DatabaseUnavailable` (naming the
    URL without its password) when time runs out.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        engine = make_engine(url, connect_timeout_s=max(1.0, min(5.0, remaining)))
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return
        except OperationalError as exc:
            last_error = _scrubbed(str(exc.orig).strip() if exc.orig is not None else str(exc), url)
        finally:
            engine.dispose()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DatabaseUnavailable(
                f"database {safe_url(url)} not reachable after {timeout_s:g}s "
                f"({attempts} attempt(s)): {last_error}"
            )
        if between is not None:
            between()
            remaining = deadline - time.monotonic()
        time.sleep(max(0.0, min(delay, remaining)))
        delay = min(delay * 2, 2.0)


#: SQLSTATEs that mean the server cannot be reached or is going away: class 08 (connection
#: exception), admin_shutdown, crash_shutdown, cannot_connect_now (starting up, in recovery) and
#: too_many_connections.
_OUTAGE_SQLSTATES = ("57P01", "57P02", "57P03", "53300")


def is_db_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached right now, so that waiting for it and
    trying again is the remedy: SQLAlchemy saw the connection drop (``connection_invalidated``:
    terminated by the server, closed unexpectedly, network cut), or an ``OperationalError`` /
    ``InterfaceError`` that is a connection failure (no SQLSTATE: the client could not connect,
    e.g. refused or "not currently accepting connections"; or a SQLSTATE in
    :data:`_OUTAGE_SQLSTATES` or class 08).

    Not an outage: a statement the database refused, even as an ``OperationalError`` (deadlock,
    serialization failure, statement timeout, disk full carry their SQLSTATE), and any SQLite
    error (a local file has no outage; "database is locked" already waited 30 s).
    """
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, (OperationalError, InterfaceError)) or isinstance(exc.orig, sqlite3.Error):
        return False
    code = getattr(exc.orig, "pgcode", None) or getattr(exc.orig, "sqlstate", None)  # psycopg2 | psycopg 3
    return code is None or code.startswith("08") or code in _OUTAGE_SQLSTATES


def outage_reason(exc: BaseException, url: str | URL) -> str:
    """The first line of the driver's message in ``exc``, without any part of ``url``'s secrets
    (the SQL statement and its parameters, which SQLAlchemy adds, are left out)."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(orig).strip().splitlines()
    return _scrubbed(lines[0] if lines else type(orig).__name__, url)[:300]


class OutageWait:
    """A worker loop's database outages: how long each may last before the worker gives up.

    An outage begins at the first error :func:`is_db_outage` accepts after a good turn
    (:meth:`turn_done`) and may last ``timeout_s`` in all, however many times the database comes
    back and drops again in between. :meth:`wait` blocks until the database answers, or raises
    :class:`DatabaseUnavailable` once the outage has lasted ``timeout_s``; the worker then exits
    as it does on any other error, and its supervisor restarts it.
    """

    def __init__(self, url: str | URL, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.since: float | None = None  # monotonic time the current outage began
        self.count = 0  # outages met so far

    def turn_done(self) -> None:
        """A turn of the loop completed: the next outage error begins a new outage."""
        self.since = None

    def wait(self, exc: BaseException, between: Callable[[], object] | None = None,
             stop: threading.Event | None = None) -> float | None:
        """After the outage error ``exc``: block until ``SELECT 1`` succeeds again, calling ``between``
        meanwhile (``wait_for_db``); returns the seconds this outage has lasted so far, or None
        when ``stop`` was set meanwhile (seen between two attempts: within about 7 s)."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.count += 1
        remaining = self.timeout_s - (now - self.since)
        if remaining <= 0:
            raise DatabaseUnavailable(
                f"database {safe_url(self.url)} still failing after {self.timeout_s:g}s: {outage_reason(exc, self.url)}"
            ) from exc

        def meanwhile() -> None:
            if between is not None:
                between()
            if stop is not None and stop.is_set():
                raise _Stopped

        try:
            wait_for_db(self.url, remaining, meanwhile)
        except _Stopped:
            return None
        except DatabaseUnavailable as gone:
            raise gone from exc
        return time.monotonic() - self.since


    def ride_out(self, role: str, exc: BaseException, between: Callable[[], object] | None = None,
                 stop: threading.Event | None = None) -> None:
        """A worker loop's ``except`` clause: re-raise ``exc`` unless :func:`is_db_outage` accepts
        it; else log, :meth:`wait` (``between`` keeps the worker alive meanwhile: its health beat,
        its consumer group) and log when the database is back. The caller then drops what a crash
        would lose and reads again from its committed offsets."""
        if not is_db_outage(exc):
            raise exc
        log.warning("%s: database unreachable (%s); waiting up to %gs for it, in the consumer group",
                    role, outage_reason(exc, self.url), self.timeout_s)
        lasted = self.wait(exc, between, stop)
        if lasted is not None:
            log.warning("%s: database back after %.1fs; reading again from the committed offsets", role, lasted)


#: The Alembic environment and revisions (the package ``flywheel.db.migrations``).
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


class _Stopped(Exception):
    """``OutageWait.wait``: the worker was asked to stop while it waited."""


def _alembic_config(url: str | URL) -> Any:
    from alembic.config import Config

    folder = MIGRATIONS_DIR
    if not (folder / "alembic.ini").is_file():
        raise RuntimeError(f"alembic.ini not found in {folder}")
    config = Config(str(folder / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    # Passed as an attribute, not through the ini file, so a '%' in a password needs no escaping.
    config.attributes["flywheel_url"] = str(url) if isinstance(url, str) else url.render_as_string(hide_password=False)
    return config


_MIGRATION_LOCK = threading.Lock()


def upgrade(url: str | URL, rev: str = "head") -> None:
    """Run the Alembic migrations on ``url`` up to ``rev`` (default: the newest)."""
    from alembic import command

    with _MIGRATION_LOCK:  # Alembic's migration context is global to the process
        command.upgrade(_alembic_config(url), rev)


def downgrade(url: str | URL, rev: str = "base") -> None:
    """Run the Alembic migrations on ``url`` down to ``rev`` (default: an empty schema)."""
    from alembic import command

    with _MIGRATION_LOCK:
        command.downgrade(_alembic_config(url), rev)


def open_database(url: str, wait_s: float) -> Engine:
    """What every role does first: wait for the database, upgrade it to head, return an engine."""
    wait_for_db(url, wait_s)
    upgrade(url)
    return make_engine(url)


def insert_ignore(session: Session, model: type[Any], rows: Iterable[Mapping[str, Any]]) -> int:
    """Insert ``rows`` into ``model``'s table, skipping any row that violates a unique key.

    ``INSERT .. ON CONFLICT DO NOTHING`` on PostgreSQL and SQLite. Returns how many rows were
    actually inserted. Does not commit: the caller owns the transaction.
    """
    rows = [dict(row) for row in rows]
    if not rows:
        return 0
    table = model.__table__
    dialect = session.get_bind(mapper=model).dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"insert_ignore does not support the {dialect!r} dialect")
    returning = list(table.primary_key.columns)
    # executemany needs one key set per statement; group rows that name the same columns.
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    inserted = 0
    for group in groups.values():
        stmt = insert(table).on_conflict_do_nothing().returning(*returning)
        inserted += len(session.execute(stmt, group).all())
    return inserted
