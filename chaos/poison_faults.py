"""The ``poison`` scenario's fault: rounds of rogue bus records and hostile API requests while an
ingest worker, a rewards worker and the trainer are each killed (-9) once (the poison: :mod:`chaos.poison`)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import httpx

from chaos.faults import Chaos, instances, kill_and_restart
from chaos.poison import API_POISON, IDENTICAL_REPLAY, RogueProducer, api_round


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
            kill_and_restart(c, c.rng.choice(instances(role)))
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
