"""The local log's framing, crash recovery and cross-process behaviour (real files, real processes)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from kafka.partitioner.default import murmur2 as kafka_murmur2

from flywheel.bus.base import murmur2, partition_for_key
from flywheel.bus.locallog import CorruptLogError, LocalLogBus, LocalLogConsumer, encode_frame, scan
from testbed.procs import wait_for

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _drain(consumer: LocalLogConsumer, expected: int, timeout_s: float = 20.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        out.extend(consumer.poll(0.2))
    return out


def _random_record(rng: random.Random) -> tuple[str | None, bytes, dict[str, str]]:
    key = None if rng.random() < 0.2 else "".join(rng.choice("abcé€😀-_") for _ in range(rng.randint(0, 12)))
    value = rng.randbytes(rng.choice([0, 1, 7, 300, 70_000]))
    headers = {f"h{i}": "".join(rng.choice("xyzé") for _ in range(rng.randint(0, 5))) for i in range(rng.randint(0, 3))}
    return key, value, headers


def test_murmur2_matches_kafka_default_partitioner() -> None:
    rng = random.Random()
    for _ in range(500):
        data = rng.randbytes(rng.randint(0, 64))
        assert murmur2(data) == kafka_murmur2(data)
    key = uuid.uuid4().hex
    assert partition_for_key(key, 7) == (kafka_murmur2(key.encode()) & 0x7FFFFFFF) % 7


def test_frames_round_trip(tmp_path: Path) -> None:
    rng = random.Random()
    records = [_random_record(rng) for _ in range(60)]
    path = tmp_path / "0.log"
    path.write_bytes(b"".join(encode_frame(i, k, v, h, 1_700_000_000_000 + i) for i, (k, v, h) in enumerate(records)))
    fd = os.open(path, os.O_RDONLY)
    try:
        found = scan(fd, 0, 0, max_records=None, path=str(path))
    finally:
        os.close(fd)
    assert not found.torn and found.position == path.stat().st_size and found.next_offset == len(records)
    assert [(d.offset, d.key, d.value, d.headers) for d, _ in found.frames] == [
        (i, k, v, h) for i, (k, v, h) in enumerate(records)
    ]


def _one_partition_bus(tmp_path: Path) -> LocalLogBus:
    return LocalLogBus(tmp_path / "bus", partitions=1)


@pytest.mark.parametrize("tail", ["partial frame", "zero fill", "bad last frame"])
def test_torn_tail_is_ignored_then_truncated(tmp_path: Path, tail: str) -> None:
    bus = _one_partition_bus(tmp_path)
    producer = bus.producer()
    for i in range(5):
        producer.send("t", "k", f"v{i}".encode())
    producer.close()
    log_path = bus.topic_dir("t") / "0.log"
    good_size = log_path.stat().st_size
    frame = encode_frame(5, "k", b"lost in the crash", {}, 0)
    with open(log_path, "ab") as f:  # what a crash mid-append leaves behind
        if tail == "partial frame":
            f.write(frame[: len(frame) // 2])
        elif tail == "zero fill":
            f.write(bytes(len(frame)))
        else:
            f.write(frame[:-1] + bytes([frame[-1] ^ 0xFF]))

    consumer = bus.consumer("g", ["t"])
    got = _drain(consumer, 5)
    assert [r.value for r in got] == [f"v{i}".encode() for i in range(5)]
    assert consumer.poll(0.3) == []  # the torn bytes are not a record

    producer = LocalLogBus(tmp_path / "bus", partitions=1).producer()  # a restarted writer
    producer.send("t", "k", b"after restart")
    producer.close()
    assert log_path.stat().st_size == good_size + len(encode_frame(5, "k", b"after restart", {}, 0))
    after = _drain(consumer, 1)
    assert [(r.offset, r.value) for r in after] == [(5, b"after restart")]
    consumer.close()


def test_crc_corruption_in_the_middle_is_detected(tmp_path: Path) -> None:
    bus = _one_partition_bus(tmp_path)
    producer = bus.producer()
    for i in range(5):
        producer.send("t", "k", f"value-{i}".encode() * 10)
    producer.close()
    log_path = bus.topic_dir("t") / "0.log"
    data = bytearray(log_path.read_bytes())
    frame_len = len(data) // 5
    data[2 * frame_len + frame_len // 2] ^= 0x01  # one bit of record 2's payload
    log_path.write_bytes(bytes(data))

    consumer = bus.consumer("g", ["t"])
    with pytest.raises(CorruptLogError, match="crc32 mismatch"):
        _drain(consumer, 5)
    consumer.close()
    with pytest.raises(CorruptLogError):  # and a writer refuses to append after damage
        writer = LocalLogBus(tmp_path / "bus", partitions=1).producer()
        try:
            writer.send("t", "k", b"more")
        finally:
            writer.close()


def test_committed_offset_survives_and_seeks_without_rescan(tmp_path: Path) -> None:
    bus = _one_partition_bus(tmp_path)
    producer = bus.producer()
    for i in range(10):
        producer.send("t", "k", f"v{i}".encode())
    consumer = bus.consumer("g", ["t"])
    got = _drain(consumer, 10)
    consumer.commit(got[:4])
    consumer.close()
    stored = json.loads((tmp_path / "bus" / "groups" / "g" / "t" / "0.offset").read_text())
    assert stored["offset"] == 4 and stored["position"] > 0
    # Damage an already-committed record: a consumer that seeks to the stored position never
    # reads it, one that rescanned from the start would raise CorruptLogError.
    log_path = bus.topic_dir("t") / "0.log"
    data = bytearray(log_path.read_bytes())
    data[len(data) // 10 + 12] ^= 0xFF  # inside frame 1 (ten equal frames)
    log_path.write_bytes(bytes(data))
    consumer = LocalLogBus(tmp_path / "bus", partitions=1).consumer("g", ["t"])
    assert [r.offset for r in _drain(consumer, 6)] == list(range(4, 10))
    consumer.close()
    producer.close()
    with pytest.raises(CorruptLogError):  # the damage is real: a fresh group scanning from 0 sees it
        other = bus.consumer("fresh", ["t"])
        try:
            _drain(other, 10)
        finally:
            other.close()


_PRODUCER = textwrap.dedent(
    """
    import sys
    from flywheel.bus.locallog import LocalLogBus
    root, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    producer = LocalLogBus(root, partitions=3).producer()
    for i in range(n):
        producer.send("t", f"key-{i % 5}", f"{name}:{i}".encode(), {"from": name})
    producer.close()
    """
)

_CONSUMER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from flywheel.bus.locallog import LocalLogBus
    root, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    consumer = LocalLogBus(root, partitions=3).consumer("workers", ["t"])
    with open(out, "a") as f:
        while not stop.exists():
            batch = consumer.poll(0.1)
            for r in batch:
                f.write(json.dumps({"p": r.partition, "o": r.offset, "v": r.value.decode()}) + "\\n")
            f.flush()
            consumer.commit(batch)
            Path(str(out) + ".owned").write_text(json.dumps(sorted(p for _, p in consumer.assignment())))
    consumer.close()
    """
)


