"""The write-ahead spool and Capture on real files, real processes and the real local-log bus.

Faults are real: a torn tail left on disk, a process killed with SIGKILL mid-append, a second
process on the same folder, write errors from RLIMIT_FSIZE (EFBIG). A bus that is down is a
producer factory that raises, as a broker that cannot be reached makes the Kafka factory raise
(tests/integration/test_capture_faults.py stops a real broker).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flywheel.bus import BusError, make_bus
from flywheel.bus.envelope import Reassembler
from flywheel.bus.frames import CorruptLogError, encode_frame
from flywheel.settings import Settings, load_settings
from serving.gateway.shipper import Capture, CaptureFull, spool_dir
from serving.gateway.spool import Spool, SpoolLocked
from testbed.procs import wait_for

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _items(n: int, start: int = 0, topic: str = "t.generations") -> list[tuple[str, str, bytes, dict[str, str]]]:
    return [(topic, f"s{i % 3}", f"value-{i}".encode() * (1 + i % 5), {"event_id": f"e{i}"})
            for i in range(start, start + n)]


def _read_all(spool: Spool, limit: int = 100_000) -> list:
    out: list = []
    while True:
        got = spool.read(1000, 1 << 30)
        if not got:
            return out
        out.extend(got)
        assert len(out) <= limit


def _values(records: list) -> list[bytes]:
    return [r.value for r in records]


# The spool ------------------------------------------------------------------------------------


def test_order_cursor_and_replay_across_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=4096)
    spool.open()
    items = _items(200)
    for i in range(0, 200, 7):
        spool.append(items[i : i + 7])
    got = _read_all(spool)
    assert [r.offset for r in got] == list(range(200))
    assert [(r.topic, r.key, r.value, r.headers) for r in got] == [(t, k, v, h) for t, k, v, h in items]
    assert len(list((tmp_path / "s").glob("*.seg"))) > 3  # rotated

    spool.rewind()  # the bus failed: read again from the cursor
    assert [r.offset for r in spool.read(10, 1 << 30)] == list(range(10))
    spool.ack(got[:120])
    assert spool.events == 80 and spool.cursor == 120
    spool.close_reader()
    spool.close()

    again = Spool(tmp_path / "s", segment_bytes=4096)
    again.open()
    assert again.events == 80
    replay = _read_all(again)
    assert [r.offset for r in replay] == list(range(120, 200))
    again.append(_items(1, 200))
    assert [r.offset for r in _read_all(again)] == [200]
    again.ack(replay)
    assert again.events == 1
    # fully shipped segments are gone; the cursor's segment and later ones remain
    bases = sorted(int(p.stem) for p in (tmp_path / "s").glob("*.seg"))
    assert bases[0] <= 200 and all(b > 100 for b in bases)
    again.close_reader()
    again.close()


@pytest.mark.parametrize("tail", ["partial frame", "zero fill", "bad last frame"])
def test_a_torn_tail_is_truncated_on_open(tmp_path: Path, tail: str) -> None:
    spool = Spool(tmp_path / "s")
    spool.open()
    spool.append(_items(5))
    spool.close()
    (segment,) = (tmp_path / "s").glob("*.seg")
    good = segment.stat().st_size
    frame = encode_frame(5, "k", b"lost in the crash", {"spool.topic": "t"}, 0)
    with open(segment, "ab") as f:
        if tail == "partial frame":
            f.write(frame[: len(frame) // 2])
        elif tail == "zero fill":
            f.write(bytes(len(frame)))
        else:
            f.write(frame[:-1] + bytes([frame[-1] ^ 0xFF]))

    again = Spool(tmp_path / "s")
    again.open()
    assert segment.stat().st_size == good and again.events == 5
    again.append(_items(1, 5))
    assert [r.value for r in _read_all(again)] == _values_of(_items(6))
    again.close_reader()
    again.close()


def _values_of(items: list) -> list[bytes]:
    return [v for _, _, v, _ in items]


def test_damage_in_the_middle_is_reported_not_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.open()
    spool.append(_items(10))
    spool.close()
    (segment,) = (tmp_path / "s").glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0x01
    segment.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match=segment.name):
        Spool(tmp_path / "s").open()


_HOLD = textwrap.dedent(
    """
    import sys, time
    from serving.gateway.spool import Spool, SpoolLocked
    spool = Spool(sys.argv[1])
    try:
        spool.open()
    except SpoolLocked as exc:
        print("LOCKED", exc, flush=True)
        sys.exit(3)
    print("OPEN", flush=True)
    time.sleep(60)
    """
)


def _spawn(code: str, *args: object, **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_second_process_on_the_same_spool_fails_to_start(tmp_path: Path) -> None:
    holder = _spawn(_HOLD, tmp_path / "s")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "OPEN"
        second = _spawn(_HOLD, tmp_path / "s")
        out, _ = second.communicate(timeout=30)
        assert second.returncode == 3
        assert f"in use by another gateway process (pid {holder.pid})" in out
        with pytest.raises(SpoolLocked):  # and in this process too
            Spool(tmp_path / "s").open()
    finally:
        holder.kill()
        holder.wait(10)
    Spool(tmp_path / "s").open()  # a dead holder's lock is gone with it


_APPENDER = textwrap.dedent(
    """
    import sys
    from serving.gateway.spool import Spool
    spool = Spool(sys.argv[1], segment_bytes=20_000)
    spool.open()
    i = 0
    while True:
        end = spool.append([("t", "k", b"%d" % i + b"x" * (i % 300), {})])
        print(end, flush=True)  # acknowledged: the write returned
        i += 1
    """
)


def test_every_acknowledged_append_survives_sigkill(tmp_path: Path) -> None:
    proc = _spawn(_APPENDER, tmp_path / "s")
    assert proc.stdout is not None
    acknowledged = 0
    deadline = time.monotonic() + 30
    while acknowledged < 3000 and time.monotonic() < deadline:
        acknowledged = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert acknowledged >= 3000
    spool = Spool(tmp_path / "s", segment_bytes=20_000)
    spool.open()
    got = _read_all(spool)
    assert len(got) >= acknowledged
    assert [r.offset for r in got] == list(range(len(got)))
    assert all(r.value.startswith(b"%d" % r.offset) for r in got)
    spool.close_reader()
    spool.close()


# Capture --------------------------------------------------------------------------------------


class Switch:
    """A producer factory for the local-log bus that can be turned off (the bus is down)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.up = True
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if not self.up:
            raise BusError("bus is down (test switch)")
        return make_bus(self.settings).producer(timeout_s=self.settings.gateway.ship_timeout_s)


