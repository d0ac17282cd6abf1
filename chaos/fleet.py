"""One scenario's fleet: every role a supervised ``flywheel`` process, and a watcher of the nodes.

The gateway, two nodes (``node-a`` in region ``eu``, ``node-b`` in ``us``, each reached through a
fault-injecting :class:`~chaos.proxy.UpstreamProxy` named as its ``node.url``), two ingest and two
rewards workers, the trainer and the rollout controller: each ``python -m launch.cli --config FILE
ROLE`` with its own settings file and log. The supervisor restarts a process that exits on its own
with backoff and counts it as a crash, as ``flywheel up`` does; a fault that stops a process on
purpose says so first (``wanted``), and its exit is recorded as what it was. :class:`ApiKeys` are
the scenario's API keys (the gateway runs with ``auth = "on"``); :meth:`Fleet.capture` reads the
gateway's capture depth with the admin key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from chaos.proxy import UpstreamProxy
from flywheel.settings import Settings, deep_merge
from testbed.procs import free_port, tail, wait_for

log = logging.getLogger("flywheel.chaos")

NODES = {"node-a": "eu", "node-b": "us"}
WORKERS = ("ingest-1", "ingest-2", "rewards-1", "rewards-2", "trainer", "rollout")
#: Settings of every scenario's fleet, on top of the caller's (schedules in seconds, not hours).
CHAOS_OVERRIDES: dict[str, Any] = {
    "log_level": "INFO",
    "bus": {"kind": "kafka", "partitions": 4, "session_timeout_ms": 6000, "heartbeat_interval_ms": 500,
            "max_poll_interval_ms": 20000},
    "db": {"wait_s": 120.0},
    "live": {"kind": "redis"},
    "store": {"kind": "folder", "cache_path": ""},
    # reject: a full or unwritable spool answers 503 before the upstream is called; with "drop" the
    # gateway serves and counts the lost event, which breaks `captured` by design.
    # auth on: users send tenant keys, the harness reads the capture depth with an admin key.
    "gateway": {"host": "127.0.0.1", "upstream": "", "auth": "on", "spool_full": "reject", "ship_timeout_s": 2.0,
                "drain_timeout_s": 10.0, "upstream_timeout_s": 5.0},
    "node": {"host": "127.0.0.1", "poll_s": 0.5, "max_new_tokens": 16, "keep_versions": 4},
    "ingest": {"inactivity_timeout_s": 3.0, "orphan_timeout_s": 30.0},
    "rollout": {"interval_s": 2.0, "canary_fraction": 0.0},
    "trainer": {"batch_size": 8, "steps_per_version": 1, "max_staleness": 8, "lr": 2e-5},
}


@dataclass
class Exit:
    name: str
    t: float
    rc: int | None
    how: str  # "crash" (on its own), "kill" (SIGKILL), "term" (SIGTERM), "stop" (end of scenario)


@dataclass(frozen=True)
class ApiKeys:
    """The keys of a scenario with ``gateway.auth = "on"``: one admin key, tenant keys for the users."""

    admin: str
    tenants: tuple[tuple[str, str], ...]  # (tenant, key), one per user

    @classmethod
    def create(cls, settings: Settings, users: int, tenants: tuple[str, ...] = ("acme", "globex")) -> ApiKeys:
        """Store the keys in ``settings``' database (``flywheel.keys.create_key``, as ``flywheel keys
        create`` does): an admin key, and one key per user, the users spread over ``tenants``."""
        from flywheel.db.session import make_engine, make_session_factory
        from flywheel.keys import create_key

        engine = make_engine(settings.database_url)
        try:
            sessions = make_session_factory(engine)
            _, admin = create_key(sessions, "chaos-ops", name="chaos harness", role="admin")
            keys = []
            for i in range(users):
                tenant = tenants[i % len(tenants)]
                keys.append((tenant, create_key(sessions, tenant, name=f"chaos user {i}")[1]))
            return cls(admin, tuple(keys))
        finally:
            engine.dispose()


class RoleProcess:
    """``python -m launch.cli --config FILE ROLE`` with its log; ``wanted`` says whether the
    supervisor should keep it running."""

    def __init__(self, name: str, role: str, config: Path, log_dir: Path) -> None:
        self.name, self.role, self.config = name, role, config
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.wanted = False
        self.lock = threading.Lock()
        self.crashes = 0
        self.next_start = 0.0

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path, "ab") as out:
            out.write(f"=== chaos: starting {self.name} at {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.process = subprocess.Popen([sys.executable, "-m", "launch.cli", "--config", str(self.config), self.role],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        self.wanted = True

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.process is not None
            self.process.send_signal(sig)

    def kill(self) -> int | None:
        self.wanted = False
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(30)

    def term(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait; None if it had to be killed after ``timeout_s``."""
        self.wanted = False
        if self.process is None:
            return None
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
            return None


