"""Honest HTTP answers and private files, tried for real against ``flywheel up`` with
``gateway.auth = "on"`` (every role its own process, started under umask 022 in a data folder an
earlier version left world-readable), the vLLM node's front, and the node's app on uvicorn's h11
parser:

- a trailing slash (``/admin/capture/``) is the same 404 error envelope as any unknown path, never a
  redirect whose ``Location`` echoes the request's ``Host`` header;
- what the HTTP parser refuses (a NUL in a header, a negative or beyond-64-bit ``Content-Length``,
  ``Content-Length`` with ``Transfer-Encoding: chunked``, a bad chunk size, a request line that is not
  HTTP) is a 400 with the OpenAI error envelope as JSON, not uvicorn's plain text, except behind a
  response already under way on the connection, which nothing may break into;
- ``GET /v1/models`` spends the caller's per-key rate limit like the other ``/v1`` routes;
- everything the processes create under the data folder (spool, local bus log, SQLite database and
  its ``-wal``/``-shm`` files, weight store, checkpoints, heartbeats, logs, the effective settings)
  is its owner's alone: folders 0700, files 0600.

docs/security.md lists these with the other attacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from flywheel.settings import Settings, load_settings
from rewards.guards import held_out_point
from testbed.procs import free_port
from tests.fixtures.roles import raw_exchange, served_app, wait_until
from tests.fixtures.traffic import clean_env, start_up

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: The 404 every unknown path gets (serving/errors.py): what a trailing slash must get too.
NOT_FOUND = {"error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": None}}
EVIL_HOST = "evil.example"


# `flywheel up`, auth on, under umask 022 ----------------------------------------------------


@dataclass
class Up:
    settings: Settings
    config: Path
    log: Path
    process: subprocess.Popen[bytes]
    keys: dict[str, str] = field(default_factory=dict)  # acme, limited (12 rpm), admin

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.settings.gateway.port}"

    @property
    def node(self) -> str:
        return f"http://127.0.0.1:{self.settings.node.port}"

    def client(self, who: str) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, headers={"Authorization": f"Bearer {self.keys[who]}"}, timeout=30)

    def cli(self, *argv: str) -> str:
        """``flywheel --config ... ARGV`` as its own process (under umask 022, as the stack)."""
        result = subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(self.config), *argv],
                                cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120, umask=0o022)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def tail(self, lines: int = 40) -> str:
        logs = [self.log, *sorted((self.settings.data_path / "logs").glob("*.log"))]
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in logs if p.exists())


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("hygiene")
    data = root / "data"
    data.mkdir()
    data.chmod(0o755)  # as an earlier version (or `mkdir` under umask 022) left it
    settings = load_settings(
        data_dir=str(data),
        model={"path": str(tiny_model_dir)},
        gateway={"auth": "on", "port": free_port()},
        node={"port": free_port(), "poll_s": 0.2},
        # A trajectory closes a second after its feedback and one trains a step, which publishes a
        # version: the trainer's checkpoint and the store's delta land in the data folder.
        ingest={"inactivity_timeout_s": 1.0},
        trainer={"batch_size": 1},
    )
    config, log, process = start_up(root, settings, umask=0o022)
    stack = Up(settings, config, log, process)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"flywheel up exited with {process.returncode}:\n{stack.tail()}"
            return all(httpx.get(f"{url}/health", timeout=2).status_code == 200 for url in (stack.node, stack.gateway))

        wait_until("flywheel up to serve", ready, timeout_s=240, every_s=0.5)
        for who, extra in (("acme", ()), ("limited", ("--rpm", "12")), ("admin", ("--admin",))):
            created = json.loads(stack.cli("keys", "create", "--tenant", "ops" if who == "admin" else "acme",
                                           "--name", who, "--json", *extra))
            stack.keys[who] = created["key"]
        yield stack
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # `up` stops its children gracefully
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def _raw(url: str, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection to ``url``'s host and port; everything the server sent
    before it closed the connection (or ``timeout_s``)."""
    parts = httpx.URL(url)
    return raw_exchange((parts.host, parts.port), data, timeout_s)


def _parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one whole ``Connection: close`` response."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), headers, body


# Trailing slashes ------------------------------------------------------------------------------

GATEWAY_PATHS = [("GET", "/admin/capture/"), ("GET", "/admin/pins/"), ("GET", "/admin/versions/"),
                 ("PUT", "/admin/pins/acme/"), ("POST", "/admin/unpin/"), ("GET", "/v1/models/"),
                 ("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/"), ("POST", "/v1/feedback/"),
                 ("GET", "/health/"), ("GET", "/metrics/")]
