"""The faults, and the registry of scenarios that inject them.

A fault function gets a :class:`Chaos` (the services, the fleet, the proxies, the users, a seeded
random generator and the traffic window), injects its faults at moments in the window, writes what
it did with :meth:`Chaos.note` and what each fault must cause with :meth:`Chaos.expect` (checked as
``fault_checks``); a fault that writes poison onto the bus lists it in :attr:`Chaos.poison` (checked
as ``poison_dead_lettered``). It returns early once the scenario ends (:meth:`Chaos.at` is False).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from chaos.collect import registry_for
from chaos.fleet import LOADED, NODES, WORKERS, Fleet, NodeWatcher
from chaos.invariants import Expectation, PoisonRecord
from chaos.poison import API_POISON, IDENTICAL_REPLAY, RogueProducer, api_round
from chaos.proxy import UpstreamFaults, UpstreamProxy
from chaos.services import Services
from chaos.users import Users
from testbed.disks import SmallDisk
from testbed.procs import wait_for


class Chaos:
    """What a fault injector works with: the services, the fleet, the proxies, the users, a seeded
    random generator, the traffic window, and where it writes what it did and what must hold."""

    def __init__(self, services: Services, fleet: Fleet, proxies: dict[str, UpstreamProxy], users: Users,
                 watcher: NodeWatcher, seconds: float, rng: random.Random, disks: dict[str, SmallDisk]) -> None:
        self.services, self.fleet, self.proxies = services, fleet, proxies
        self.users, self.watcher = users, watcher
        self.seconds, self.rng, self.disks = seconds, rng, disks
        self.faults: list[str] = []
        self.expectations: list[Expectation] = []
        self.poison: list[PoisonRecord] = []  # what a rogue producer wrote and the broker acknowledged
        self.t0 = time.monotonic()
        self.stop = threading.Event()

    def at(self, fraction: float) -> bool:
        """Sleep until ``fraction`` of the traffic window; False if the scenario is ending."""
        return not self.stop.wait(max(0.0, self.t0 + fraction * self.seconds - time.monotonic()))

    def sleep(self, seconds: float) -> bool:
        return not self.stop.wait(seconds)

    def note(self, what: str) -> None:
        line = f"t={time.monotonic() - self.t0:5.1f}s {what}"
        self.faults.append(line)
        print(f"    {line}", flush=True)

    def expect(self, name: str, ok: bool, detail: str) -> None:
        self.expectations.append(Expectation(name, bool(ok), detail))

    def registry(self) -> Any:
        from flywheel.db.session import make_engine

        return registry_for(self.fleet.base, make_engine(self.fleet.base.database_url))


def _instances(role: str) -> list[str]:
    return [name for name in ("gateway", *NODES, *WORKERS) if name == role or name.startswith(f"{role}-")]


ROLE_TYPES = ("gateway", "node", "ingest", "rewards", "trainer", "rollout")


def fault_none(c: Chaos) -> None:
    """No fault: the control run."""


def _each_role_type(c: Chaos, act: Callable[[str], None]) -> None:
    """``act`` on one process (random instance) of every role type, in random order, at random
    moments between 10% and 70% of the traffic window."""
    roles = list(ROLE_TYPES)
    c.rng.shuffle(roles)
    moments = sorted(c.rng.uniform(0.1, 0.7) for _ in roles)
    for role, moment in zip(roles, moments):
        if not c.at(moment):
            return
        act(c.rng.choice(_instances(role)))


def kill_and_restart(c: Chaos, name: str) -> None:
    """kill -9 ``name``, restart it 0.2-2 s later."""
    down = c.rng.uniform(0.2, 2.0)
    c.fleet.kill(name)
    c.note(f"kill -9 {name}, restarted after {down:.1f}s")
    c.sleep(down)
    c.fleet.restart(name)


def fault_kill9(c: Chaos) -> None:
    """kill -9 one process of every role type at random moments, each restarted after 0.2-2 s."""
    _each_role_type(c, lambda name: kill_and_restart(c, name))


def fault_sigterm(c: Chaos) -> None:
    """SIGTERM one process of every role type under load; each must exit 0 (graceful) and is restarted."""
    def term(name: str) -> None:
        started = time.monotonic()
        rc = c.fleet.term(name, timeout_s=60.0)
        took = time.monotonic() - started
        c.note(f"SIGTERM {name}: exit {rc} after {took:.1f}s, restarted")
        c.expect(f"SIGTERM {name} exits 0", rc == 0, f"exit status {rc} after {took:.1f}s")
        c.fleet.restart(name)

    _each_role_type(c, term)


def fault_broker_outage(c: Chaos) -> None:
    """The broker unavailable under load, twice, 5 s each: frozen (SIGSTOP) and every connection to
    it aborted (``ss -K``), so its clients' connections reset and their new ones hang unanswered;
    then resumed (SIGCONT) with its log and group state as they were."""
    broker = c.services.broker
    for moment in (0.2, 0.5):
        if not c.at(moment):
            return
        broker.freeze()
        try:
            cut = broker.cut_connections()
            c.note(f"broker frozen (SIGSTOP), {cut} connection socket(s) aborted")
            c.expect("the broker's connections were cut", cut > 0, f"{cut} socket(s) aborted by ss -K")
            c.sleep(3.0)
            try:
                capture = c.fleet.capture()
            except (httpx.HTTPError, ValueError) as exc:
                capture = {"error": str(exc)}
            c.expect("while the broker is away the gateway spools",
                     capture.get("bus_up") is False and capture.get("events", 0) > 0,
                     f"capture 3 s into the outage: bus_up {capture.get('bus_up')}, {capture.get('events')} "
                     "event(s) spooled")
            c.sleep(2.0)
        finally:
            broker.thaw()
        c.note("broker resumed (SIGCONT)")


def fault_postgres(c: Chaos) -> None:
    """Restart PostgreSQL under load: a clean (fast) shutdown, 3 s down; later a crash (immediate), 3 s down."""
    for moment, mode in ((0.2, "fast"), (0.5, "immediate")):
        if not c.at(moment):
            return
        c.services.postgres.stop(mode)
        c.note(f"PostgreSQL stopped ({mode})")
        c.sleep(3.0)
        c.services.postgres.start()
        c.note("PostgreSQL started again")


def fault_redis(c: Chaos) -> None:
    """Stop Redis (no persistence: it comes back empty) under load twice, 3 s each; the second time with SIGKILL."""
    for moment, sig in ((0.2, signal.SIGTERM), (0.5, signal.SIGKILL)):
        if not c.at(moment):
            return
        c.services.redis.stop(sig)
        c.note(f"Redis stopped ({signal.Signals(sig).name}), its data gone")
        c.sleep(3.0)
        c.services.redis.start()
        c.note("Redis started again (empty)")


def fault_spool_full(c: Chaos) -> None:
    """The gateway's spool disk fills up while the bus is away, as it would: the broker frozen
    (SIGSTOP) for 3 s so the spool backs up, the disk filled to the last byte, the broker resumed
    (the shipper ships and records its cursor on the full disk), the disk kept full for 8 s, freed."""
    disk = c.disks["spool"]
    if not c.at(0.25):
        return
    before = sum(1 for f in c.users.log.failures if f.status == 503)
    c.services.broker.freeze()
    try:
        c.note("broker frozen (SIGSTOP): the spool backs up")
        c.sleep(3.0)
        filled = disk.fill()
        c.note(f"spool disk full ({filled >> 20} MiB filler on a {disk.size_mb} MiB tmpfs)")
    finally:
        c.services.broker.thaw()
    c.note("broker resumed")
    disk.keep_full(8.0, c.stop)
    disk.free()
    c.note("spool disk freed")
    refused = sum(1 for f in c.users.log.failures if f.status == 503) - before
    c.expect("a full spool disk is met with 503s", refused > 0, f"{refused} request(s) answered 503 while full")


def fault_store_full(c: Chaos) -> None:
    """Fill the disk holding the weight store for 12 s under load (the trainer's publishes fail), then free it."""
    disk = c.disks["store"]
    if not c.at(0.2):
        return
    registry = c.registry()
    filled = disk.fill()
    c.note(f"weight store disk full ({filled >> 20} MiB filler on a {disk.size_mb} MiB tmpfs), kept full for 12 s")
    stop = threading.Event()
    keeper = threading.Thread(target=disk.keep_full, args=(12.0, stop), daemon=True)
    keeper.start()
    c.sleep(1.0)  # a publish that had written its object before the disk filled may still register
    before = max((v.version for v in registry.versions()), default=0)
    keeper.join()
    during = max((v.version for v in registry.versions()), default=0)
    disk.free()
    c.note(f"weight store disk freed (newest version v{before} 1 s into the outage, v{during} at its end)")
    trainer_log = c.fleet.procs["trainer"].log_path.read_text(errors="replace")
    c.expect("a full store fails the publish, registers nothing", during == before and "No space left" in trainer_log,
             f"newest version v{before} -> v{during} while full; trainer log mentions ENOSPC: "
             f"{'No space left' in trainer_log}")


def _damage(data: bytes, mode: str, wrong: bytes | None) -> bytes:
    if mode == "truncate":
        return data[: len(data) // 2]
    if mode == "corrupt":
        middle = len(data) // 2
        return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :]
    assert wrong is not None
    return wrong


def _new_delta_candidate(registry: Any, newest: int) -> Any:
    """The first delta candidate above ``newest`` the trainer publishes (TimeoutError after 30 s)."""
    return wait_for("a new delta candidate", lambda: next(
        (v for v in sorted(registry.versions(), key=lambda v: v.version)
         if v.version > newest and v.kind == "delta" and v.status == "candidate"), None), 30.0, 0.05)


def fault_bad_delta(c: Chaos) -> None:
    """Damage a fresh delta in the store before it rolls out, in turn: corrupted bytes, truncated,
    and a valid delta of the same weights against the wrong parent. Each round: the rollout
    controller frozen (SIGSTOP) until the trainer publishes the next delta, which is damaged in the
    store; the controller resumed (it promotes it, or a newer version whose chain runs through it;
    promoted by hand if the gates hold it back). Every node must refuse it and keep serving the
    previous stable version, and the rollout controller, seeing every node's ``failed_update``, must
    roll the promoted version back and restore the previous stable (a failed rollout leaves the
    fleet on the previous stable version). Then the object is repaired, and the line must move on:
    a later version (whose chain runs through the repaired one) promoted and served by every node."""
    from flywheel.weights.codec.delta import encode_delta_with_summary

    registry = c.registry()
    root = c.fleet.base.store_path
    rollout = c.fleet.procs["rollout"]
    for mode in ("corrupt", "truncate", "wrong_parent"):
        if time.monotonic() > c.t0 + 0.75 * c.seconds or c.stop.is_set():
            c.note(f"{mode}: skipped, the traffic window is over (give the scenario more --seconds)")
            break
        stable = registry.latest("stable")
        previous = stable.version if stable is not None else None
        newest = max(v.version for v in registry.versions())
        rollout.signal(signal.SIGSTOP)
        if registry.latest("canary") is not None:  # it started one meanwhile: wait for its verdict
            rollout.signal(signal.SIGCONT)
            continue
        try:
            target = _new_delta_candidate(registry, newest)
            path = root / target.store_key
            original = path.read_bytes()
            wrong = None
            if mode == "wrong_parent":
                grandparent = registry.get(target.parent).parent
                wrong, _ = encode_delta_with_summary(registry.load(grandparent if grandparent is not None else 0),
                                                     registry.load(target.version), new_sha256=target.sha256)
            path.write_bytes(_damage(original, mode, wrong))
        except TimeoutError as exc:
            c.expect(f"{mode}: a delta to damage", False, str(exc))
            continue
        finally:
            rollout.signal(signal.SIGCONT)
        serving = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
        c.note(f"v{target.version} (delta on v{target.parent}) damaged in the store: {mode}; stable is v{previous}, "
               f"the nodes serve {serving}")
        try:
            promoted = wait_for(f"a version at or past v{target.version} to go stable", lambda: (
                (s := registry.latest("stable")) is not None and s.version >= target.version and s), 8.0, 0.1)
        except TimeoutError:  # the gates hold it back: promote it as an operator would
            result = subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(rollout.config), "rollout",
                                     "promote", str(target.version), "--reason", "chaos: bad delta"],
                                    capture_output=True, text=True, timeout=120)
            c.note(f"v{target.version} promoted by hand (exit {result.returncode})")
            promoted = registry.latest("stable")
        c.note(f"v{promoted.version} is stable; its chain holds the damaged v{target.version}")

        def refused() -> bool:
            return all(any(f"version {promoted.version}" in d for _, _, d in c.watcher.failed[n]) for n in NODES)

        ok_refused = True
        try:
            wait_for("every node to refuse the damaged version", refused, 15.0, 0.1)
        except TimeoutError:
            ok_refused = False
        live = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
        reasons = [c.watcher.failed[n][-1][2][:140] if c.watcher.failed[n] else None for n in NODES]
        c.expect(f"{mode}: every node refuses v{promoted.version} and keeps serving what it served",
                 ok_refused and live == serving,
                 f"refused: {ok_refused}; live before {serving}, after {live}; reasons: {reasons}")
        try:  # the controller sees every node's failed_update and restores the previous stable
            wait_for(f"the controller to roll back v{promoted.version}",
                     lambda: registry.get(promoted.version).status == "rolled_back", 30.0, 0.2)
            restored = registry.latest("stable")
            c.expect(f"{mode}: v{promoted.version} rolled back, the fleet stays on v{previous}",
                     restored is not None and restored.version == previous and
                     {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES} == serving,
                     f"stable v{restored.version if restored else None}, nodes at "
                     f"{ {n: (c.watcher.last.get(n) or {}).get('version') for n in NODES} }")
        except TimeoutError:
            c.expect(f"{mode}: v{promoted.version} rolled back", False,
                     f"still {registry.get(promoted.version).status}")
        path.write_bytes(original)  # repaired: later versions whose chain runs through it can load
        c.note(f"v{target.version} repaired in the store")
        try:  # the line is not stuck: a later candidate is promoted and the fleet loads it
            wait_for(f"the fleet to move past v{promoted.version}", lambda: all(
                ((c.watcher.last.get(n) or {}).get("version") or -1) > promoted.version for n in NODES), 30.0, 0.2)
            moved = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
            c.expect(f"{mode}: repaired, the line moves on past v{promoted.version}", True, f"nodes at {moved}")
        except TimeoutError:
            moved = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
            c.expect(f"{mode}: repaired, the line moves on past v{promoted.version}", False, f"nodes at {moved}")