class Fleet:
    """Every role process of one scenario, their settings files and their supervisor."""

    def __init__(self, base: Settings, run_dir: Path, proxies: dict[str, UpstreamProxy],
                 keys: ApiKeys | None = None) -> None:
        self.base = base
        self.keys = keys
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proxies = proxies
        self.node_ports = {name: free_port() for name in NODES}
        self.procs: dict[str, RoleProcess] = {}
        self.exits: list[Exit] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for name in ("gateway", *NODES, *WORKERS):
            settings = self._settings_for(name)
            config = run_dir / "config" / f"{name}.json"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(settings.model_dump(mode="json"), indent=2))
            self.procs[name] = RoleProcess(name, name.split("-")[0] if name not in NODES else "node", config, self.log_dir)

    def _settings_for(self, name: str) -> Settings:
        values = self.base.model_dump()
        if name in NODES:
            values = deep_merge(values, {"node": {"node_id": name, "region": NODES[name], "port": self.node_ports[name],
                                                   "url": self.proxies[name].url}})
        return Settings.model_validate(values)

    @property
    def gateway_url(self) -> str:
        g = self.base.gateway
        return f"http://{g.host}:{g.port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys.admin}"} if self.keys is not None else {}

    def capture(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The gateway's capture depth (``/admin/capture``: an admin key with auth on, loopback without)."""
        r = httpx.get(f"{self.gateway_url}/admin/capture", headers=self.admin_headers, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def node_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.node_ports[name]}"

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self, timeout_s: float = 240.0) -> None:
        """Nodes and trainer first (the slowest to start), then the rest; returns once the nodes and
        the gateway answer /health and the trainer consumes."""
        for name in (*NODES, "trainer"):
            self.procs[name].start()
        for name in NODES:
            self.wait_healthy(name, timeout_s)
        for name in WORKERS:
            if name != "trainer":
                self.procs[name].start()
        self.procs["gateway"].start()
        self.wait_healthy("gateway", timeout_s)
        trainer = self.procs["trainer"]
        try:
            wait_for("the trainer to consume", lambda: "flywheel.trainer: training " in trainer.log_path.read_text(
                errors="replace"), timeout_s, 0.5)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\ntrainer log:\n{tail(trainer.log_path)}") from None
        self._thread = threading.Thread(target=self._supervise, name="chaos-supervisor", daemon=True)
        self._thread.start()

    def wait_healthy(self, name: str, timeout_s: float = 240.0) -> None:
        url = self.gateway_url if name == "gateway" else self.node_url(name)
        proc = self.procs[name]

        def healthy() -> bool:
            if not proc.alive and not proc.wanted:
                raise RuntimeError(f"{name} is not running")
            return httpx.get(f"{url}/health", timeout=2.0).status_code == 200

        try:
            wait_for(f"{name} to answer /health", healthy, timeout_s, every_s=0.3)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{name} log:\n{tail(proc.log_path)}") from None

    def _supervise(self) -> None:
        """Restart wanted processes that exited on their own (backoff 0.5 s doubling to 8 s)."""
        while not self._stop.wait(0.3):
            for proc in self.procs.values():
                with proc.lock:
                    if not proc.wanted or proc.alive or proc.process is None:
                        continue
                    now = time.monotonic()
                    if proc.next_start == 0.0:
                        proc.crashes += 1
                        self.exits.append(Exit(proc.name, self.now(), proc.process.returncode, "crash"))
                        log.warning("chaos: %s exited on its own (%s); restarting", proc.name, proc.process.returncode)
                        proc.next_start = now + min(8.0, 0.5 * 2 ** min(proc.crashes - 1, 4))
                    if now >= proc.next_start:
                        proc.next_start = 0.0
                        proc.start()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        with proc.lock:
            rc = proc.kill()
            self.exits.append(Exit(name, self.now(), rc, "kill"))

    def term(self, name: str, timeout_s: float = 60.0) -> int | None:
        proc = self.procs[name]
        with proc.lock:
            proc.wanted = False
        rc = proc.term(timeout_s)
        self.exits.append(Exit(name, self.now(), rc, "term"))
        return rc

    def restart(self, name: str) -> None:
        proc = self.procs[name]
        with proc.lock:
            if not proc.alive:
                proc.start()
            proc.wanted = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        order = ["gateway", *WORKERS, *NODES]
        for name in order:
            self.procs[name].wanted = False
            self.procs[name].signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for name in order:
            proc = self.procs[name]
            if proc.process is None:
                continue
            try:
                proc.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait(30)

    def crashes(self) -> dict[str, int]:
        return {name: p.crashes for name, p in self.procs.items() if p.crashes}


