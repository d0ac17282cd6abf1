"""Run an ASGI app with uvicorn in the calling thread until a stop event is set.

Invariants: nothing global is installed when a ``stop`` event is given from a non-main thread
(uvicorn only installs signal handlers in the main thread); the call returns after uvicorn has
closed its sockets, so the port is free again.

Slow and oversized request heads (slowloris, docs/security.md): uvicorn bounds neither the time a
client may take to send a request's line and headers nor their size (its keep-alive timeout only
runs between requests, and its default httptools parser buffers headers without limit). Every
connection served here gets both bounds (:func:`guarded_protocol`): the head must be complete within
``header_timeout_s`` of the connection opening or of its first byte (after a previous response),
else ``408`` and the connection is closed; more than ``max_head_bytes`` without a complete head is
``431`` and closed. Bytes a client keeps sending after its response (a body the app never read)
count as a head too, so they cannot hold a connection open either. Bodies are the app's to bound
(``serving.protocol.read_json_body``'s deadline).

Idle connections at shutdown: uvicorn closes a keep-alive connection that is between requests the
moment shutdown begins. A client may have sent its next request on it an instant before (bytes
this process has not read yet), and closing a socket with unread bytes resets it: the client gets
``Connection reset by peer`` for a request it had every right to send, and cannot know whether it
ran. So a connection between requests is kept for ``DRAIN_IDLE_S`` once shutdown begins: a request
that arrives meanwhile is served with ``Connection: close``, and one still idle then is closed (a
client idle that long is not sending at that instant, so the reset is no longer a race a busy
client loses). A connection still waiting in the listening socket's queue when it closes is reset
by the kernel; a load balancer that stops routing before SIGTERM (the usual rolling update) avoids
that one.

Malformed requests (docs/security.md): what uvicorn's HTTP parser refuses (a NUL or other control
character in a header, a negative or beyond-64-bit ``Content-Length``, ``Content-Length`` together
with ``Transfer-Encoding``, a bad chunk size, a request line that is not HTTP) gets ``400`` with the
OpenAI error envelope as ``application/json`` (code ``malformed_request``, the parser's reason as the
message) instead of uvicorn's plain-text "Invalid HTTP request received.", and the connection is
closed. Two cases cannot have it:
- the parser fails while a response to an earlier request on the connection is being written (its
  status line and headers are out; a pipelined or late-body error): another response would corrupt
  that one's framing, so the connection is closed with nothing more written;
- with h11 (uvicorn's fallback parser, used only where httptools is not installed, which the pinned
  dependencies rule out) a ``Content-Length`` beyond 64 bits is a number like any other (the route's
  body limit answers 413) and ``Content-Length`` with ``Transfer-Encoding: chunked`` is read as chunked
  (RFC 9112 section 6.3): neither is a parser error there, so neither is a 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import sys
import threading
from typing import Any, Literal

import uvicorn

log = logging.getLogger(__name__)

#: Bounds on a request's line and headers for every server (gateway settings may set their own).
HEADER_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024
#: How long a connection between requests stays open once shutdown begins (module docstring).
DRAIN_IDLE_S = 0.5
#: uvicorn's HTTP/1.1 parsers (``auto``: httptools when installed, else h11).
Parser = Literal["auto", "httptools", "h11"]
#: Where h11 starts quoting the request's bytes in its error messages.
_QUOTED_BYTES = re.compile(r":?\s*(?:bytearray\(|\bb['\"])")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free one (tests read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole ``Connection: close`` response carrying the OpenAI error envelope."""
    from serving.errors import error_body, error_type

    body = json.dumps(error_body(message, type=error_type(status), code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


def malformed_message(exc: BaseException | None) -> str:
    """The message of a 400 for a request the HTTP parser refused: the parser's reason. httptools'
    are fixed phrases (``Invalid header value char``); h11's end with the offending bytes
    (``illegal header line: bytearray(b'...')``), which are dropped, so the answer never reflects
    what the client sent. Printable ASCII only, at most 200 characters."""
    reason = str(exc) if exc is not None else ""
    if type(exc).__name__ == "HttpParserCallbackError":  # httptools: uvicorn's own callback failed on it
        reason = "the request line or headers cannot be decoded"
    reason = _QUOTED_BYTES.split(reason, maxsplit=1)[0]
    reason = "".join(c if " " <= c <= "~" else "?" for c in reason)[:200].strip()
    return f"malformed HTTP request: {reason}" if reason else "malformed HTTP request"


def guarded_protocol(base: type[asyncio.Protocol], header_timeout_s: float, max_head_bytes: int) -> type:
    """``base`` (uvicorn's HTTP/1.1 protocol) with a deadline and a size limit on request heads,
    and the error envelope on the 400 for a malformed request; see the module docstring."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # bytes of the head being received (at a message boundary only)
        _head_bytes_seen = False  # any byte since the last complete head
        _tail = b""  # the last bytes of the head so far (its end may straddle two reads)
        _draining = False  # shutdown began: every response closes its connection

        def _waiting(self) -> bool:
            """True between requests: no request, or the last one answered."""
            return self.cycle is None or self.cycle.response_complete

        def _at_boundary(self) -> bool:
            """True unless the client is still sending the body of the last request (answered
            before the app read all of it, such as a 413): those bytes are not a head."""
            return self.cycle is None or not self.cycle.more_body

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_bytes, self._tail = 0, b""

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            # Only at a message boundary may another response be written: not while the client is
            # still sending the body of a request that was already answered.
            if self._head_bytes_seen and self._at_boundary():
                self.transport.write(_refusal(status, reason, message, code))
            log.info("closed a connection from %s: %s", (self.client or ("?",))[0], message)
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request its parser refused (both of its HTTP/1.1 protocols call
            it from the ``except`` that caught the parser's error, so that error is the one being
            handled), as the error envelope; closes the connection as uvicorn's own does."""
            self._disarm()
            cycle = self.cycle
            responding = cycle is not None and cycle.response_started and not cycle.response_complete
            if not self.transport.is_closing() and not responding:
                self.transport.write(_refusal(400, "Bad Request", malformed_message(sys.exc_info()[1]),
                                              "malformed_request"))
            self.transport.close()

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting():
                self._refuse(408, "Request Timeout", f"request headers not received within {header_timeout_s:g} s",
                             "request_timeout")

        def shutdown(self) -> None:
            """Graceful shutdown (module docstring, Idle connections at shutdown): a request being
            served finishes and closes the connection, as uvicorn's own; a connection between
            requests stays open ``DRAIN_IDLE_S`` for a request already on its way."""
            self._draining = True
            if not self._waiting():
                super().shutdown()
            elif not self.transport.is_closing():
                self.loop.call_later(DRAIN_IDLE_S, self._close_if_idle)

        def _close_if_idle(self) -> None:
            # A head being received is a request on its way: it is served (and the head timeout
            # bounds it); its response closes the connection.
            if self._waiting() and not self._head_bytes_seen and not self.transport.is_closing():
                super().shutdown()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            waiting, cycle = self._waiting(), self.cycle
            if waiting:
                self._arm()
                self._head_bytes_seen = True
                if self._at_boundary() and not self._count_head(data):
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"request line and headers exceed {max_head_bytes} bytes", "request_too_large")
                    return  # never parsed: a head this large is not buffered either
            super().data_received(data)
            if self.cycle is not cycle:  # a request's head is complete: the app has it now
                self._disarm()
                self._head_bytes_seen = False
                if self._draining and self.cycle is not None:
                    self.cycle.keep_alive = False  # its response says Connection: close

        def _count_head(self, data: bytes) -> bool:
            """Add ``data`` to the head being received, up to the blank line that ends it (one read
            may hold a whole head and the start of its body); False once it is too large."""
            window = self._tail + data
            end = window.find(b"\r\n\r\n")
            if end < 0:
                self._head_bytes += len(data)
                self._tail = window[-3:]
            else:
                self._head_bytes += end + 4 - len(self._tail)
            if self._head_bytes > max_head_bytes:
                return False
            if end >= 0:
                self._head_bytes, self._tail = 0, b""
            return True

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def http_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_head_bytes: int = MAX_HEAD_BYTES,
                  parser: Parser = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol (``auto``: httptools when installed, else h11, as uvicorn's own
    ``auto``), guarded by :func:`guarded_protocol`."""
    if parser == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:  # pragma: no cover - httptools is a pinned dependency
            parser = "h11"
        else:
            parser = "httptools"
    if parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base  # type: ignore[assignment]
    return guarded_protocol(base, header_timeout_s, max_head_bytes)


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
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_head_bytes: int = MAX_HEAD_BYTES,
    parser: Parser = "auto",
) -> None:
    """Serve ``app`` until ``stop`` is set (or SIGINT/SIGTERM when run in the main thread); at
    shutdown in-flight requests get ``graceful_timeout_s`` to finish (None: as long as they need).
    Request heads are bounded by ``header_timeout_s`` and ``max_head_bytes``; ``parser`` picks
    uvicorn's HTTP parser (module docstring)."""
    # log_config=None: uvicorn must not reconfigure the process's logging (the entry point owns it).
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=graceful_timeout_s, http=http_protocol(header_timeout_s, max_head_bytes, parser),
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
