"""A session routed to a version its node is still loading (just promoted) waits for it instead of
failing: the node answers 409 ``version_unavailable`` until the load is done, the gateway asks again
for a few seconds. A version that never arrives still ends in the 409 after that wait."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest

from flywheel.db.models import ModelVersion
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from serving.gateway.completions import LOADING_WAIT_S
from serving.server import bind, serve
from testbed.procs import free_port
from tests.fixtures.roles import wait_until
from tests.integration.test_tenancy_attacks import VersionEchoUpstream

pytestmark = pytest.mark.integration


class LoadingNode(VersionEchoUpstream):
    """Holds version 1 only ``ready_after_s`` after the first request for it (so the gateway's own
    start-up time, which varies with the machine's load, does not count); until then, 409 for it
    like a node does."""

    def __init__(self, ready_after_s: float) -> None:
        super().__init__()
        self.ready_after_s = ready_after_s
        self.ready_at: float | None = None
        self.refused = 0

    async def respond(self, method, path, body, writer) -> None:  # type: ignore[no-untyped-def]
        if path.startswith("/v1/chat") and self.version == 1 and self.ready_at is None:
            self.ready_at = time.monotonic() + self.ready_after_s
        if path.startswith("/v1/chat") and self.version == 1 and time.monotonic() < self.ready_at:
            self.refused += 1
            return self.send(writer, 409, {"error": {
                "message": "version 1 is not held by this node (it holds [0]); start a new session or ask for one of those",
                "type": "invalid_request_error", "param": "X-Flywheel-Model-Version", "code": "version_unavailable"}})
        return await super().respond(method, path, body, writer)


@pytest.mark.parametrize("ready_after_s, served", [(1.2, True), (LOADING_WAIT_S + 3.0, False)])
def test_a_session_waits_for_its_node_to_load_a_promoted_version(tmp_path, sqlite_url, ready_after_s, served) -> None:
    upstream, port = LoadingNode(ready_after_s), free_port()
    loop, started, stop_upstream = asyncio.new_event_loop(), threading.Event(), asyncio.Event()
    threading.Thread(target=loop.run_until_complete, args=(upstream.serve("127.0.0.1", port, started, stop_upstream),),
                     daemon=True).start()
    assert started.wait(10)
    settings = load_settings(data_dir=str(tmp_path / "data"), bus={"kind": "local", "topic_prefix": "t."},
                             db={"url": sqlite_url}, gateway={"upstream": f"http://127.0.0.1:{port}"})
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    with make_session_factory(engine)() as s:  # v1 was just promoted: the registry says stable
        s.add_all(ModelVersion(model_line=settings.model.line, version=v, kind="full", parent=None, sha256="0" * 64,
                               store_key=f"v{v}", bytes=1, full_bytes=1, status=status,
                               created_at=datetime.now(UTC)) for v, status in ((0, "retired"), (1, "stable")))
        s.commit()
    sock = bind("127.0.0.1", 0)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve, kwargs=dict(app=create_app(settings), host="127.0.0.1", port=0, sock=sock,
                                                         stop=stop, ready=ready), daemon=True)
    thread.start()
    try:
        wait_until("the gateway", ready.is_set, timeout_s=60)
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "sort 3 1 2"}]},
                       headers={"X-Flywheel-Session": "s-1"})
        waited = time.monotonic() - t0
        assert upstream.refused >= 2  # it really was asked while loading
        if served:
            assert r.status_code == 200, r.text
            assert r.json()["model_version"] == 1 and r.headers["X-Flywheel-Model-Version"] == "1"
            assert 1.0 <= waited < LOADING_WAIT_S + 1
        else:
            assert r.status_code == 409 and r.json()["error"]["code"] == "version_unavailable", r.text
            assert LOADING_WAIT_S <= waited < LOADING_WAIT_S + 2
    finally:
        stop.set()
        thread.join(30)
        loop.call_soon_threadsafe(stop_upstream.set)
        engine.dispose()
