"""Database connections: engines, sessions, start-up wait, migrations and the idempotent insert.

One engine per process (never share one across ``fork``). The same code runs on PostgreSQL
(production) and on an SQLite file (embedded default).

Invariants:
- SQLite engines use WAL, a 30 s busy timeout, foreign keys, and take the write lock when a
  transaction begins (``BEGIN IMMEDIATE``), so several processes can read-modify-write one file
  without "database is locked" failures or lost updates: writers queue instead of failing.
- The schema is owned by Alembic (``migrations/``); :func:`upgrade` brings any database to head and
  works from any working directory.
- :func:`insert_ignore` never raises on a duplicate key and never commits; it reports how many rows
  were actually new.
- Error messages name the database without its password.
"""

from __future__ import annotations

import json
import threading

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_S = 30.0
PG_CONNECT_TIMEOUT_S = 10


class DatabaseUnavailable(RuntimeError):
    """The database could not be reached in time."""


def safe_url(url: str | URL) -> str:
    """The URL as text with the password masked, for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


class JSONText(str):
    """A JSON column value already serialised (e.g. ``model.model_dump_json()``): stored as is."""


def json_dumps(value: Any) -> str:
    """The engines' JSON serialiser: :class:`JSONText` as is, the rest through orjson (json for
    what orjson refuses, such as integers beyond 64 bits)."""
    if isinstance(value, JSONText):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value)


def make_engine(url: str | URL, *, connect_timeout_s: float | None = None) -> Engine:
    """An engine for ``url`` configured for concurrent use (see the module invariants)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _make_sqlite_engine(parsed, connect_timeout_s)
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "json_serializer": json_dumps, "json_deserializer": orjson.loads}
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
                           json_deserializer=orjson.loads)

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


def wait_for_db(url: str | URL, timeout_s: float) -> None:
    """Block until ``SELECT 1`` succeeds on ``url``, retrying with backoff for up to ``timeout_s``.

    Raises :class:`DatabaseUnavailable` (naming the URL without its password) when time runs out.
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
            last_error = str(exc.orig).strip() if exc.orig is not None else str(exc)
        finally:
            engine.dispose()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DatabaseUnavailable(
                f"database {safe_url(url)} not reachable after {timeout_s:g}s "
                f"({attempts} attempt(s)): {last_error}"
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 2.0)


def _alembic_config(url: str | URL) -> Any:
    from alembic.config import Config

    import migrations

    # __path__, not __file__: an editable install may expose the package as a namespace package.
    folders = [Path(entry) for entry in migrations.__path__ if (Path(entry) / "alembic.ini").is_file()]
    if not folders:
        raise RuntimeError(f"migrations/alembic.ini not found in {list(migrations.__path__)}")
    folder = folders[0].resolve()
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
