"""Start-up readiness on both sides of the gateway-node link.

The node announces itself (live heartbeat, row in ``nodes``) only once its HTTP port listens and it
holds a loaded version: a real built-in node (``serving.node.main.run`` on the quick tiny model, in
a thread) whose Redis heartbeat is watched, and whose port must accept a connection the moment the
heartbeat first names it.

The gateway (in-process, its whole lifespan) answers a chat completion with 503 ``fleet_starting``
and ``Retry-After`` while the node it would use refuses connections and no upstream has answered it
yet: the local node when no ``gateway.upstream`` is set, or a heartbeating node (Redis live state).
Once an upstream answered, a refused connection is a genuine failure again: 502
``upstream_unreachable`` (an upstream set by hand that refuses from the start is a 502 too:
tests/unit/test_gateway_validation.py).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flywheel.live import RedisLive
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from testbed.procs import ChildService, free_port

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "sort 3 1 2"}]


@contextmanager
def upstream(port: int, log: Path) -> Iterator[None]:
    """The canned upstream (bench/upstream.py) as its own process on ``port``: when it is killed its
    sockets close, the gateway's kept-alive connection with them, so the next call connects anew."""
    service = ChildService("canned upstream", [sys.executable, "-m", "bench.upstream", "--port", str(port)], port, log)
    service.start_process(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True, 30)
    try:
        yield
    finally:
        service.kill()


def _starting(response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "2"
    assert response.json() == {"error": {
        "message": response.json()["error"]["message"], "type": "service_unavailable_error", "param": None,
        "code": "fleet_starting"}}
    assert "the fleet is starting" in response.json()["error"]["message"]


def test_the_local_node_refusing_before_it_ever_answered_is_fleet_starting(tmp_path):
    port = free_port()
    # No gateway.upstream: the local node. No bus to ship to: nothing waits for the capture at shutdown.
    settings = load_settings(data_dir=str(tmp_path), node={"port": port}, gateway={"drain_timeout_s": 0})
    with TestClient(create_app(settings)) as client:
        for stream in (False, True):
            _starting(client.post(CHAT, json={"messages": MESSAGES, "stream": stream}))
        with upstream(port, tmp_path / "upstream.log"):
            served = client.post(CHAT, json={"messages": MESSAGES})
            assert served.status_code == 200, served.text
        gone = client.post(CHAT, json={"messages": MESSAGES})  # after start-up: a failure, not start-up
        assert gone.status_code == 502, gone.text
        assert gone.json()["error"]["code"] == "upstream_unreachable" and "Retry-After" not in gone.headers


def test_a_heartbeating_node_that_refuses_in_its_first_seconds_is_fleet_starting(tmp_path, redis_url, live_prefix):
    port = free_port()
    live = {"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix}
    settings = load_settings(data_dir=str(tmp_path), live=live, node={"port": free_port()},
                             gateway={"drain_timeout_s": 0})
    beats = RedisLive(redis_url, live_prefix)
    try:
        beats.heartbeat("n-1", {"node_id": "n-1", "url": f"http://127.0.0.1:{port}", "model_line": settings.model.line,
                                "live_version": None, "versions": [], "status": "serving"}, ttl_s=60)
        with TestClient(create_app(settings)) as client:
            deadline = time.monotonic() + 10
            while "n-1" not in str(client.get("/v1/models").json()) and time.monotonic() < deadline:
                time.sleep(0.1)  # the router's snapshot names the node
            assert "n-1" in str(client.get("/v1/models").json())
            _starting(client.post(CHAT, json={"messages": MESSAGES}))
            with upstream(port, tmp_path / "upstream.log"):
                assert client.post(CHAT, json={"messages": MESSAGES}).status_code == 200
            assert client.post(CHAT, json={"messages": MESSAGES}).status_code == 502
    finally:
        beats.close()


def test_a_node_heartbeats_only_once_its_port_listens(tmp_path, tiny_model_dir, redis_url, live_prefix):
    from serving.node.main import run

    port = free_port()
    settings = load_settings(data_dir=str(tmp_path), model={"path": str(tiny_model_dir)},
                             live={"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix},
                             node={"port": port, "node_id": "n-ready", "poll_s": 0.5})
    beats = RedisLive(redis_url, live_prefix)
    stop = threading.Event()
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            run(settings, stop)
        except BaseException as exc:  # reported by the test below
            failed.append(exc)

    node = threading.Thread(target=serve, daemon=True)
    node.start()
    try:
        deadline = time.monotonic() + 120
        while not beats.heartbeats():
            assert not failed, failed
            assert time.monotonic() < deadline, "the node never announced itself"
            time.sleep(0.005)
        beat = beats.heartbeats()["n-ready"]
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # listening when first announced
            pass
        assert beat["url"] == f"http://127.0.0.1:{port}" and beat["live_version"] == 0 and beat["versions"] == [0]
    finally:
        stop.set()
        node.join(30)
        beats.close()
    assert not node.is_alive() and not failed, failed
