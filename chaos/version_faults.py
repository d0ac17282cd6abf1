"""The faults to model versions: corrupt, truncated and wrong-parent deltas, a bad canary, a node killed
mid-update (each checked against what the registry, the controller and the nodes must do)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx

from chaos.faults import Chaos
from chaos.fleet import LOADED, NODES
from testbed.procs import wait_for

#: A node's refusal, as ``serving.node.updater`` reports it: ``version N: Error: why``.
REFUSAL = re.compile(r"version (\d+): ")


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
    roll the promoted version back and restore the version the fleet serves (a failed rollout leaves
    the fleet on the previous stable version; the versions on the chain down to the damaged one go
    ``rolled_back`` with it, serving/rollout.py step 4). Then the object is repaired and, as an
    operator would, the newest implicated version no node tried is cleared (``flywheel rollout
    clear``: once the fleet is ``max_staleness`` versions behind, the trainer publishes nothing new),
    and the line must move on: a version whose chain runs through the repaired one promoted and
    served by every node."""
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

        def refused() -> bool:  # it, or a later version on its chain (promoted before the watcher saw the first)
            return all(any((m := REFUSAL.match(d)) is not None and int(m.group(1)) >= promoted.version
                           and f"version {target.version} (" in d for _, _, d in c.watcher.failed[n]) for n in NODES)

        ok_refused = True
        try:
            wait_for("every node to refuse the damaged version", refused, 15.0, 0.1)
        except TimeoutError:
            ok_refused = False
        live = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
        reasons = [c.watcher.failed[n][-1][2][:140] if c.watcher.failed[n] else None for n in NODES]
        c.expect(f"{mode}: every node refuses v{promoted.version} (or a later version on its chain), naming the "
                 f"damaged v{target.version}, and keeps serving what it served",
                 ok_refused and live == serving,
                 f"refused: {ok_refused}; live before {serving}, after {live}; reasons: {reasons}")
        try:  # the controller sees every node's failed_update and restores the previous stable
            wait_for(f"the controller to roll back v{promoted.version} and restore what the fleet serves", lambda: (
                registry.get(promoted.version).status == "rolled_back"  # (its chain first, then the restore)
                and (s := registry.latest("stable")) is not None and s.version < target.version), 30.0, 0.2)
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
        # The versions the failed loads implicated stay out until cleared, and the trainer stalls once
        # the fleet is max_staleness versions behind it: as an operator would after the repair, clear
        # the newest implicated version no node tried (a node does not retry a version it failed).
        untried = _untried_implicated(registry, target.version)
        if untried is not None:
            _operator_clears(c, registry, untried, f"{mode}: repaired")
        moved_on = f"{mode}: repaired, the line moves on past v{previous}: every node on a version chained on v{target.version}"
        try:  # the line is not stuck: a version chained on the repaired one is promoted and the fleet loads it
            wait_for(f"the fleet to move to v{target.version} or later", lambda: all(
                ((c.watcher.last.get(n) or {}).get("version") or -1) >= target.version for n in NODES), 30.0, 0.2)
            moved = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
            c.expect(moved_on, True, f"nodes at {moved}")
        except TimeoutError:
            moved = {n: (c.watcher.last.get(n) or {}).get("version") for n in NODES}
            c.expect(moved_on, False, f"nodes at {moved}; cleared v{untried}")


