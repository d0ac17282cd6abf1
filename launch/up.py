"""``flywheel up``: run every role as its own process on this machine, and supervise them.

Each role runs exactly as ``flywheel <role>`` would, in a child process that reads the same
effective settings (written once to ``{data_dir}/effective-settings.json``), so what runs under
``up`` is what runs alone in production. Before any child starts, ``up`` waits for the database,
upgrades it, builds the default model and registers it as version 0, so children never race to
do any of that.

A child that exits on its own is restarted with backoff (and counted); SIGTERM/SIGINT stops all
children gracefully (SIGTERM, then SIGKILL after a grace period).

Invariants:
- ``flywheel is up`` is printed only once a chat completion can be served: the node answers one
  itself (a one-token probe sent to the node, so nothing is captured) and the gateway answers
  ``/health``; the line names the gateway's API and the console.
- A stop (SIGTERM/SIGINT) is acted on at once at every stage: while preparing (the database wait,
  the model build are abandoned: :func:`interrupting`), while the children start (the readiness
  wait returns) and while they run.
- No child outlives ``up``, however it ends, ``kill -9`` included: each is started with
  ``--parent-pid`` and has the kernel kill it when the thread that started it exits
  (``launch.cli.die_with_parent``; the thread that spawns children must therefore live as long
  as the stack, the main thread here). Children run in their own session, so a terminal's Ctrl-C
  reaches ``up`` alone, and ``up`` stops them in order.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from flywheel.settings import Settings

log = logging.getLogger("flywheel.up")

#: The chat completion that proves a node serves (:meth:`Stack.wait_ready`): one token.
READY_PROBE = {"messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}

ALL_ROLES = ("node", "gateway", "ingest", "rewards", "trainer", "rollout", "janitor")


#: The model a role loads when ``model.path`` is empty: "module:function" taking ``(cache_dir,
#: quick=False)`` and returning the model directory, built there on first use. The demo's tiny
#: model, reached by name: the composition roots choose it, the stages only read ``model.path``.
DEFAULT_MODEL = "demo.tinymodel.build:ensure_default_model"


def default_model(cache_dir: Path, quick: bool = False) -> Path:
    """The default model's directory under ``cache_dir`` (:data:`DEFAULT_MODEL`), built if needed."""
    module, _, func = DEFAULT_MODEL.partition(":")
    return Path(getattr(importlib.import_module(module), func)(cache_dir, quick=quick))


def with_model(settings: Settings) -> Settings:
    """``settings`` whose ``model.path`` names a model directory: its own, else the default model
    (built under ``{data_dir}/models`` on first use)."""
    if settings.model.path:
        return settings
    path = default_model(settings.data_path / "models")
    return settings.model_copy(update={"model": settings.model.model_copy(update={"path": str(path)})})


def prepare(settings: Settings) -> Settings:
    """Upgrade the database and build the default model; return settings that name the model dir."""
    from flywheel.db.session import upgrade, wait_for_db
    from flywheel.private import make_private

    make_private(settings.data_path, create=True)
    wait_for_db(settings.database_url, settings.db.wait_s)
    upgrade(settings.database_url)
    settings = with_model(settings)
    register_base(settings)
    return settings