#: ``bad_canary``'s rollout: half of new sessions go to a canary, judged after 4 s on 5 generations
#: each (minutes and hundreds in production), so verdicts come within the traffic window.
CANARY_SETTINGS: dict[str, Any] = {"rollout": {"canary_fraction": 0.5, "window_s": 4.0, "min_samples": 5}}


def _first(transitions: list[dict[str, Any]], status: str, above: int) -> dict[str, Any] | None:
    """The first transition of a version above ``above`` to ``status``, if any."""
    return next((t for t in transitions if t["version"] > above and t["to_status"] == status), None)


def _canary_promoted(c: Chaos, registry: Any, above: int, timeout_s: float, what: str) -> int | None:
    """Wait for a version above ``above`` to go canary -> stable (the canary path, with the clients
    it served while canary counted) and every node to serve it live; expectations say how it went."""
    promoted: dict[str, Any] = {}

    def through_canary() -> bool:
        transitions = registry.transitions()
        for t in transitions:
            if t["version"] > above and t["to_status"] == "stable" and t["from_status"] == "canary":
                promoted.update(t, served=sum(r.version == t["version"] for r in list(c.users.log.received.values())))
                return True
        return False

    try:
        wait_for(f"{what}: a canary above v{above} promoted", through_canary, timeout_s, 0.2)
    except TimeoutError:
        c.expect(f"{what}: a canary above v{above} promoted to stable", False,
                 f"none in {timeout_s:.0f}s; versions {[(v.version, v.status) for v in registry.versions()][-6:]}")
        return None
    version = promoted["version"]
    c.note(f"v{version} promoted from canary ({promoted['served']} response(s) served by it so far): "
           f"{promoted['reason'][:160]}")
    try:
        wait_for(f"every node to serve v{version}", lambda: all(
            ((c.watcher.last.get(n) or {}).get("version") or -1) >= version for n in NODES), 20.0, 0.2)
        ok = True
    except TimeoutError:
        ok = False
    live = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
    c.expect(f"{what}: v{version} went canary -> stable, served to clients as canary, then by every node",
             ok and promoted["served"] > 0, f"{promoted['served']} response(s) from v{version} when promoted; "
             f"nodes at {live}")
    return version


