"""Run an ASGI app with uvicorn in the calling thread until a stop event is set.

Invariants: nothing global is installed when a ``stop`` event is given from a non-main thread
(uvicorn only installs signal handlers in the main thread); the call returns after uvicorn has
closed its sockets, so the port is free again.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free one (tests read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    stop: threading.Event | None = None,
    sock: socket.socket | None = None,
    ready: threading.Event | None = None,
    log_level: str = "warning",
    graceful_timeout_s: float | None = None,
) -> None:
    """Serve ``app`` until ``stop`` is set (or SIGINT/SIGTERM when run in the main thread); at
    shutdown in-flight requests get ``graceful_timeout_s`` to finish (None: as long as they need)."""
    # log_config=None: uvicorn must not reconfigure the process's logging (the entry point owns it).
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=graceful_timeout_s,
    )
    server = uvicorn.Server(config)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if ready is not None and server.started and not ready.is_set():
                ready.set()
            if stop is not None and stop.is_set():
                server.should_exit = True
                return
            done.wait(0.05)

    watcher = threading.Thread(target=watch, name="uvicorn-stop-watcher", daemon=True)
    watcher.start()
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        done.set()
        watcher.join(timeout=1.0)
        if sock is not None:
            sock.close()
