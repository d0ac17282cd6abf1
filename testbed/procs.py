"""Process plumbing under every testbed service: a free port, polling until ready, a log's tail,
and :class:`ChildService`, a service process of ours on a fixed port (start, stop with any
signal, start again on the same address).

:class:`ServiceUnavailable` is the one error a starter raises when a service or the tool behind
it is missing or does not come up; its message says which and how to get it (with the service's
log tail when it started and died).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ServiceUnavailable(RuntimeError):
    """A service or tool is missing or would not start; the message says which and how to get it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.2, *,
             ignore: tuple[type[BaseException], ...] = (Exception,),
             error: type[Exception] = TimeoutError) -> Any:
    """Poll ``check`` until it returns something truthy; returns it, or raises ``error`` naming
    ``what`` and the last answer. An exception of a type in ``ignore`` counts as not yet (by
    default any: a service that is still starting); any other ends the wait (a test's failed
    assertion, with ``ignore=()``)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except ignore as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise error(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")
        time.sleep(every_s)


def tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log file, or ``(no log)``."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


class ChildService:
    """A service process of ours on ``port``, its output appended to ``log_path``.

    :meth:`start_process` returns once ``ready()`` answers truthy; a process that exits first, or a
    ``ready`` that never answers, is stopped and raises :class:`ServiceUnavailable` with the log's
    tail. ``new_session`` puts the process in a session of its own, out of reach of the signals a
    terminal sends the caller's process group (chaos stops its services itself, at the end).
    """

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, *,
                 new_session: bool = False) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.new_session = new_session
        self.process: subprocess.Popen[bytes] | None = None

    def start_process(self, ready: Callable[[], Any], timeout_s: float) -> None:
        """Spawn ``cmd`` and wait until ``ready()`` answers truthy (exceptions count as not yet)."""
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=self.new_session)
        process = self.process
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while process.poll() is None:
            try:
                if ready():
                    return
            except Exception as exc:  # still starting
                last = exc
            if time.monotonic() >= deadline:
                self.stop()
                self.fail(f"timed out after {timeout_s:g}s waiting for {self.name} on port {self.port} "
                          f"(last: {last!r})")
            time.sleep(0.2)
        self.process = None
        self.fail(f"{self.name} exited with {process.returncode} before it was ready")

    def fail(self, why: str) -> None:
        raise ServiceUnavailable(f"{why}\n{self.name} log {self.log_path}:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Send ``sig`` (SIGKILL after ``timeout_s``) and reap the process; a no-op when not running."""
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

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.stop(signal.SIGKILL)

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log_path, n)
