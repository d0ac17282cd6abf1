"""The gateway's upstream client (serving/gateway/upstream.py) against raw asyncio servers that
misbehave on purpose: keep-alive reuse, a server that closed an idle connection, chunked bodies
arriving piecemeal, a server that stalls, one that hangs up mid-body, and garbage."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from serving.gateway.upstream import Pool, UpstreamError

pytestmark = pytest.mark.unit

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nX-Thing: v\r\n%s\r\n%s" % (len(body), extra, body)


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str, list[int]]:
    connections: list[int] = []

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/x", connections


def test_keep_alive_reuses_one_connection_and_echoes_the_body():
    async def echo(reader, writer):
        while True:
            body = await _read_request(reader)
            writer.write(_ok(body))

    async def main():
        server, url, connections = await _serve(echo)
        pool = Pool(timeout_s=5)
        for i in range(20):
            response = await pool.post(url, b'{"i": %d}' % i, {"content-type": "application/json"})
            assert response.status == 200 and response.headers["x-thing"] == "v"
            assert await response.read() == b'{"i": %d}' % i
            assert await response.read() == b'{"i": %d}' % i  # cached
        assert len(connections) == 1
        pool.close()
        server.close()

    asyncio.run(main())


def test_an_idle_connection_the_server_closed_is_retried_once_on_a_new_one():
    async def one_per_connection(reader, writer):
        await _read_request(reader)
        writer.write(_ok(b"fresh"))
        await writer.drain()
        # keep-alive advertised, but the server hangs up right after: the pool's idle copy is dead

    async def main():
        server, url, connections = await _serve(one_per_connection)
        pool = Pool(timeout_s=5)
        for _ in range(3):
            response = await pool.post(url, b"{}", {})
            assert await response.read() == b"fresh"
            await asyncio.sleep(0.05)
        assert len(connections) == 3
        pool.close()
        server.close()

    asyncio.run(main())


def test_chunked_bodies_arrive_as_they_are_sent():
    async def chunked(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await _read_request(reader)  # and the connection is reusable afterwards
        writer.write(_ok(b"again"))

    async def main():
        server, url, connections = await _serve(chunked)
        pool = Pool(timeout_s=5)
        response = await pool.post(url, b"{}", {})
        assert response.headers["content-type"] == "text/event-stream"
        parts = [chunk async for chunk in response.chunks()]
        assert b"".join(parts) == b"data: 1\n\ndata: 2\n\n" and len(parts) == 2
        assert await (await pool.post(url, b"{}", {})).read() == b"again"
        assert len(connections) == 1
        pool.close()
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["stall", "hang_up_mid_body", "garbage", "refused"])
def test_failures_are_upstream_errors_and_the_connection_is_not_reused(fault):
    async def faulty(reader, writer):
        await _read_request(reader)
        if fault == "stall":
            await asyncio.sleep(5)
        elif fault == "hang_up_mid_body":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
            await writer.drain()
        elif fault == "garbage":
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)

    async def main():
        server, url, connections = await _serve(faulty)
        if fault == "refused":
            server.close()
            await server.wait_closed()
        pool = Pool(timeout_s=0.5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(UpstreamError):
            response = await pool.post(url, b"{}", {})
            await response.read()
        assert loop.time() - start < 2.0
        assert not any(pool._idle.values())  # nothing broken went back to the pool
        pool.close()
        server.close()

    asyncio.run(main())
