"""The gateway's HTTP/1.1 client for its upstreams: keep-alive connection pools, httptools parsing.

The gateway spends most of its CPU talking to the upstream, so this client does only what that
needs: ``POST`` a JSON body to ``http(s)://host:port/path`` and read the answer whole
(:meth:`Response.read`) or as it arrives (:meth:`Response.chunks`, or :meth:`Response.lines` for
event streams), with the response parsed by ``httptools`` (C; chunked transfer decoding included).
General-purpose clients cost three to five times as much per request (measured: httpx ~930 us,
aiohttp ~300 us of CPU).

Invariants:
- A connection returns to its pool only after its response was read to the end and the server
  allows keep-alive; anything else (an error, a response abandoned half-read) closes it.
- A request on a reused connection that the server had already closed (no byte of a response
  came back) is retried once on a new connection; any other failure is :class:`UpstreamError`
  (:class:`UpstreamUnreachable` when no connection could be opened at all).
- ``timeout_s`` bounds the whole exchange, connect to last byte; past it the connection is closed
  and the caller gets :class:`UpstreamError`.
- Response header names are lower-cased; values are decoded as latin-1 (RFC 9110).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The upstream could not be reached, broke off, or timed out."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the upstream could be opened (refused, unresolvable, timed out): it saw
    nothing of the request."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.response: Response | None = None

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        self.response._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response._fail(UpstreamError(f"malformed response from the upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response._complete:
            self.response._fail(UpstreamError("the upstream closed the connection mid-response"))

    # httptools callbacks -----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        if not response._head.done():
            response._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response._complete = True
        response._keep_alive = self.parser.should_keep_alive()
        response._feed(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """One upstream response; read it to the end (or :meth:`release` it) exactly once."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] = loop.create_future()
        self._body: deque[bytes | None] = deque()
        self._ready: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._complete = False
        self._keep_alive = False
        self._got_bytes = False
        self._released = False
        self._timer: asyncio.TimerHandle | None = None
        self._content: bytes | None = None

    def _feed(self, data: bytes | None) -> None:
        self._body.append(data)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        try:
            while True:
                if not self._body:
                    if self._error is not None:
                        raise self._error
                    self._ready = asyncio.get_running_loop().create_future()
                    await self._ready
                    continue
                data = self._body.popleft()
                if data is None:
                    return
                yield data
        finally:
            self.release()

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines without their line endings, as they arrive; no line-length limit (an
        event-stream chunk may carry a long prompt's token ids)."""
        pending = b""
        async for data in self.chunks():
            pending += data
            *whole, pending = pending.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    async def read(self) -> bytes:
        """The whole body (read once; later calls return the same bytes)."""
        if self._content is None:
            self._content = b"".join([chunk async for chunk in self.chunks()])
        return self._content

    def release(self) -> None:
        """Hand the connection back (complete, keep-alive) or close it (anything else)."""
        if self._released:
            return
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
        self._connection.pool._release(self._connection, self._complete and self._keep_alive and self._error is None)


class Pool:
    """Keep-alive connections per upstream origin, shared by every request of one event loop."""

    def __init__(self, timeout_s: float, max_idle_per_origin: int = 256) -> None:
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_origin
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._origin_of: dict[_Connection, tuple[str, str, int]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send ``body`` and wait for the response head; read the body from the :class:`Response`."""
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        if scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"unsupported upstream URL {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname, port)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
        head = [f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        request = "".join(head).encode("latin-1") + b"\r\n" + body
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        for attempt in (0, 1):
            connection, reused = await self._acquire(origin, deadline)
            response = Response(connection)
            connection.response = response
            response._timer = loop.call_at(deadline, self._expire, connection, response)
            assert connection.transport is not None
            connection.transport.write(request)
            try:
                await response._head
            except UpstreamError:
                response.release()
                if reused and attempt == 0 and not response._got_bytes:
                    continue  # the server had closed this idle connection: one fresh try
                raise
            except BaseException:  # cancelled (the client went away): the connection is not reusable
                response.release()
                raise
            return response
        raise AssertionError("unreachable")

    async def _acquire(self, origin: tuple[str, str, int], deadline: float) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
            self._origin_of.pop(connection, None)
        loop = asyncio.get_running_loop()
        scheme, hostname, port = origin
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), hostname, port,
                                       ssl=self._ssl if scheme == "https" else None),
                timeout=max(0.001, deadline - loop.time()),
            )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"cannot connect to {scheme}://{hostname}:{port}: {type(exc).__name__}: {exc}") from None
        self._origin_of[connection] = origin
        return connection, False

    def _release(self, connection: _Connection, reusable: bool) -> None:
        connection.response = None
        origin = self._origin_of.get(connection)
        idle = self._idle.setdefault(origin, deque()) if origin is not None else None
        if reusable and not connection.closed and idle is not None and len(idle) < self.max_idle:
            connection.parser = httptools.HttpResponseParser(connection)
            idle.append(connection)
            return
        self._origin_of.pop(connection, None)
        connection.close()

    @staticmethod
    def _expire(connection: _Connection, response: Response) -> None:
        if not response._complete:
            response._fail(UpstreamError("the upstream did not answer in time"))
            connection.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        self._origin_of.clear()
