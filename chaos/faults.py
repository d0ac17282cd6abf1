"""The faults to processes, services, disks and the upstream, and :class:`Chaos`, what every fault works with.

A fault function gets a :class:`Chaos` (the services, the fleet, the proxies, the users, a seeded
random generator and the traffic window), injects its faults at moments in the window, writes what
it did with :meth:`Chaos.note` and what each fault must cause with :meth:`Chaos.expect` (checked as
``fault_checks``); a fault that writes poison onto the bus lists it in :attr:`Chaos.poison` (checked
as ``poison_dead_lettered``); one that erases an end user lists it in :attr:`Chaos.subjects`
(checked as ``forgotten_leave_no_trace``). It returns early once the scenario ends (:meth:`Chaos.at`
is False).
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from chaos.collect import registry_for
from chaos.fleet import NODES, WORKERS, Fleet, NodeWatcher
from chaos.forgotten import ForgetSubject
from chaos.invariants import Expectation, PoisonRecord
from chaos.proxy import UpstreamFaults, UpstreamProxy
from chaos.services import Services
from chaos.users import Users
from testbed.disks import SmallDisk


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
        self.subjects: list[ForgetSubject] = []  # the end users a fault erased
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


def instances(role: str) -> list[str]:
    """The fleet's process names of ``role`` (``node`` -> both nodes, ``ingest`` -> both workers)."""
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
        act(c.rng.choice(instances(role)))


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


@contextlib.contextmanager
def broker_away(c: Chaos) -> Iterator[None]:
    """The broker frozen (SIGSTOP) and every connection to it aborted (``ss -K``), so its clients'
    connections reset and their new ones hang unanswered, for the ``with`` block; then resumed
    (SIGCONT) with its log and group state as they were."""
    broker = c.services.broker
    broker.freeze()
    try:
        cut = broker.cut_connections()
        c.note(f"broker frozen (SIGSTOP), {cut} connection socket(s) aborted")
        c.expect("the broker's connections were cut", cut > 0, f"{cut} socket(s) aborted by ss -K")
        yield
    finally:
        broker.thaw()
    c.note("broker resumed (SIGCONT)")


def expect_spooling(c: Chaos, into: float) -> None:
    """Expect the gateway to be spooling (its bus down, events waiting), ``into`` s into an outage."""
    try:
        capture = c.fleet.capture()
    except (httpx.HTTPError, ValueError) as exc:
        capture = {"error": str(exc)}
    c.expect("while the broker is away the gateway spools",
             capture.get("bus_up") is False and capture.get("events", 0) > 0,
             f"capture {into:g} s into the outage: bus_up {capture.get('bus_up')}, {capture.get('events')} "
             "event(s) spooled")


def fault_broker_outage(c: Chaos) -> None:
    """The broker unavailable under load (:func:`broker_away`), twice, 5 s each."""
    for moment in (0.2, 0.5):
        if not c.at(moment):
            return
        with broker_away(c):
            c.sleep(3.0)
            expect_spooling(c, 3.0)
            c.sleep(2.0)


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