class NodeWatcher:
    """Polls every node's ``/health`` (directly, not through its proxy): the (version, sha256) pairs
    each went live with, and every ``failed_update`` it reported."""

    def __init__(self, fleet: Fleet, every_s: float = 0.25) -> None:
        self.fleet, self.every_s = fleet, every_s
        self.live: dict[str, dict[int, set[str]]] = {name: defaultdict(set) for name in NODES}
        self.failed: dict[str, list[tuple[float, int | None, str]]] = {name: [] for name in NODES}
        self.last: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-node-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def poll(self, client: httpx.Client) -> None:
        for name in NODES:
            try:
                health = client.get(f"{self.fleet.node_url(name)}/health").json()
            except (httpx.HTTPError, ValueError):
                continue
            self.last[name] = health
            if health.get("version") is not None:
                self.live[name][int(health["version"])].add(str(health.get("sha256")))
            if health.get("update_status") == "failed_update":
                detail = str(health.get("update_detail", ""))
                if not self.failed[name] or self.failed[name][-1][2] != detail:
                    self.failed[name].append((self.fleet.now(), health.get("version"), detail))

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.every_s):
                self.poll(client)


#: A node's log line once it loaded a version: its live version, the one loaded, its sha256 prefix.
LOADED = re.compile(r"engine holds versions .*?, live (\S+) \(loaded (\d+), ([0-9a-f]+)\)")


def node_logs(fleet: Fleet) -> tuple[dict[str, dict[int, set[str]]], dict[str, set[int]]]:
    """From each node's log: the versions it loaded (with the sha256 prefix it logged) and those it
    served live."""
    loaded: dict[str, dict[int, set[str]]] = {}
    live: dict[str, set[int]] = {}
    for name in NODES:
        text = fleet.procs[name].log_path.read_text(errors="replace")
        loaded[name] = defaultdict(set)
        live[name] = set()
        for m in LOADED.finditer(text):
            loaded[name][int(m.group(2))].add(m.group(3))
            if m.group(1) != "None":
                live[name].add(int(m.group(1)))
        for m in re.finditer(r"engine now serves version (\d+) \(already held\)", text):
            live[name].add(int(m.group(1)))
        for m in re.finditer(rf"node {re.escape(name)} serving \S+ v(\d+) on", text):
            loaded[name][int(m.group(1))].add("")
            live[name].add(int(m.group(1)))
    return loaded, live