def fault_bad_canary(c: Chaos) -> None:
    """A canary no node can load. First a good canary goes the canary path (half of new sessions,
    judged, promoted, every node serving it). Then the rollout controller frozen (SIGSTOP) until
    the trainer publishes the next delta, which is corrupted in the store; resumed, it makes that
    version (or a newer one whose chain runs through it) a canary, never stable. Every node must
    refuse it (``failed_update``) and keep serving the stable version; the controller must roll the
    canary back (every fresh node reports it failed, or it served nothing for ``window_s``) with
    stable untouched; no client is served by a damaged version. Then the object is repaired, and
    the line must move on: a later version canaried, promoted and served by every node."""
    registry = c.registry()
    root = c.fleet.base.store_path
    rollout = c.fleet.procs["rollout"]

    def live() -> dict[str, int | None]:
        return {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}

    if not c.at(0.05):
        return
    good = _canary_promoted(c, registry, 0, 0.4 * c.seconds, "good canary")
    target = canary = None
    for _ in range(3):
        if time.monotonic() > c.t0 + 0.55 * c.seconds or c.stop.is_set():
            break
        try:  # start from no running canary, so the damaged one is the next canary
            wait_for("no canary running", lambda: registry.latest("canary") is None, 15.0, 0.1)
        except TimeoutError:
            pass
        newest = max(v.version for v in registry.versions())
        rollout.signal(signal.SIGSTOP)
        if registry.latest("canary") is not None:  # it started one meanwhile: wait for its verdict
            rollout.signal(signal.SIGCONT)
            continue
        try:
            target = _new_delta_candidate(registry, newest)
            path = root / target.store_key
            original = path.read_bytes()
            path.write_bytes(_damage(original, "corrupt", None))
            stable = registry.latest("stable")
        except TimeoutError as exc:
            c.expect("bad canary: a delta to damage", False, str(exc))
            return
        finally:
            rollout.signal(signal.SIGCONT)
        previous = stable.version if stable else None
        c.note(f"v{target.version} (delta on v{target.parent}) corrupted in the store; stable is v{previous}, "
               f"the nodes serve {live()}")
        try:
            started = wait_for(f"a version at or past v{target.version} to go canary",
                               lambda: _first(registry.transitions(), "canary", target.version - 1), 20.0, 0.1)
        except TimeoutError:
            went = [(t["version"], t["to_status"]) for t in registry.transitions() if t["version"] >= target.version]
            c.expect("bad canary: the damaged version becomes a canary", False, f"transitions {went}")
            path.write_bytes(original)
            return
        canary = started["version"]
        chain, v = [], canary
        while v is not None and v >= target.version:
            chain.append(v)
            v = registry.get(v).parent
        if target.version not in chain:  # a full version: loads without the damaged delta; try again
            c.note(f"v{canary} is a canary but its chain {chain} skips v{target.version}; again")
            path.write_bytes(original)
            canary = None
            continue
        c.note(f"v{canary} is a canary; its chain holds the damaged v{target.version}")

        def refused() -> bool:
            return all(any(f"version {canary}:" in d for _, _, d in c.watcher.failed[n]) for n in NODES)

        def on_stable() -> bool:
            return all(v == previous for v in live().values())

        try:
            wait_for(f"every node to refuse v{canary}", lambda: refused() and on_stable(), 15.0, 0.1)
            ok = True
        except TimeoutError:
            ok = False
        reasons = [c.watcher.failed[n][-1][2][:120] if c.watcher.failed[n] else None for n in NODES]
        c.expect(f"bad canary: every node refuses v{canary} and keeps serving stable v{previous}", ok,
                 f"refused: {refused()}; nodes at {live()}; reasons: {reasons}")
        try:
            wait_for(f"the controller to roll back canary v{canary}",
                     lambda: registry.get(canary).status == "rolled_back", 30.0, 0.1)
            why = next((t["reason"] for t in registry.transitions(canary) if t["to_status"] == "rolled_back"), "")
            went = [t["to_status"] for t in registry.transitions(canary)]
            restored = registry.latest("stable")
            c.note(f"canary v{canary} rolled back: {why[:160]}")
            c.expect(f"bad canary: v{canary} rolled back (never stable), stable v{previous} untouched, the fleet on it",
                     "stable" not in went and restored is not None and restored.version == previous
                     and on_stable(), f"transitions {went}; stable v{restored.version if restored else None}; "
                     f"nodes at {live()}; reason: {why[:200]}")
        except TimeoutError:
            c.expect(f"bad canary: v{canary} rolled back", False, f"still {registry.get(canary).status}")
        path.write_bytes(original)
        c.note(f"v{target.version} repaired in the store")
        break
    if canary is None:
        c.expect("bad canary: a damaged version became a canary", False,
                 "not injected: the traffic window was over (give the scenario more --seconds)")
        return
    _canary_promoted(c, registry, canary, 45.0, "after the repair")
    c.stop.wait()  # the users have stopped: the client log is whole
    assert target is not None
    damaged = range(target.version, canary + 1)
    served = Counter(r.version for r in list(c.users.log.received.values()) if r.version in damaged)
    c.expect(f"no client served by a damaged version (v{target.version}..v{canary})", not served,
             f"responses naming them: {dict(served) or 'none'}; good canary v{good}")