NODE_PATHS = [("GET", "/v1/models/"), ("GET", "/health/"), ("POST", "/v1/chat/completions/"),
              ("POST", "/v1/completions/"), ("POST", "/admin/update_weights/")]


def _assert_no_redirect(base: str, method: str, path: str, headers: dict[str, str]) -> None:
    r = httpx.request(method, f"{base}{path}", headers={**headers, "Host": EVIL_HOST},
                      json={} if method in ("POST", "PUT") else None, follow_redirects=False, timeout=10)
    assert r.status_code == 404, (base, method, path, r.status_code, dict(r.headers))
    assert r.headers["content-type"] == "application/json", (path, r.headers)
    assert r.json() == NOT_FOUND, (path, r.text)
    assert "location" not in r.headers and EVIL_HOST not in r.text, (path, dict(r.headers))


def test_trailing_slashes_are_the_unknown_path_404_and_never_a_redirect(up: Up, tmp_path: Path) -> None:
    from tests.integration.test_vllm_front import front

    # The envelope compared against: what an unknown path gets on each app.
    assert httpx.get(f"{up.gateway}/no-such-route").json() == NOT_FOUND
    assert httpx.get(f"{up.node}/no-such-route").json() == NOT_FOUND
    for who in (None, "admin", "acme"):
        headers = {"Authorization": f"Bearer {up.keys[who]}"} if who else {}
        for method, path in GATEWAY_PATHS:
            _assert_no_redirect(up.gateway, method, path, headers)
    for method, path in NODE_PATHS:
        _assert_no_redirect(up.node, method, path, {})
    # The vLLM node's front (node.engine = "vllm"), in front of the stand-in vLLM server.
    with front(tmp_path, versions=1) as vllm:
        assert httpx.get(f"{vllm.url}/no-such-route").json() == NOT_FOUND
        for method, path in NODE_PATHS:
            _assert_no_redirect(vllm.url, method, path, {})
    # Control: the paths without their slash are served (admin routes to the admin key only).
    with up.client("admin") as admin:
        assert admin.get("/admin/capture").status_code == 200
        assert admin.get("/v1/models").status_code == 200


# Malformed HTTP --------------------------------------------------------------------------------


def _malformed(path: bytes, key: str | None) -> dict[str, bytes]:
    auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key else b""
    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
    return {
        "NUL in a header": head + b"X-Note: a\x00b\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        "negative Content-Length": head + b"Content-Length: -1\r\nConnection: close\r\n\r\n{}",
        "Content-Length of 2**64": head + b"Content-Length: 18446744073709551616\r\nConnection: close\r\n\r\n{}",
        "Content-Length with chunked": head + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n"
                                              b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "bad chunk size": head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "not HTTP": b"HELLO THERE\r\n\r\n",
    }


def _assert_envelope_400(answer: bytes, case: str) -> None:
    status, headers, body = _parse(answer)
    assert status == 400, (case, answer[:300])
    assert headers.get("content-type") == "application/json", (case, answer[:300])
    assert headers.get("connection") == "close", (case, answer[:300])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, (case, error)
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_request", (case, error)
    assert error["message"].startswith("malformed HTTP request"), (case, error)


def test_malformed_requests_get_the_error_envelope(up: Up) -> None:
    targets = [(up.gateway, b"/v1/chat/completions", up.keys["acme"]), (up.gateway, b"/v1/feedback", None),
               (up.gateway, b"/admin/pins/acme", up.keys["admin"]), (up.node, b"/v1/chat/completions", None),
               (up.node, b"/admin/update_weights", None)]
    for base, path, key in targets:
        for case, request in _malformed(path, key).items():
            _assert_envelope_400(_raw(base, request), f"{base}{path.decode()}: {case}")
    with up.client("acme") as acme:  # still serving
        assert acme.get("/v1/models").status_code == 200


class _Engine:
    """What the node app reads of its engine on the routes tried here (none generates)."""

    max_context = None

    def current(self) -> tuple[int, str]:
        return 0, "0" * 64

    def versions(self) -> list[int]:
        return [0]


def _served(app: Any, parser: str) -> contextlib.AbstractContextManager[str]:
    return served_app(app, "/v1/models", parser=parser)