def _settings(tmp_path: Path, **gateway: Any) -> Settings:
    return load_settings(data_dir=str(tmp_path), bus={"kind": "local", "partitions": 2, "topic_prefix": "t."},
                         gateway={"ship_timeout_s": 2.0, **gateway})


def _consume(settings: Settings, expected: int, topic: str = "generations", timeout_s: float = 20.0) -> list:
    consumer = make_bus(settings).consumer(f"check-{time.monotonic_ns()}", [settings.topic(topic)])
    reassembler = Reassembler()
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expected and time.monotonic() < deadline:
            for record in consumer.poll(0.2):
                whole = reassembler.feed(record)
                if whole is not None:
                    out.append(whole)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            out.extend(r for r in map(reassembler.feed, consumer.poll(0.1)) if r is not None)
    finally:
        consumer.close()
    return out


def _wait(condition, what: str, timeout_s: float = 20.0) -> None:
    wait_for(what, condition, timeout_s, 0.02, ignore=(), error=AssertionError)


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.mark.parametrize("ack", ["written", "fsynced", "bus"])
def test_capture_ships_in_order_under_each_ack_mode(tmp_path: Path, ack: str) -> None:
    settings = _settings(tmp_path, capture_ack=ack, ship_batch=7)
    registry = CollectorRegistry()
    capture = Capture(settings, Switch(settings), registry)
    capture.start()
    _wait(lambda: capture.depth()["bus_up"], "the idle start to find the bus up")
    topic = settings.topic("generations")

    async def load() -> list[bool]:
        return await asyncio.gather(*(capture.submit(_items(2, 2 * i, topic)) for i in range(50)))

    assert asyncio.run(load()) == [True] * 50
    if ack == "bus":
        assert capture.spool.cursor == 100  # every submit returned after its acknowledgement
    _wait(lambda: capture.depth()["events"] == 0, "the spool to drain")
    capture.close(5.0)
    got = _consume(settings, 100)
    by_key: dict[str, list[int]] = {}
    for record in got:
        by_key.setdefault(record.key, []).append(int(record.headers["event_id"][1:]))
    assert sorted(i for seq in by_key.values() for i in seq) == list(range(100))
    assert all(seq == sorted(seq) for seq in by_key.values())  # per-key order kept
    assert _metric(registry, "flywheel_capture_spooled_total", topic=topic) == 100
    assert _metric(registry, "flywheel_capture_shipped_total", topic=topic) == 100
    assert _metric(registry, "flywheel_bus_up") == 1 and _metric(registry, "flywheel_spool_events") == 0
    assert _metric(registry, "flywheel_capture_ship_latency_seconds_count") == 100