def _spawn(code: str, *args: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=env)


def test_cross_process_producers_and_consumer(tmp_path: Path) -> None:
    root = tmp_path / "bus"
    bus = LocalLogBus(root, partitions=3)
    consumer = bus.consumer("reader", ["t"])  # consumes while two other processes append
    assert consumer.poll(0.1) == []
    procs = [_spawn(_PRODUCER, root, name, 150) for name in ("p1", "p2")]
    got = _drain(consumer, 300, timeout_s=60)
    for proc in procs:
        assert proc.wait(30) == 0
    consumer.close()

    assert len(got) == 300
    by_partition: dict[int, list[int]] = {}
    for record in got:
        by_partition.setdefault(record.partition, []).append(record.offset)
        name, i = record.value.decode().split(":")
        assert record.headers == {"from": name}
        assert record.partition == partition_for_key(f"key-{int(i) % 5}", 3)
    for offsets in by_partition.values():  # no gaps, no duplicates across concurrent appenders
        assert offsets == list(range(len(offsets)))
    for name in ("p1", "p2"):  # each producer's per-key order survives the interleaving
        for k in range(5):
            seq = [int(r.value.decode().split(":")[1]) for r in got if r.value.decode().startswith(name) and r.key == f"key-{k}"]
            assert seq == sorted(seq) and len(seq) == 30


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _owned(path: Path) -> list[int] | None:
    try:
        return json.loads(Path(str(path) + ".owned").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    wait_for(what, condition, timeout_s, 0.05, ignore=(), error=AssertionError)


def test_group_members_in_two_processes_split_and_fail_over(tmp_path: Path) -> None:
    root = tmp_path / "bus"
    bus = LocalLogBus(root, partitions=3)
    bus.ensure_topics(["t"])
    stop = tmp_path / "stop"
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    procs = [_spawn(_CONSUMER, root, out, stop) for out in outs]
    try:

        def split() -> bool:
            a, b = _owned(outs[0]), _owned(outs[1])
            return bool(a) and bool(b) and not set(a) & set(b) and sorted(a + b) == [0, 1, 2]

        _wait(split, "two processes to split the partitions")
        producer = bus.producer()
        for i in range(90):
            producer.send("t", f"key-{i}", f"v{i}".encode())
        _wait(lambda: sum(len(_read_lines(o)) for o in outs) >= 90, "all records consumed")
        time.sleep(0.5)
        a, b = (_read_lines(o) for o in outs)
        seen_a, seen_b = {(r["p"], r["o"]) for r in a}, {(r["p"], r["o"]) for r in b}
        assert len(seen_a) == len(a) and len(seen_b) == len(b)
        assert not seen_a & seen_b and len(seen_a | seen_b) == 90 and seen_a and seen_b

        # A crashed member (SIGKILL: no close, no cleanup) loses its partitions at once.
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        _wait(lambda: _owned(outs[0]) == [0, 1, 2], "the survivor to take every partition")
        for i in range(30):
            producer.send("t", f"key-{i}", f"w{i}".encode())
        producer.close()
        _wait(lambda: sum(r["v"].startswith("w") for r in _read_lines(outs[0])) >= 30, "survivor gets new records")
    finally:
        stop.touch()
        for proc in procs:
            if proc.poll() is None:
                proc.wait(20)
    assert procs[0].returncode == 0


_SENDER_NO_FLUSH = textwrap.dedent(
    """
    import sys, time
    from flywheel.bus.locallog import LocalLogBus
    producer = LocalLogBus(sys.argv[1], partitions=2).producer()
    for i in range(int(sys.argv[2])):
        producer.send("t", f"k{i % 7}", b"%d" % i)
    print("sent", flush=True)
    time.sleep(60)  # killed before any flush
    """
)


def test_send_is_visible_at_once_and_survives_a_killed_producer_flush_syncs(tmp_path: Path) -> None:
    root = tmp_path / "bus"
    proc = subprocess.Popen([sys.executable, "-c", _SENDER_NO_FLUSH, str(root), "500"], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    consumer = LocalLogBus(root, partitions=2).consumer("g", ["t"])
    got = _drain(consumer, 500)
    consumer.close()
    assert sorted(int(r.value) for r in got) == list(range(500))

    producer = LocalLogBus(root, partitions=2).producer()
    producer.send("t", "k", b"x")
    writers = list(producer._writers.values())
    assert any(w.dirty for w in writers)  # written, not yet fsync'd
    producer.flush()
    assert not any(w.dirty for w in writers)  # one fsync per partition file, per flush
    producer.close()
