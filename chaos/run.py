"""Running scenarios: :class:`ChaosRun` (the run's services), one fresh fleet per scenario, ``run_chaos``.

A scenario: start the fleet -> traffic for ``seconds`` while its faults are injected -> heal ->
settle -> stop the rollout controller and let the nodes converge -> ``flywheel rewards rescore`` ->
snapshot -> :func:`chaos.invariants.check`; a harness failure is reported, never raised, and the
next scenario runs.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from chaos.collect import collect, converge_nodes, registry_for, reread, rescore, settle
from chaos.diagnose import diagnose, probe_groups
from chaos.faults import Chaos
from chaos.fleet import CHAOS_OVERRIDES, NODES, ApiKeys, Fleet, NodeWatcher
from chaos.invariants import InvariantResult, Snapshot, check, dead_letter_reasons, lost_items
from chaos.proxy import UpstreamFaults, UpstreamProxy
from chaos.report import ScenarioResult, format_details, format_table
from chaos.scenarios import QUICK, SCENARIOS, Scenario
from chaos.services import Services
from chaos.users import Users
from flywheel.settings import Settings, deep_merge
from testbed.disks import SmallDisk
from testbed.procs import ServiceUnavailable, free_port

log = logging.getLogger("flywheel.chaos")

#: How long the system has to catch up once the faults are healed (``recovered``).
SETTLE_S = 150.0


@dataclass(frozen=True)
class ChaosOptions:
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    seconds: float = 30.0
    users: int = 6
    seed: int = 0
    json_path: str | None = None
    keep: bool = False

    @classmethod
    def from_args(cls, args: Any) -> ChaosOptions:
        names: list[str] = []
        for item in args.scenario or []:
            names += [n.strip() for n in item.split(",") if n.strip()]
        if args.quick:
            names = names or list(QUICK)
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
        seconds = args.seconds if args.seconds is not None else (20.0 if args.quick else 30.0)
        return cls(tuple(names) or tuple(SCENARIOS), seconds, args.users, args.seed, args.json_path, args.keep)


@dataclass
class Outcome:
    """A finished scenario whose database is still up (:class:`ChaosRun` keeps it for re-checks)."""

    result: ScenarioResult
    snapshot: Snapshot | None
    database_url: str


class ChaosRun:
    """The run's services and model; :meth:`scenario` runs one scenario on a fresh fleet."""

    def __init__(self, settings: Settings, root: Path, model_path: Path | None = None, keep: bool = False) -> None:
        self.settings, self.root, self.keep = settings, root, keep
        self.model_path = model_path
        self.services = Services(root / "services")
        self.index = 0

    def __enter__(self) -> ChaosRun:
        if self.model_path is None:
            from launch.up import with_model

            self.model_path = Path(with_model(self.settings).model.path)
        try:
            self.services.start()
        except BaseException:
            self.services.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.services.close(self.keep)

    def base_settings(self, name: str, run_dir: Path, store_dir: Path | None, spool_dir: Path | None,
                      overrides: dict[str, Any] | None = None) -> Settings:
        self.index += 1
        token = uuid.uuid4().hex[:8]
        database = f"chaos_{self.index}_{name}_{token}"[:60]
        db_url = self.services.postgres.create_database(database)
        merged = deep_merge(deep_merge(self.settings.model_dump(), CHAOS_OVERRIDES), overrides or {})
        merged = deep_merge(merged, {
            "data_dir": str(run_dir),
            "bus": {"bootstrap_servers": self.services.broker.bootstrap, "topic_prefix": f"chaos{self.index}-{token}."},
            "db": {"url": db_url},
            "live": {"redis_url": self.services.redis_url, "key_prefix": f"chaos:{token}:"},
            "store": {"path": str(store_dir or run_dir / "weights")},
            "model": {"path": str(self.model_path)},
            "gateway": {"port": free_port(), "spool_dir": str(spool_dir) if spool_dir else ""},
        })
        return Settings.model_validate(merged)

    def scenario(self, name: str, seconds: float, users: int = 6, seed: int = 0) -> Outcome:
        """Run one scenario (module docstring) and check it; never raises for what it finds."""
        spec = SCENARIOS[name]
        seconds = max(seconds, spec.min_seconds)
        started = time.monotonic()
        result = ScenarioResult(name, [], spec.summary)
        run_dir = self.root / f"{self.index + 1:02d}-{name}"
        disks: dict[str, SmallDisk] = {}
        proxies: dict[str, UpstreamProxy] = {}
        fleet: Fleet | None = None
        snapshot: Snapshot | None = None
        base: Settings | None = None
        database_url = ""
        try:
            for disk in spec.disks:
                disks[disk] = SmallDisk(run_dir / f"{disk}-disk", 64 if disk == "spool" else 96)
                disks[disk].mount()
            spool_dir = disks["spool"].path / "spool" if "spool" in disks else None
            store_dir = disks["store"].path / "weights" if "store" in disks else None
            base = self.base_settings(name, run_dir, store_dir, spool_dir, spec.settings)
            database_url = base.database_url
            from launch.up import prepare

            base = prepare(base)
            keys = ApiKeys.create(base, users) if base.gateway.auth == "on" else None
            proxies = {n: UpstreamProxy(n, seed + i) for i, n in enumerate(NODES)}
            fleet = Fleet(base, run_dir, proxies, keys)
            for n, proxy in proxies.items():
                proxy.start(fleet.node_url(n))
            print(f"  [{name}] starting the fleet ({len(fleet.procs)} processes) in {run_dir}", flush=True)
            fleet.start()
            snapshot = self._drive(spec, fleet, proxies, disks, result, seconds, users, seed)
        except Exception as exc:  # the harness failed: reported in the table, the next scenario runs
            log.exception("scenario %s failed", name)
            result.error = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            if fleet is not None:
                fleet.stop()
                result.figures["crashes"] = fleet.crashes()
                result.figures["exits"] = [asdict(e) for e in fleet.exits if e.how != "stop"]
            for proxy in proxies.values():
                proxy.close()
            for disk in disks.values():
                disk.free()
                disk.unmount()
        if snapshot is not None and base is not None:
            result.invariants = check(snapshot)
            result.events = len(snapshot.client.received) + len(snapshot.client.feedback)
            result.lost = sum(r.lost for r in result.invariants)
            result.duplicated = sum(r.duplicated for r in result.invariants)
            if snapshot.poison or snapshot.dead_letters:
                result.figures["dead_letters"] = dead_letter_reasons(snapshot)
            lost = lost_items(snapshot)
            if any(lost.values()):
                result.figures["lost_items"] = {k: v[:10] for k, v in lost.items() if v}
                try:
                    result.figures["diagnosis"] = diagnose(base.bus.bootstrap_servers, base, lost)
                except Exception as exc:  # the diagnosis is a courtesy; the verdict stands without it
                    result.figures["diagnosis"] = f"failed: {type(exc).__name__}: {exc}"
        result.wall_s = time.monotonic() - started
        return Outcome(result, snapshot, database_url)

    def _drive(self, spec: Scenario, fleet: Fleet, proxies: dict[str, UpstreamProxy],
               disks: dict[str, SmallDisk], result: ScenarioResult, seconds: float, n_users: int, seed: int) -> Snapshot:
        from flywheel.db.session import make_engine

        base = fleet.base
        watcher = NodeWatcher(fleet)
        watcher.start()
        users = Users(fleet.gateway_url, base.model.line, n_users, seed, max_tokens=base.node.max_new_tokens,
                      keys=tuple(key for _, key in fleet.keys.tenants) if fleet.keys is not None else ())
        chaos = Chaos(self.services, fleet, proxies, users, watcher, seconds, random.Random(seed), disks)
        if fleet.keys is not None:
            check_auth(chaos)
        print(f"  [{spec.name}] traffic for {seconds:g}s, {n_users} users; faults: {spec.summary}", flush=True)
        users.start()
        injector = threading.Thread(target=self._inject, args=(spec, chaos), name="chaos-injector", daemon=True)
        injector.start()
        time.sleep(seconds)
        users.stop()
        chaos.stop.set()
        injector.join(300)
        result.faults = chaos.faults
        # Heal whatever a fault may have left behind, then let the system settle.
        self.services.broker.thaw()
        for proxy in proxies.values():
            proxy.faults = UpstreamFaults()
        for disk in disks.values():
            disk.free()
        for name in fleet.procs:
            fleet.restart(name)
        engine = make_engine(base.database_url)
        try:
            print(f"  [{spec.name}] settling", flush=True)
            result.figures["settle"] = settle(fleet, users, engine, timeout_s=SETTLE_S)
            if not result.figures["settle"].get("settled"):
                try:
                    result.figures["groups"] = probe_groups(base.bus.bootstrap_servers, base)
                except Exception as exc:  # a courtesy for the post-mortem, like the diagnosis
                    result.figures["groups"] = f"failed: {type(exc).__name__}: {exc}"
            fleet.term("rollout", 30.0)
            registry = registry_for(base, engine)
            converge_nodes(fleet, watcher, registry)
            watcher.stop()
            rescore_spec, output = rescore(fleet, spec.name)
            result.figures["rescore"] = output.splitlines()[-1] if output else ""
            result.figures["client_errors"] = users.log.errors()
            result.figures["proxy"] = {n: dict(p.counts) for n, p in proxies.items()}
            return collect(fleet, users, watcher, engine, registry, rescore_spec, chaos.expectations,
                           result.figures["settle"], chaos.poison, chaos.subjects)
        finally:
            engine.dispose()

    @staticmethod
    def _inject(spec: Scenario, chaos: Chaos) -> None:
        try:
            spec.inject(chaos)
        except Exception as exc:  # a fault that could not be injected is a failed expectation
            log.exception("injecting %s", spec.name)
            chaos.expect(f"inject {spec.name}", False, f"{type(exc).__name__}: {exc}")