def test_an_outage_keeps_serving_then_replays_in_order_and_a_restart_replays_the_rest(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    switch = Switch(settings)
    switch.up = False
    registry = CollectorRegistry()
    capture = Capture(settings, switch, registry)
    capture.start()
    topic = settings.topic("generations")

    async def submit(target: Capture, start: int, n: int) -> list[bool]:
        return [await target.submit(_items(1, i, topic)) for i in range(start, start + n)]

    assert asyncio.run(submit(capture, 0, 30)) == [True] * 30  # served while the bus is down
    _wait(lambda: switch.calls >= 2, "retries")
    depth = capture.depth()
    assert depth["events"] == 30 and not depth["bus_up"] and depth["oldest_age_s"] >= 0
    assert _metric(registry, "flywheel_bus_up") == 0
    capture.close(1.0)  # the bus is down: nothing to wait for, everything stays spooled

    registry = CollectorRegistry()
    again = Capture(settings, switch, registry)
    again.start()
    assert again.depth()["events"] == 30
    asyncio.run(submit(again, 30, 10))
    calls = switch.calls
    _wait(lambda: switch.calls > calls, "a retry that fails after the last submit")
    switch.up = True
    _wait(lambda: again.depth()["events"] == 0, "the replay", timeout_s=30)
    again.close(5.0)
    got = _consume(settings, 40)
    ids = [int(r.headers["event_id"][1:]) for r in got]
    assert sorted(ids) == list(range(40))
    for key in {r.key for r in got}:
        seq = [int(r.headers["event_id"][1:]) for r in got if r.key == key]
        assert seq == sorted(seq)
    assert _metric(registry, "flywheel_capture_replayed_total") == 40
    assert (spool_dir(settings) / "cursor.json").read_text() == '{"offset": 40}'


@pytest.mark.parametrize("policy", ["drop", "reject"])
def test_a_full_spool_applies_its_policy_and_recovers(tmp_path: Path, policy: str) -> None:
    settings = _settings(tmp_path, spool_max_bytes=1 << 16, spool_full=policy)
    switch = Switch(settings)
    switch.up = False
    registry = CollectorRegistry()
    capture = Capture(settings, switch, registry)
    capture.start()
    topic = settings.topic("generations")
    big = [(topic, "k", os.urandom(5000), {"event_id": "x"})]

    async def fill() -> tuple[int, int]:
        accepted = refused = 0
        for _ in range(40):
            try:
                capture.admit()
            except CaptureFull:
                refused += 1
                continue
            try:
                if await capture.submit(big):
                    accepted += 1
                else:
                    refused += 1
            except CaptureFull:
                refused += 1
        return accepted, refused

    accepted, refused = asyncio.run(fill())
    frame = len(encode_frame(0, "k", big[0][2], {"event_id": "x", "spool.topic": topic}, 0))
    assert accepted == -(-(1 << 16) // frame) and refused == 40 - accepted  # the last one may overshoot
    if policy == "drop":
        assert _metric(registry, "flywheel_capture_dropped_total", reason="full") == refused
        assert capture.depth()["dropped"] == refused
    else:
        with pytest.raises(CaptureFull, match="full"):
            capture.admit()
        assert _metric(registry, "flywheel_capture_dropped_total", reason="full") == 0
    switch.up = True
    _wait(lambda: capture.depth()["events"] == 0, "the spool to drain")
    capture.admit()  # room again
    assert asyncio.run(capture.submit(big)) is True
    capture.close(5.0)
    assert len(_consume(settings, accepted + 1)) == accepted + 1


_FSIZE = textwrap.dedent(
    """
    import asyncio, json, resource, signal, sys
    from prometheus_client import CollectorRegistry
    from flywheel.bus import make_bus
    from flywheel.settings import load_settings
    from serving.gateway.shipper import Capture, CaptureFull
    import serving.gateway.shipper as shipper

    shipper.BROKEN_RETRY_S = 0.2
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    data_dir, policy = sys.argv[1], sys.argv[2]
    settings = load_settings(data_dir=data_dir, bus={"kind": "local", "topic_prefix": "t."},
                             gateway={"spool_full": policy})
    registry = CollectorRegistry()
    capture = Capture(settings, lambda: make_bus(settings).producer(), registry)
    capture.start()
    topic = settings.topic("generations")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    async def main():
        out = []
        async def one(i, size=2000):
            try:
                capture.admit()
                out.append(await capture.submit([(topic, "k", bytes([i % 256]) * size, {"event_id": str(i)})]))
            except CaptureFull as exc:
                out.append("refused")
        for i in range(3):
            await one(i)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, hard))  # the spool segment is past 6 KB
        for i in range(3, 6):
            await one(i)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        await asyncio.sleep(0.3)
        await one(6)
        return out

    out = asyncio.run(main())
    capture.close(5.0)
    dropped = registry.get_sample_value("flywheel_capture_dropped_total", {"reason": "write_error"})
    rejected = registry.get_sample_value("flywheel_capture_rejected_total", {"reason": "write_error"})
    print(json.dumps({"out": out, "dropped": dropped, "rejected": rejected}))
    """
)


@pytest.mark.parametrize("policy", ["drop", "reject"])
def test_write_errors_drop_or_reject_and_the_spool_stays_consistent(tmp_path: Path, policy: str) -> None:
    proc = _spawn(_FSIZE, tmp_path, policy)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    # 3 accepted; the 4th write crosses the limit (a short write, truncated away), the rest fail
    # or are refused while the spool is broken; after the limit is lifted writes work again.
    if policy == "drop":
        assert result["out"] == [True, True, True, False, False, False, True]
        assert result["dropped"] == 3
    else:
        assert result["out"][:4] == [True, True, True, "refused"] and result["out"][6] is True
        assert set(result["out"][4:6]) == {"refused"} and result["rejected"] >= 1
    settings = load_settings(data_dir=str(tmp_path), bus={"kind": "local", "topic_prefix": "t."})
    got = _consume(settings, 4)
    assert sorted(r.headers["event_id"] for r in got) == ["0", "1", "2", "6"]
    assert all(r.value == bytes([int(r.headers["event_id"]) % 256]) * 2000 for r in got)


def test_large_events_cross_the_bus_in_an_envelope(tmp_path: Path) -> None:
    settings = _settings(tmp_path, max_record_bytes=100_000)
    capture = Capture(settings, Switch(settings), CollectorRegistry())
    capture.start()
    topic = settings.topic("generations")
    values = [os.urandom(1_200_000), b"{" + b"1, " * 400_000 + b"}", b"small"]
    for i, value in enumerate(values):
        assert asyncio.run(capture.submit([(topic, "k", value, {"event_id": str(i)})]))
    _wait(lambda: capture.depth()["events"] == 0, "the spool to drain")
    capture.close(5.0)
    got = _consume(settings, 3)
    assert [hashlib.sha256(r.value).hexdigest() for r in got] == [hashlib.sha256(v).hexdigest() for v in values]
    assert all(set(r.headers) == {"event_id"} for r in got)


def test_submit_does_not_block_the_event_loop_while_the_bus_hangs(tmp_path: Path) -> None:
    settings = _settings(tmp_path, ship_timeout_s=5.0)
    release = threading.Event()

    def hanging_factory():
        release.wait(30)  # a broker that never answers
        raise BusError("gave up")

    capture = Capture(settings, hanging_factory, CollectorRegistry())
    capture.start()
    topic = settings.topic("generations")

    async def timed() -> float:
        worst = 0.0
        for i in range(200):
            start = time.perf_counter()
            assert await capture.submit(_items(1, i, topic))
            worst = max(worst, time.perf_counter() - start)
        return worst

    try:
        assert asyncio.run(timed()) < 0.05
        assert capture.depth()["events"] == 200
    finally:
        release.set()
        capture.close(1.0)


def test_a_cursor_that_cannot_be_saved_never_stops_shipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The chaos suite's spool_disk_full: ENOSPC on cursor.json used to kill the shipper thread, and
    the gateway went on answering and spooling with nothing reaching the bus until a restart."""
    import serving.gateway.spool as spool_module

    real_write = spool_module.write_atomic
    disk = {"full": True, "failed": 0}

    def write_atomic(path: Path, data: bytes) -> None:
        if disk["full"]:
            disk["failed"] += 1
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(spool_module, "write_atomic", write_atomic)
    settings = _settings(tmp_path)
    capture = Capture(settings, Switch(settings), CollectorRegistry())
    capture.start()
    topic = settings.topic("generations")
    for i in range(5):
        assert asyncio.run(capture.submit(_items(4, 4 * i, topic)))
        _wait(lambda: capture.depth()["events"] == 0, "the spool to drain while its cursor cannot be saved")
        time.sleep(spool_module.CURSOR_INTERVAL_S)
    assert disk["failed"] >= 2 and capture._shipper.is_alive()
    assert sum("cannot save the cursor" in r.getMessage() for r in caplog.records) == 1  # once per outage
    assert not (capture.spool.dir / "cursor.json").exists()

    disk["full"] = False
    assert asyncio.run(capture.submit(_items(4, 20, topic)))
    _wait(lambda: capture.depth()["events"] == 0, "the spool to drain after the disk has room again")
    capture.close(5.0)
    assert json.loads((capture.spool.dir / "cursor.json").read_text()) == {"offset": 24}
    got = _consume(settings, 24)
    assert sorted(int(r.headers["event_id"][1:]) for r in got) == list(range(24))
