"""A fault-injecting HTTP reverse proxy between the gateway and one node.

The node's heartbeat names the proxy as its URL, so the gateway's real routing sends traffic through
it. Per ``POST /v1/*`` request it passes, delays, answers an error, or breaks the response off
part-way (streams included), as :class:`UpstreamFaults` says, and counts what it did.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from testbed.procs import wait_for


@dataclass
class UpstreamFaults:
    """Per request to ``/v1/*``: delay it (``slow`` share, ``slow_s`` range), answer an error
    (``error`` share), or break the response off part-way (``disconnect`` share)."""

    slow: float = 0.0
    slow_s: tuple[float, float] = (0.5, 2.5)
    error: float = 0.0
    disconnect: float = 0.0


class UpstreamProxy:
    """An HTTP reverse proxy in a thread in front of one node; the node's heartbeat names it, so the
    gateway reaches the node through it. Injects :class:`UpstreamFaults` and counts them."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.target = ""
        self.faults = UpstreamFaults()
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(512)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._client: httpx.AsyncClient | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._serve, name=f"proxy-{name}", daemon=True)

    def start(self, target: str) -> None:
        self.target = target
        self._thread.start()
        wait_for(f"proxy {self.name}", lambda: httpx.get(f"{self.url}/chaos-proxy", timeout=2).status_code == 204, 30)

    def _serve(self) -> None:
        import uvicorn

        config = uvicorn.Config(self, log_level="critical", log_config=None, access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._server.run(sockets=[self._sock])

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def _pick(self) -> str:
        f, x = self.faults, self._rng.random()
        for kind, share in (("slow", f.slow), ("error", f.error), ("disconnect", f.disconnect)):
            if x < share:
                return kind
            x -= share
        return "pass"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._client = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=200))
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._client is not None:
                        await self._client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/chaos-proxy":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        fault = self._pick() if scope["method"] == "POST" and scope["path"].startswith("/v1/") else "pass"
        self.counts[fault] += 1
        if fault == "slow":
            await asyncio.sleep(self._rng.uniform(*self.faults.slow_s))
        if fault == "error":
            status = self._rng.choice([500, 502, 503])
            payload = json.dumps({"error": {"message": "chaos: injected upstream error", "type": "server_error",
                                            "param": None, "code": "chaos_injected"}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        query = scope.get("query_string", b"").decode()
        url = f"{self.target}{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length", b"connection")]
        assert self._client is not None
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError:
            self.counts["unreachable"] += 1
            await send({"type": "http.response.start", "status": 502, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        try:
            hop = {b"transfer-encoding", b"connection", b"keep-alive"}
            out_headers = [(k, v) for k, v in response.headers.raw if k.lower() not in hop]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            sent = 0
            async for chunk in response.aiter_raw():
                if fault == "disconnect":
                    # Send part of what the node answered, then drop the connection.
                    await send({"type": "http.response.body", "body": chunk[: max(1, len(chunk) // 2)], "more_body": True})
                    raise ConnectionAbortedError("chaos: upstream disconnected mid-response")
                sent += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