def register_base(settings: Settings) -> None:
    """Register the base model as stable version 0 of its line when the registry is empty (an
    adapter line's version 0 is the zero adapter, which the LoRA node or the trainer registers)."""
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.lm import export_state, load_model
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    if settings.trainer.lora_publish == "adapter":
        return
    registry = Registry(make_session_factory(make_engine(settings.database_url)), make_store(settings), settings.model.line)
    if registry.latest() is None:
        info = registry.ensure_base(export_state(load_model(settings.model.path)[0]), reason=f"base model {settings.model.path}")
        log.info("registered the base model as %s v%d", settings.model.line, info.version)


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived inside :func:`interrupting` (a BaseException, as KeyboardInterrupt,
    so no ``except Exception`` on the way swallows it)."""


@contextmanager
def interrupting(stop: threading.Event) -> Iterator[None]:
    """Inside, SIGTERM/SIGINT set ``stop`` and raise :class:`Interrupted` in the main thread, so a
    long step that never looks at ``stop`` (the database wait, the model build) is abandoned at
    once; the handlers from before are back on exit. Off the main thread it only checks ``stop``."""
    if stop.is_set():
        raise Interrupted("stop was already requested")
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        raise Interrupted(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass
class _Child:
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0


class Stack:
    """The set of role processes sharing one settings file."""

    def __init__(self, settings: Settings, roles: tuple[str, ...] = ALL_ROLES, grace_s: float = 20.0):
        self.settings = settings
        self.roles = roles
        self.grace_s = grace_s
        self.children: dict[str, _Child] = {}
        self.config_path = settings.data_path / "effective-settings.json"
        self.log_dir = settings.data_path / "logs"

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.settings.model_dump(mode="json"), indent=2))
        for role in self.roles:
            self.children[role] = self._spawn(role)

    def _spawn(self, role: str, restarts: int = 0) -> _Child:
        log_path = self.log_dir / f"{role}.log"
        cmd = [sys.executable, "-m", "launch.cli", "--config", str(self.config_path),
               "--parent-pid", str(os.getpid()), role]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.info("started %s (pid %d), log %s", role, proc.pid, log_path)
        return _Child(role, proc, log_path, restarts=restarts)

    def wait_ready(self, timeout_s: float = 300.0, stop: threading.Event | None = None) -> bool:
        """Block until a chat completion can be served: the node answers ``/health`` (it listens
        and holds a version) and a one-token chat completion sent to it (never captured: the
        gateway is not on its path), then the gateway answers ``/health``. False as soon as
        ``stop`` is set; raises with the failing log's tail when a child exits or ``timeout_s``
        passes. (A LoRA-mode vLLM node process serves nothing itself: vLLM does.)"""
        checks = []
        node = self.settings.node
        if "node" in self.roles and not (node.engine == "vllm" and node.vllm_mode == "lora"):
            base = f"http://{node.host}:{node.port}"
            checks += [("node", "GET", f"{base}/health", None),
                       ("node", "POST", f"{base}/v1/chat/completions", READY_PROBE)]
        if "gateway" in self.roles:
            checks.append(("gateway", "GET", f"http://{self.settings.gateway.host}:{self.settings.gateway.port}/health",
                           None))
        stop = stop or threading.Event()
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            for role, method, url, body in checks:
                last = "no answer yet"
                while True:
                    if stop.is_set():
                        return False
                    child = self.children[role]
                    if child.proc.poll() is not None:
                        raise RuntimeError(f"{role} exited with {child.proc.returncode} while starting:\n{self.tail(role)}")
                    try:
                        answer = client.request(method, url, json=body, timeout=2.0 if body is None else 30.0)
                        if answer.status_code == 200:
                            break
                        last = f"HTTP {answer.status_code}: {answer.text[:300]}"
                    except httpx.HTTPError as exc:
                        last = f"{type(exc).__name__}: {exc}"
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{role} not ready after {timeout_s:.0f}s ({method} {url}: {last}):\n"
                                           f"{self.tail(role)}")
                    stop.wait(0.3)
        return True

    def supervise_once(self) -> list[str]:
        """Restart children that exited on their own; returns the roles restarted."""
        restarted = []
        for role, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            backoff = min(30.0, 2.0 ** min(child.restarts, 5))
            if time.monotonic() - child.started < backoff:
                continue
            log.error("%s exited with %s; restarting (restart #%d). Tail:\n%s", role, code, child.restarts + 1, self.tail(role))
            self.children[role] = self._spawn(role, restarts=child.restarts + 1)
            restarted.append(role)
        return restarted

    def stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + self.grace_s
        for child in self.children.values():
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing", child.role, self.grace_s)
                child.proc.kill()
                child.proc.wait()

    def tail(self, role: str, lines: int = 30) -> str:
        path = self.log_dir / f"{role}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def up(settings: Settings, stop: threading.Event) -> int:
    """Prepare, start every role, say so once a chat completion can be served, supervise until
    ``stop``; then stop every child. A stop before the stack is up ends it there (status 0)."""
    # ``stop`` is what decides; Interrupted only cuts a long step short (an exception raised by a
    # signal handler can be swallowed, e.g. inside an import lock's callback, but ``stop`` stays set).
    try:
        with interrupting(stop):
            settings = prepare(settings)
    except Interrupted as exc:
        log.warning("stopped (%s) while preparing; no role was started", exc)
        return 0
    if stop.is_set():
        log.warning("stopped while preparing; no role was started")
        return 0
    stack = Stack(settings)
    try:
        stack.start()
        try:
            with interrupting(stop):  # a probe that waits on a slow child is abandoned too
                ready = stack.wait_ready(stop=stop)
        except Interrupted as exc:
            log.warning("stopped (%s) while the roles were starting; stopping them", exc)
            return 0
        if not ready or stop.is_set():
            log.warning("stopped while the roles were starting; stopping them")
            return 0
        gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
        auth = "off (embedded defaults: no API key needed)" if settings.gateway.auth == "off" else "on"
        print(
            f"flywheel is up: gateway {gateway}/v1 (auth {auth}); console {gateway}/console; logs in {stack.log_dir}",
            flush=True,
        )
        while not stop.wait(1.0):
            stack.supervise_once()
    finally:
        stack.stop()
    return 0
