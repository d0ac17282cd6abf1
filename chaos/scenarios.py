"""The scenarios ``flywheel chaos`` runs: each names its faults, its disks, its shortest window and its settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.faults import (
    Chaos,
    fault_broker_outage,
    fault_kill9,
    fault_none,
    fault_postgres,
    fault_redis,
    fault_sigterm,
    fault_spool_full,
    fault_store_full,
    fault_upstream,
)
from chaos.forget_faults import fault_forget
from chaos.poison_faults import fault_poison
from chaos.version_faults import CANARY_SETTINGS, fault_bad_canary, fault_bad_delta, fault_node_mid_update


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
    Scenario("forget_under_faults", "an end user forgotten mid-session: broker away, kill -9 forget, ingest, "
             "rewards, trainer; --resume", fault_forget, min_seconds=60.0),
)}
QUICK = ("kill9", "upstream_faults")