def fault_node_mid_update(c: Chaos) -> None:
    """kill -9 a node 0-20 ms after a promotion, while it loads the new version, at every promotion
    while the other node serves (so the fleet is never empty); each is restarted at once. Whether a
    kill landed before the load finished is read from the node's log."""
    from sqlalchemy import select

    from flywheel.db.models import VersionTransition
    from flywheel.db.session import make_engine

    engine = make_engine(c.fleet.base.database_url)
    hits = kills = 0
    try:
        def newest_stable() -> tuple[int, int | None]:
            with engine.connect() as conn:
                row = conn.execute(select(VersionTransition.id, VersionTransition.version)
                                   .where(VersionTransition.to_status == "stable")
                                   .order_by(VersionTransition.id.desc()).limit(1)).first()
            return (row[0], row[1]) if row is not None else (0, None)

        def serving(name: str) -> bool:
            try:
                return httpx.get(f"{c.fleet.node_url(name)}/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        last, _ = newest_stable()
        turn = 0
        while not c.stop.is_set() and time.monotonic() < c.t0 + 0.8 * c.seconds:
            now, version = newest_stable()
            if now == last:
                c.sleep(0.01)
                continue
            last = now
            names = list(NODES)[turn % 2 :] + list(NODES)[: turn % 2]
            up = {n: serving(n) for n in NODES}
            name = next((n for n in names if up[n] and all(up.values())), None)
            if name is None:  # a node is still restarting: keep the fleet serving
                continue
            turn += 1
            c.sleep(c.rng.uniform(0.0, 0.02))
            proc = c.fleet.procs[name]
            c.fleet.kill(name)
            kills += 1
            log_text = proc.log_path.read_text(errors="replace")
            loaded = any(m.group(2) == str(version) for m in LOADED.finditer(log_text[-20000:]))
            hits += not loaded
            when = "after" if loaded else "before"
            c.note(f"kill -9 {name} just after v{version} went stable ({when} it loaded v{version})")
            c.fleet.restart(name)
    finally:
        engine.dispose()
    c.expect("a node was killed mid-update", hits > 0, f"{hits} of {kills} kills landed before the load finished")


def fault_upstream(c: Chaos) -> None:
    """Slow upstream (20% of calls 0.5-2.5 s, 3% of calls 7 s, past the gateway's 5 s timeout),
    upstream errors (10%: 500/502/503) and upstream disconnects mid-response (10%), on both nodes."""
    if not c.at(0.1):
        return
    for proxy in c.proxies.values():
        proxy.faults = UpstreamFaults(slow=0.2, slow_s=(0.5, 2.5), error=0.1, disconnect=0.1)
    c.note("upstream faults on: 20% slow, 10% errors, 10% disconnects")
    if not c.at(0.45):
        return
    for proxy in c.proxies.values():
        proxy.faults = UpstreamFaults(slow=0.03, slow_s=(7.0, 7.0), error=0.1, disconnect=0.1)
    c.note("upstream faults: 3% 7 s (past the gateway's upstream timeout), 10% errors, 10% disconnects")
    c.at(0.8)
    for proxy in c.proxies.values():
        proxy.faults = UpstreamFaults()
    counts = Counter()
    for proxy in c.proxies.values():
        counts.update(proxy.counts)
    c.note(f"upstream faults off: {dict(counts)}")
    broken = Counter(f.kind for f in c.users.log.failures)
    c.expect("upstream faults reached the clients as errors", counts["error"] > 0 and counts["disconnect"] > 0
             and broken["status"] + broken["stream"] > 0, f"proxy {dict(counts)}; client failures {dict(broken)}")


def fault_poison(c: Chaos) -> None:
    """Poison, while an ingest worker, a rewards worker and the trainer are each killed (-9) once
    at a random moment and restarted after 0.2-2 s. Three rounds (at 10%, 40% and 70% of the
    window): a rogue producer writes one record of every poison kind onto every consumed topic,
    between the good records (``chaos.poison``: what each must become is ``poison_dead_lettered``),
    and a tenant sends the poison API requests between good requests of its own: each must be
    refused with a 4xx (never a 5xx, never accepted), an identical feedback replay accepted, and
    the gateway must go on serving."""
    rogue = RogueProducer(c.fleet.base, c.rng.getrandbits(32))
    registry = c.registry()
    statuses: dict[str, list[int]] = {label: [] for label in [*API_POISON, IDENTICAL_REPLAY]}
    served_after: list[bool] = []

    def bus() -> None:
        for round_no, moment in enumerate((0.1, 0.4, 0.7)):
            if not c.at(moment):
                return
            version = max((v.version for v in registry.versions()), default=0)
            produced = rogue.round(round_no, version)
            c.poison += produced
            c.note(f"rogue producer: {len(produced)} poison records onto generations, feedback, trajectories, "
                   f"scored (round {round_no + 1})")

    def api() -> None:
        keys = c.fleet.keys
        headers = {"Authorization": f"Bearer {keys.tenants[0][1]}"} if keys is not None else {}
        with httpx.Client(base_url=c.fleet.gateway_url, headers=headers, timeout=30.0) as client:
            for round_no, moment in enumerate((0.12, 0.42, 0.72)):
                if not c.at(moment):
                    return
                got, served = api_round(c.users, client, round_no)
                for label, status in got.items():
                    statuses[label].append(status)
                served_after.append(served)
                c.note(f"poison API requests (round {round_no + 1}): {sorted(set(got.values()))}"
                       + ("" if got else ": the good requests before them failed, skipped"))

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # a poison round that could not be sent is a failed expectation
                c.expect(f"poison: the {fn.__name__} rounds ran", False, f"{type(exc).__name__}: {exc}")
        return run

    threads = [threading.Thread(target=guarded(fn), name=f"chaos-poison-{fn.__name__}", daemon=True)
               for fn in (bus, api)]
    for t in threads:
        t.start()
    try:
        roles = ["ingest", "rewards", "trainer"]
        c.rng.shuffle(roles)
        for role, moment in zip(roles, sorted(c.rng.uniform(0.1, 0.8) for _ in roles)):
            if not c.at(moment):
                break
            kill_and_restart(c, c.rng.choice(_instances(role)))
    finally:
        for t in threads:
            t.join(300)
        rogue.close()
    c.expect("the rogue producer wrote poison onto every consumed topic",
             {p.topic for p in c.poison} == {"generations", "feedback", "trajectories", "scored"},
             f"{len(c.poison)} poison records acknowledged: {dict(Counter(p.topic for p in c.poison))}")
    for label, want in API_POISON.items():
        got = statuses[label]
        c.expect(f"poison API: {label} is refused with a 4xx, never a 5xx", bool(got) and all(
            400 <= s < 500 for s in got), f"answered {got} (a fixed gateway: {want})")
    c.expect(f"poison API: {IDENTICAL_REPLAY} is accepted again (202)",
             bool(statuses[IDENTICAL_REPLAY]) and all(s == 202 for s in statuses[IDENTICAL_REPLAY]),
             f"answered {statuses[IDENTICAL_REPLAY]}")
    c.expect("poison API: the gateway serves and accepts good requests after the poison",
             bool(served_after) and all(served_after), f"rounds served after the poison: {served_after}")


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str  # the faults, for the table
    inject: Callable[[Chaos], None]
    disks: tuple[str, ...] = ()
    #: A traffic window at least this long, whatever ``--seconds`` says (the faults need the time).
    min_seconds: float = 0.0
    #: Settings of this scenario's fleet, on top of ``chaos.fleet.CHAOS_OVERRIDES``.
    settings: dict[str, Any] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("baseline", "none (control)", fault_none),
    Scenario("kill9", "kill -9 + restart, every role type", fault_kill9),
    Scenario("sigterm", "SIGTERM + restart, every role type", fault_sigterm),
    Scenario("broker_outage", "Kafka broker frozen, connections cut, 5 s x2", fault_broker_outage),
    Scenario("postgres_restart", "PostgreSQL restart (fast, immediate)", fault_postgres),
    Scenario("redis_restart", "Redis stopped/started x2 (empty)", fault_redis),
    Scenario("spool_disk_full", "bus frozen 3 s, gateway spool disk full 8 s", fault_spool_full, disks=("spool",)),
    Scenario("store_disk_full", "weight store disk full 12 s", fault_store_full, disks=("store",)),
    Scenario("bad_delta", "corrupt / truncated / wrong-parent delta", fault_bad_delta, min_seconds=45.0),
    Scenario("bad_canary", "good canary promoted; corrupt canary rolled back", fault_bad_canary, min_seconds=60.0,
             settings=CANARY_SETTINGS),
    Scenario("node_mid_update", "kill -9 node mid-update", fault_node_mid_update),
    Scenario("upstream_faults", "slow / erroring / disconnecting upstream", fault_upstream),
    Scenario("poison", "rogue bus records + bad API requests; kill -9 ingest, rewards, trainer", fault_poison),
)}
QUICK = ("kill9", "upstream_faults")