def check_auth(c: Chaos) -> None:
    """With ``gateway.auth = "on"``, before the traffic: a completion without a key is refused
    (401), a tenant key does not reach an admin route (403), the admin key does (200)."""
    assert c.fleet.keys is not None
    body = {"model": c.fleet.base.model.line, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    tenant = {"Authorization": f"Bearer {c.fleet.keys.tenants[0][1]}"}
    url = c.fleet.gateway_url
    try:
        got = (httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code,
               httpx.get(f"{url}/admin/capture", headers=tenant, timeout=10).status_code,
               httpx.get(f"{url}/admin/capture", headers=c.fleet.admin_headers, timeout=10).status_code)
    except httpx.HTTPError as exc:
        c.expect("auth on: keys are checked", False, f"{type(exc).__name__}: {exc}")
        return
    tenants = sorted({t for t, _ in c.fleet.keys.tenants})
    c.expect("auth on: keys are checked", got == (401, 403, 200),
             f"no key on a completion {got[0]}, a tenant key on /admin/capture {got[1]}, the admin key {got[2]} "
             f"(want 401, 403, 200); users on tenants {tenants}")


def recheck(outcome: Outcome) -> list[InvariantResult]:
    """Re-read the database of a finished scenario into its snapshot and check again (tests use it
    to show that a row they broke is caught)."""
    assert outcome.snapshot is not None
    reread(outcome.snapshot, outcome.database_url)
    return check(outcome.snapshot)


def run_chaos(settings: Settings, options: ChaosOptions) -> int:
    """``flywheel chaos``: run the chosen scenarios, print the table, write the JSON; exit 1 if any
    invariant failed."""
    root = settings.data_path / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # the readiness probes of a broker we stop on purpose
    print(f"flywheel chaos: {len(options.scenarios)} scenario(s), {options.seconds:g}s of traffic each; run dir {root}",
          flush=True)
    results: list[ScenarioResult] = []
    started = time.monotonic()
    try:
        with ChaosRun(settings, root, keep=options.keep) as run:
            for name in options.scenarios:
                print(f"\n== {name}: {SCENARIOS[name].summary}", flush=True)
                outcome = run.scenario(name, options.seconds, options.users, options.seed)
                results.append(outcome.result)
                r = outcome.result
                print(f"  [{name}] {'ok' if r.invariants_ok else 'FAILED ' + ', '.join(r.failed_invariants)} "
                      f"({r.events} events, lost {r.lost}, duplicated {r.duplicated}, {r.wall_s:.0f}s)", flush=True)
    except ServiceUnavailable as exc:
        print(f"flywheel chaos: {exc}", file=sys.stderr)
        return 2
    finally:
        if results and options.json_path:
            path = Path(options.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"scenarios": [r.to_json() for r in results],
                                        "seconds": options.seconds, "users": options.users, "seed": options.seed,
                                        "wall_s": round(time.monotonic() - started, 1)}, indent=2))
    print(format_details(results))
    print("\n" + format_table(results))
    if options.json_path:
        print(f"\nJSON written to {options.json_path}")
    if not options.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if results and all(r.invariants_ok for r in results) else 1


def main(args: Any, settings: Settings) -> int:
    """``flywheel chaos`` (named by the command line's table, launch/cli.py): ``--list`` the
    scenarios, or run the chosen ones; 2 for options that name no scenario."""
    if args.list:
        for scenario in SCENARIOS.values():
            print(f"{scenario.name:<18} {scenario.summary}")
        return 0
    try:
        options = ChaosOptions.from_args(args)
    except ValueError as exc:
        print(f"flywheel chaos: {exc}", file=sys.stderr)
        return 2
    return run_chaos(settings, options)
