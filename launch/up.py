"""``flywheel up``: run every role as its own process on this machine, and supervise them.

Each role runs exactly as ``flywheel <role>`` would, in a child process that reads the same
effective settings (written once to ``{data_dir}/effective-settings.json``), so what runs under
``up`` is what runs alone in production. Before any child starts, ``up`` waits for the database,
upgrades it, builds the default model and registers it as version 0, so children never race to
do any of that.

A child that exits on its own is restarted with backoff (and counted); SIGTERM/SIGINT stops all
children gracefully (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flywheel.settings import Settings

log = logging.getLogger("flywheel.up")

ALL_ROLES = ("node", "gateway", "ingest", "rewards", "trainer", "rollout")


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
        cmd = [sys.executable, "-m", "launch.cli", "--config", str(self.config_path), role]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.info("started %s (pid %d), log %s", role, proc.pid, log_path)
        return _Child(role, proc, log_path, restarts=restarts)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until the node and the gateway answer /health, or raise with the failing log's tail
        (a LoRA-mode vLLM node process serves nothing itself: vLLM does)."""
        urls = {}
        node = self.settings.node
        if "node" in self.roles and not (node.engine == "vllm" and node.vllm_mode == "lora"):
            urls["node"] = f"http://{self.settings.node.host}:{self.settings.node.port}/health"
        if "gateway" in self.roles:
            urls["gateway"] = f"http://{self.settings.gateway.host}:{self.settings.gateway.port}/health"
        deadline = time.monotonic() + timeout_s
        for role, url in urls.items():
            while True:
                child = self.children[role]
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{role} exited with {child.proc.returncode} while starting:\n{self.tail(role)}")
                try:
                    if httpx.get(url, timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{role} not healthy after {timeout_s:.0f}s:\n{self.tail(role)}")
                time.sleep(0.3)

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
    settings = prepare(settings)
    stack = Stack(settings)
    stack.start()
    try:
        stack.wait_ready()
        auth = "off (embedded defaults: no API key needed)" if settings.gateway.auth == "off" else "on"
        print(
            f"flywheel is up: gateway http://{settings.gateway.host}:{settings.gateway.port}/v1 "
            f"(auth {auth}); logs in {stack.log_dir}",
            flush=True,
        )
        while not stop.wait(1.0):
            stack.supervise_once()
    finally:
        stack.stop()
    return 0
