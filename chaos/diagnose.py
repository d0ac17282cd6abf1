"""Post-mortems on the bus: where lost items are, holes in the broker's logs, wedged groups.

Run only when an invariant found something lost (:func:`diagnose`) or the system did not catch up
(:func:`probe_groups`); what they find is added to the report, never to the verdict.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from typing import Any

from flywheel.settings import Settings
from testbed.procs import wait_for


def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[Any]:
    """Every record of ``topic`` (no group): read each partition up to its high watermark."""
    from kafka import KafkaConsumer, TopicPartition

    reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    out: list[Any] = []
    try:
        partitions = wait_for(f"metadata of {topic}", lambda: reader.partitions_for_topic(topic), 10.0)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        reader.assign(tps)
        reader.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
                (hw := reader.highwater(tp)) is None or reader.position(tp) < hw for tp in tps):
            for batch in reader.poll(timeout_ms=300, max_records=5000).values():
                out += batch
    finally:
        reader.close(autocommit=False)
    return out


def probe_groups(bootstrap: str, settings: Settings, seconds: float = 20.0) -> dict[str, str]:
    """Why a stage stopped consuming: a fresh member joins each stage's consumer group (and, as a
    control, a group of its own on the same topics) and reports whether it got partitions within
    ``seconds``. A group whose new member gets nothing while the control joins is wedged at the
    broker's group coordinator. (DescribeGroups would say more, but kafka-python cannot parse
    Tansu's answer.)"""
    from kafka import KafkaConsumer

    topics = {"ingest": ["generations", "feedback"], "rewards": ["trajectories"], "trainer": ["scored"]}
    out: dict[str, str] = {}

    def probe(label: str, group: str, names: list[str]) -> None:
        consumer = KafkaConsumer(*[settings.topic(n) for n in names], bootstrap_servers=bootstrap, group_id=group,
                                 enable_auto_commit=False, session_timeout_ms=6000, heartbeat_interval_ms=500,
                                 max_poll_interval_ms=20000, client_id=f"chaos-probe-{label}")
        started = time.monotonic()
        try:
            while time.monotonic() - started < seconds and not consumer.assignment():
                consumer.poll(timeout_ms=200, max_records=1)
            got = consumer.assignment()
            out[label] = (f"a new member got {len(got)} partition(s) in {time.monotonic() - started:.1f}s" if got
                          else f"a new member got no partition in {seconds:g}s")
        finally:
            consumer.close(autocommit=False)

    threads = []
    for stage, names in topics.items():
        control = (f"{stage} (control: a new group)", f"chaos-probe-{uuid.uuid4().hex[:8]}")
        for label, group in ((stage, settings.group(stage)), control):
            threads.append(threading.Thread(target=probe, args=(label, group, names), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return out


def offset_gaps(records: list[Any]) -> list[str]:
    """Offsets missing inside each partition's log: with no transactions and no compaction, a gap
    is a record the broker allocated an offset to, and cannot serve."""
    offsets: dict[int, list[int]] = defaultdict(list)
    for record in records:
        offsets[record.partition].append(record.offset)
    gaps = []
    for partition, seen in sorted(offsets.items()):
        seen.sort()
        gaps += [f"[{partition}]@{a + 1}" + (f"-{b - 1}" if b - a > 2 else "") for a, b in zip(seen, seen[1:]) if b > a + 1]
    return gaps


def diagnose(bootstrap: str, settings: Settings, lost: dict[str, list[Any]]) -> dict[str, Any]:
    """Where each lost item is on the bus (topic, partition, offset) against the consuming group's
    committed offset, and every hole in the topics' logs: on the bus below the commit means a
    consumer skipped it; absent from the bus where the log has a hole means the broker lost an
    acknowledged record; absent without a hole means it never got to the bus."""
    from kafka import KafkaAdminClient

    from flywheel.events import GenerationEvent, TrajectoryEvent

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        committed = {}
        for stage in ("ingest", "rewards"):
            offsets = admin.list_group_offsets([settings.group(stage)]).get(settings.group(stage), {})
            committed[stage] = {f"{tp.topic.removeprefix(settings.bus.topic_prefix)}[{tp.partition}]": meta.offset
                                for tp, meta in offsets.items()}
    finally:
        admin.close()
    topics = {name: read_topic(bootstrap, settings.topic(name)) for name in ("generations", "feedback", "trajectories")}
    out: dict[str, Any] = {"committed": committed,
                           "log_holes": {name: gaps for name, records in topics.items() if (gaps := offset_gaps(records))}}
    sessions = {sid for sid, *_ in lost["generations"] + lost["feedback"]} | set(lost["open_sessions"])
    if sessions:
        where = defaultdict(list)
        for name in ("generations", "feedback"):
            for record in topics[name]:
                key = record.key.decode() if record.key else ""
                if key in sessions:
                    where[key].append(f"{name}[{record.partition}]@{record.offset}")
        out["sessions_on_bus"] = {sid: where.get(sid, []) for sid in sorted(sessions)[:10]}
        missing = {gid for _, gid in lost["generations"]}
        found = []
        unconsumed = 0
        for record in topics["generations"]:
            try:
                gid = GenerationEvent.from_bytes(record.value).generation_id
            except ValueError:
                continue
            if gid in missing:
                found.append(f"{gid} at generations[{record.partition}]@{record.offset}")
                unconsumed += record.offset >= committed["ingest"].get(f"generations[{record.partition}]", 0)
        out["lost_generations_on_bus"] = found[:10]
        out["lost_generations_unconsumed"] = unconsumed
    if lost["unscored"]:
        wanted = {(tid, rev) for _, tid, rev in lost["unscored"]}
        found = []
        for record in topics["trajectories"]:
            try:
                event = TrajectoryEvent.from_bytes(record.value)
            except ValueError:
                continue
            if (event.trajectory_id, event.revision) in wanted:
                found.append(f"{event.session_id} r{event.revision} at trajectories[{record.partition}]@{record.offset}")
        out["unscored_on_bus"] = found
    return out