def _untried_implicated(registry: Any, above: int) -> int | None:
    """The newest version from ``above`` on, newer than stable, that a failed load rolled back and
    that was never canary or stable (no node tried to load it), or None."""
    stable = registry.latest("stable")
    for info in sorted(registry.versions(), key=lambda v: v.version, reverse=True):
        if info.version < above or (stable is not None and info.version <= stable.version):
            break
        audit = registry.transitions(info.version)
        if info.status == "rolled_back" and "failed load" in audit[-1]["reason"] and not any(
                t["to_status"] in ("canary", "stable") for t in audit):
            return info.version
    return None


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
    canary back (every fresh node reports it failed, or it served nothing for ``window_s`` while
    nodes report it failed) with stable untouched, and in the same step every candidate on its chain
    down to the damaged version (serving/rollout.py, step 4: a failed load implicates its chain),
    each audited as a failed load. Then the object is repaired, and the line must move on: a later
    version (whose chain runs through the repaired object) canaried, promoted and served by every
    node, while the damaged version and the canary stay ``rolled_back`` whatever the timing (they
    are ineligible until an operator clears them); no client is served by a damaged version. Last,
    once the traffic is over and stable is past them, ``flywheel rollout clear`` re-verifies the
    damaged version and makes it a candidate again (below stable: never canaried), audited."""
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
            held = _failed_load_holds(registry, chain)  # the controller moved the chain first, then the canary
            c.expect(f"bad canary: {_names(chain)} rolled back in the same step, each audited as a failed load",
                     all(ok for ok, _ in held.values()), "; ".join(f"v{v}: {d}" for v, (_, d) in held.items()))
        except TimeoutError:
            c.expect(f"bad canary: v{canary} rolled back", False, f"still {registry.get(canary).status}")
        path.write_bytes(original)
        c.note(f"v{target.version} repaired in the store")
        break
    if canary is None:
        c.expect("bad canary: a damaged version became a canary", False,
                 "not injected: the traffic window was over (give the scenario more --seconds)")
        return
    moved_on = _canary_promoted(c, registry, canary, 45.0, "after the repair")
    c.stop.wait()  # the users have stopped: the client log is whole
    assert target is not None
    held = _failed_load_holds(registry, chain)
    c.expect(f"bad canary: repaired, {_names(chain)} stay rolled_back (never canary or stable again) until cleared",
             all(ok for ok, _ in held.values()), "; ".join(f"v{v}: {d}" for v, (_, d) in held.items()))
    damaged = range(target.version, canary + 1)
    served = Counter(r.version for r in list(c.users.log.received.values()) if r.version in damaged)
    c.expect(f"no client served by a damaged version (v{target.version}..v{canary})", not served,
             f"responses naming them: {dict(served) or 'none'}; good canary v{good}")
    stable = registry.latest("stable")
    if moved_on is not None and stable is not None and stable.version > canary:  # cleared, it stays below stable
        _operator_clears(c, registry, target.version, "bad canary: the repaired")


def _names(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in sorted(versions))


def _failed_load_holds(registry: Any, versions: list[int]) -> dict[int, tuple[bool, str]]:
    """For each of ``versions``: rolled back as a failed load (the controller's audited reason, see
    serving/rollout.py step 4) and neither canary nor stable since; with what the audit says."""
    out: dict[int, tuple[bool, str]] = {}
    for version in versions:
        audit = registry.transitions(version)
        first = next((i for i, t in enumerate(audit) if t["to_status"] == "rolled_back"), None)
        if first is None:
            out[version] = (False, f"{registry.get(version).status}, never rolled back")
            continue
        since = [t["to_status"] for t in audit[first:]]
        why = audit[first]["reason"]
        ok = registry.get(version).status == "rolled_back" and "failed load" in why and not (
            {"canary", "stable", "candidate"} & set(since))
        out[version] = (ok, f"{registry.get(version).status}; since the rollback {since}; reason: {why[:140]}")
    return out


def _operator_clears(c: Chaos, registry: Any, version: int, what: str) -> None:
    """``flywheel rollout clear V``, as an operator would once the object is repaired: re-verified
    end to end, back to ``candidate`` (the controller may have moved it on since), audited with who
    cleared it."""
    config = c.fleet.procs["rollout"].config
    result = subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(config), "rollout", "clear",
                             str(version), "--reason", "chaos: object repaired"],
                            capture_output=True, text=True, timeout=120)
    audit = registry.transitions(version)
    cleared = next((t for t in audit if t["from_status"] == "rolled_back" and t["to_status"] == "candidate"), None)
    said = " | ".join(line for line in (result.stdout + result.stderr).splitlines() if line.strip())
    c.note(f"flywheel rollout clear v{version}: exit {result.returncode}: {said[:300]}")
    c.expect(f"{what}: the operator clears v{version}: re-verified, a candidate again, audited",
             result.returncode == 0 and cleared is not None and cleared["reason"].startswith("cleared by ")
             and "re-verified end to end" in cleared["reason"],
             f"exit {result.returncode}; status {registry.get(version).status}; "
             f"audit: {(cleared or audit[-1])['reason'][:200]}")


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
