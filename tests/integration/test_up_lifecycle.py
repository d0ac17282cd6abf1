"""``flywheel up`` as a real process: readiness, stops during start-up, and no orphans.

Each test starts ``python -m launch.cli --config FILE up`` on embedded defaults (local log bus,
SQLite, memory live state) in a temporary data dir on free ports, with the quick tiny model (or, for
the build test, none: ``up`` starts building the default model). Its children are found in
``/proc`` by their command line, which names the stack's settings file.

- Readiness: while the node cannot listen yet (held with SIGSTOP, so the window is certain) the
  gateway answers a chat completion with 503 ``fleet_starting`` and ``Retry-After``; nothing is
  ever a 502; ``flywheel is up`` (naming the console) is printed only once a chat completion is
  served, and one is. Then SIGKILL to ``up``: every child is gone within seconds (parent-death
  signal), kill -9 included.
- SIGTERM while the roles start (before ready) and while the model is being built: ``up`` exits
  promptly, status 0, leaving no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from launch.up import ALL_ROLES
from testbed.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                          reason="reads /proc")]

REPO = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "sort: c a b"}], "max_tokens": 4}


class Up:
    """A running ``flywheel up`` and what it printed."""

    def __init__(self, root: Path, model_path: str) -> None:
        self.data = root / "data"
        self.gateway = f"http://127.0.0.1:{free_port()}"
        config = {"data_dir": str(self.data), "model": {"path": model_path},
                  "gateway": {"port": int(self.gateway.rsplit(":", 1)[1])}, "node": {"port": free_port()}}
        self.config = root / "settings.json"
        self.config.write_text(json.dumps(config))
        #: Every child names this file (launch/up.py writes it before it starts them).
        self.stack_config = str(self.data / "effective-settings.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        env.update(PYTHONPATH=str(REPO), FLYWHEEL_LOG_LEVEL="INFO")
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "--config", str(self.config), "up"],
                                     cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def is_up(self) -> str | None:
        return next((line for line in self.lines if "flywheel is up" in line), None)

    def children(self) -> dict[int, str]:
        """pid -> role of every live process started for this stack (zombies have no command line)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:  # gone meanwhile
                continue
            if self.stack_config in argv:
                found[int(entry.name)] = argv[-2] if argv[-1] == "" else argv[-1]
        return found

    def running(self, what: str) -> None:
        assert self.proc.poll() is None, \
            f"flywheel up exited with {self.proc.returncode} while waiting for {what}:\n{self.output()}"

    def wait_for(self, what: str, check, timeout_s: float, every_s: float = 0.02, *, while_running: bool = True):
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if while_running:
                self.running(what)
            assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}:\n{self.output()}"
            time.sleep(every_s)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in self.children():  # a failed test must not leave its stack running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _gone(pids: set[int], up: Up) -> bool:
    return not (pids & set(up.children()))


def test_ready_only_when_a_chat_completion_is_served_and_kill9_leaves_no_child(tmp_path, tiny_model_dir):
    up = Up(tmp_path, str(tiny_model_dir))
    try:
        node = up.wait_for("the node process", lambda: next((p for p, r in up.children().items() if r == "node"), None),
                           120)
        os.kill(node, signal.SIGSTOP)  # still importing: its port cannot be listening yet
        try:
            with httpx.Client(base_url=up.gateway, timeout=30) as client:
                up.wait_for("the gateway", lambda: _answers(client, "/health"), 120, every_s=0.2)
                for stream in (False, True):
                    starting = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
                    assert starting.status_code == 503, starting.text
                    assert starting.headers["Retry-After"] == "2"
                    error = starting.json()["error"]
                    assert error["code"] == "fleet_starting" and error["type"] == "service_unavailable_error"
                    assert "the fleet is starting" in error["message"]
                assert not up.is_up()
                os.kill(node, signal.SIGCONT)
                statuses = set()
                while not up.is_up():
                    up.running("flywheel is up")
                    answer = client.post("/v1/chat/completions", json=CHAT)
                    statuses.add((answer.status_code, answer.json().get("error", {}).get("code")))
                    assert statuses <= {(503, "fleet_starting"), (200, None)}, statuses
                    time.sleep(0.2)
                line = up.is_up()
                assert f"gateway {up.gateway}/v1" in line and f"console {up.gateway}/console" in line
                served = client.post("/v1/chat/completions", json=CHAT)
                assert served.status_code == 200, served.text
                assert served.json()["choices"][0]["message"]["role"] == "assistant"
        finally:
            os.kill(node, signal.SIGCONT)

        pids = set(up.children())
        assert set(up.children().values()) == set(ALL_ROLES), up.children()
        up.proc.kill()
        up.proc.wait(10)
        up.wait_for("every child to die with up", lambda: _gone(pids, up), 10, while_running=False)
    finally:
        up.cleanup()


def test_sigterm_while_the_roles_start_stops_them_all(tmp_path, tiny_model_dir):
    up = Up(tmp_path, str(tiny_model_dir))
    try:
        up.wait_for("every role's process", lambda: set(up.children().values()) == set(ALL_ROLES), 120)
        pids = set(up.children())
        sent = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0, up.output()
        took = time.monotonic() - sent
        assert _gone(pids, up), up.children()
        assert not up.is_up(), up.output()
        assert took < 25, f"flywheel up took {took:.1f}s to stop:\n{up.output()}"
    finally:
        up.cleanup()


def test_sigterm_while_the_model_is_built_exits_at_once(tmp_path):
    up = Up(tmp_path, "")  # no model: up builds the default one under data/models first
    try:
        models = up.data / "models"
        up.wait_for("the model build", lambda: models.is_dir() and any(models.glob(".*-*")), 120, every_s=0.05)
        time.sleep(0.5)  # well inside the build (it takes minutes)
        sent = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(15) == 0, up.output()
        assert time.monotonic() - sent < 10, up.output()
        assert "no role was started" in up.output()
        assert not (up.data / "logs").exists() and not up.children()
        assert not any(models.glob(".*-*")), "the half-built model was left behind"
    finally:
        up.cleanup()


def _answers(client: httpx.Client, path: str) -> bool:
    try:
        return client.get(path).status_code == 200
    except httpx.HTTPError:
        return False
