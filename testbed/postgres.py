"""PostgreSQL to run against: the shared server on 127.0.0.1:5432 (its admin database ``test``)
with a throwaway database per test or benchmark phase, or :class:`PrivatePostgres`, a cluster of
our own (``initdb`` in a temporary folder) that a fault can stop, crash and restart.

Every database made here gets a fresh random name; :func:`fresh_database` drops it afterwards
(its connections terminated first), so runs never share state.
"""

from __future__ import annotations

import getpass
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.procs import ServiceUnavailable, free_port, tail

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

log = logging.getLogger("testbed.postgres")

PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_ADMIN_DB = "test"
CONNECT_TIMEOUT_S = 3
PG_START = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"


def server_url(user: str, database: str) -> str:
    """The SQLAlchemy URL of ``database`` on the shared server, as ``user`` (trust auth)."""
    return f"postgresql+psycopg2://{user}@{PG_HOST}:{PG_PORT}/{database}"


def connect_admin(url: str | None = None) -> Engine:
    """An AUTOCOMMIT engine on an admin database: ``url``, else the shared server's ``test``
    database as ``postgres`` or as the current user, whichever answers first. Raises
    :class:`ServiceUnavailable` saying how to start the server when none answers."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    users = dict.fromkeys(["postgres", getpass.getuser()])
    candidates = [url] if url else [server_url(user, PG_ADMIN_DB) for user in users]
    errors = []
    for candidate in candidates:
        engine = create_engine(candidate, isolation_level="AUTOCOMMIT",
                               connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return engine
        except OperationalError as exc:
            errors.append(f"{engine.url.render_as_string()}: {str(exc.orig).strip()}")
            engine.dispose()
    raise ServiceUnavailable(f"PostgreSQL is not reachable ({'; '.join(errors)}).\nStart it with: {PG_START}")


def create_database(admin: Engine, name: str, settings: dict[str, str] | None = None) -> str:
    """Create ``name`` (with ``ALTER DATABASE .. SET`` for each of ``settings``) on ``admin``'s
    server; returns its URL (``admin``'s user and password)."""
    from sqlalchemy import text

    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
        for key, value in (settings or {}).items():
            conn.execute(text(f'ALTER DATABASE "{name}" SET {key} = :value'), {"value": value})
    return admin.url.set(database=name).render_as_string(hide_password=False)


def drop_database(admin: Engine, name: str) -> None:
    """Terminate the connections to ``name`` and drop it (if it exists)."""
    from sqlalchemy import text

    with admin.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name"),
                     {"name": name})
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def fresh_database(admin: Engine, prefix: str = "flywheel_t_",
                   settings: dict[str, str] | None = None) -> Iterator[str]:
    """A new, empty database named ``prefix`` + 16 random hex digits for the block; dropped after."""
    name = f"{prefix}{uuid.uuid4().hex[:16]}"
    url = create_database(admin, name, settings)
    try:
        yield url
    finally:
        drop_database(admin, name)


def postgres_binary(name: str) -> str:
    """``initdb``, ``pg_ctl``...: on PATH or the newest under /usr/lib/postgresql/*/bin."""
    installed = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
    found = shutil.which(name) or next(iter(installed), None)
    if not found:
        raise ServiceUnavailable(f"`{name}` not found on PATH or under /usr/lib/postgresql/*/bin")
    return str(found)


class PrivatePostgres:
    """A PostgreSQL cluster of our own (``initdb`` in a temporary folder, as the ``postgres`` user
    when run as root): start, stop (clean or a crash), start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="flywheel-chaos-pg-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self._as_postgres = os.geteuid() == 0  # initdb and postgres refuse to run as root

    def _run(self, *cmd: str, timeout_s: float = 120.0) -> None:
        full = ["runuser", "-u", "postgres", "--", *cmd] if self._as_postgres else list(cmd)
        result = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s, cwd=self.dir)
        if result.returncode != 0:
            raise ServiceUnavailable(f"{' '.join(cmd[:2])} failed ({result.returncode}): "
                                     f"{result.stderr.strip()[-800:]}\n{tail(self.log_path)}")

    def start(self) -> None:
        if not self.data.exists():
            if self._as_postgres:
                shutil.chown(self.dir, "postgres", "postgres")
            self._run(postgres_binary("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                      "-E", "UTF8")
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=400 "
                   "-c shared_buffers=64MB")
        self._run(postgres_binary("pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-o", options, "-w", "-t",
                  "120", "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (clients are disconnected); ``immediate``: a crash (recovery at start)."""
        self._run(postgres_binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new database ``name`` on this cluster (kept until :meth:`close`); returns its URL."""
        from sqlalchemy import create_engine

        admin = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            return create_database(admin, name)
        finally:
            admin.dispose()

    def close(self, keep: bool = False) -> None:
        """Stop the cluster; its folder is deleted unless ``keep`` (then how to start it is printed)."""
        try:
            self.stop("fast" if keep else "immediate")
        except Exception as exc:  # already stopped, or never started
            log.debug("postgres stop at close: %s", exc)
        if keep:
            print(f"PostgreSQL data kept in {self.data} (start: pg_ctl -D {self.data} "
                  f"-o '-p {self.port} -k {self.dir}' start, as the postgres user)")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