def test_malformed_requests_get_the_error_envelope_on_h11_too(tmp_path: Path) -> None:
    """uvicorn's fallback parser: the same envelope where it refuses a request. A 2**64
    Content-Length and Content-Length with chunked are no parser errors there (serving/server.py):
    the route answers them, in the envelope too, and nothing is plain text."""
    from serving.node.app import create_app

    app = create_app(_Engine(), None, load_settings(data_dir=str(tmp_path)))  # type: ignore[arg-type]
    with _served(app, "h11") as url:
        for case, request in _malformed(b"/v1/chat/completions", None).items():
            answer = _raw(url, request)
            if case in ("Content-Length of 2**64", "Content-Length with chunked"):
                status, headers, body = _parse(answer)
                expected = 413 if "2**64" in case else 400  # too large for the route; a chunked "{}" lacks messages
                assert (status, headers.get("content-type")) == (expected, "application/json"), answer
                assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, answer
            else:
                _assert_envelope_400(answer, f"h11: {case}")
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200


def test_a_malformed_request_never_breaks_into_a_response_being_written() -> None:
    """A malformed request pipelined behind one whose (streamed) response is under way: a 400
    there would corrupt that response's framing, so the connection is closed with nothing more
    written (the exception serving/server.py documents)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    @app.get("/slow")
    async def slow() -> StreamingResponse:
        async def body() -> Any:
            yield b"first;"
            await asyncio.sleep(1.0)
            yield b"second;"

        return StreamingResponse(body(), media_type="text/plain")

    with _served(app, "auto") as url:
        parts = httpx.URL(url)
        with socket.create_connection((parts.host, parts.port), timeout=10) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while b"first;" not in received:
                received += sock.recv(65536)
            sock.sendall(b"HELLO THERE\r\n\r\n")
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1 ") == 1, received
    assert b"malformed" not in received and b"Invalid HTTP" not in received, received


# /v1/models and the rate limit -----------------------------------------------------------------


def test_models_spends_the_callers_rate_limit(up: Up) -> None:
    with up.client("limited") as limited, up.client("acme") as other:
        assert [limited.get("/v1/models").status_code for _ in range(2)] == [200, 200]  # 12 rpm: 2 at once
        refused = limited.get("/v1/models")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert 1 <= int(refused.headers["Retry-After"]) <= 5
        # The same budget as completions and feedback; another key of the tenant has its own.
        chat = limited.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "sort 3 1 2"}]})
        assert chat.status_code == 429, chat.text
        assert all(other.get("/v1/models").status_code == 200 for _ in range(5))


# Private files ---------------------------------------------------------------------------------


def test_everything_under_the_data_dir_is_private_to_its_owner(up: Up) -> None:
    data = up.settings.data_path
    with up.client("acme") as acme:
        # A session of the training slice: one in the held-out slice (5% of ids) is never trained on.
        session = next(s for s in (f"private-{uuid.uuid4().hex}" for _ in range(1000)) if held_out_point("acme", s) > 0.5)
        answer = acme.post("/v1/chat/completions", headers={"X-Flywheel-Session": session},
                           json={"messages": [{"role": "user", "content": "sort 3 1 2"}]})
        assert answer.status_code == 200, answer.text
        feedback = acme.post("/v1/feedback", json={"feedback_id": f"fb-{uuid.uuid4().hex}", "kind": "explicit",
                                                   "signal": "thumbs", "value": 1,
                                                   "generation_id": answer.headers["X-Flywheel-Generation"]})
        assert feedback.status_code == 202, feedback.text

    def published() -> bool:  # ingest, rewards and the trainer did their part: a version and its checkpoint
        assert up.process.poll() is None, up.tail()
        return (any(p.is_file() for p in (data / "trainer").rglob("*"))
                and len(list((data / "weights").rglob("v*"))) >= 2)

    wait_until("the trainer to publish and checkpoint a version", published, timeout_s=180, every_s=0.5)
    time.sleep(1.0)  # the node fetches the version meanwhile; the processes keep running below
    # Every kind of file the stack keeps is there (so the modes below are about them).
    names = {p.relative_to(data).parts[0] for p in data.iterdir()}
    assert {"flywheel.db", "flywheel.db-wal", "flywheel.db-shm", "spool", "bus", "weights", "trainer", "health",
            "logs", "effective-settings.json"} <= names, names
    assert list((data / "spool").rglob("*.seg")) and list((data / "bus" / "topics").rglob("*.log"))

    loose = []
    for path in [data, *data.rglob("*")]:
        try:
            info = path.lstat()
        except FileNotFoundError:  # a temp file renamed meanwhile
            continue
        want = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600
        if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
            if stat.S_IMODE(info.st_mode) != want:
                loose.append(f"{stat.S_IMODE(info.st_mode):04o} {path.relative_to(data.parent)}")
    assert not loose, "readable by others:\n" + "\n".join(loose)
