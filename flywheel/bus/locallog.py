"""The embedded bus: a durable, append-only log on the local file system, shared by processes.

Layout under the bus directory (``settings.bus_log_path``)::

    topics/<topic>/meta.json            {"partitions": N}, created once, atomically (link)
    topics/<topic>/<p>.log              the partition's first segment: frames, offsets 0, 1, 2, ...
    topics/<topic>/<p>.<base>.log       its later segments, each from offset <base> on (segments.py)
    groups/<group>/members/<id>.member  one per live consumer; alive while its flock is held
    groups/<group>/<topic>/<p>.owner    flock held by the one consumer that owns the partition
    groups/<group>/<topic>/<p>.offset   committed {"offset", "position"}, replaced atomically

Frames are ``flywheel.bus.frames``'s (length, crc32, offset, timestamp, key, headers, value); the
offset inside a frame must equal its segment's base plus the frame's index in the file.
Segments roll and expire as ``flywheel.bus.segments`` says: a writer rolls the segment it appends
to (by size, or by its first record's age), the ``janitor`` role deletes expired ones
(:meth:`LocalLogBus.expire`). A log written before segments existed is one segment of base 0.

Invariants and semantics:

- Appends are serialised across processes by an exclusive ``flock`` on the log file and are one
  ``write`` each. ``Producer.send`` returns after the frame is written: it survives a crash of the
  producing process at once, and a reader sees it at once. ``Producer.flush`` ``fsync``s every
  partition file this producer wrote since its last flush (group commit: one ``fsync`` per file
  per batch, not per record): every record sent before it is durable (survives a machine crash)
  when ``flush`` returns. ``close`` flushes.
- A crash mid-append leaves a torn tail: an incomplete frame, or a complete one that fails its
  checks and reaches the end of the file (or is followed only by zero bytes). Readers stop before
  it and wait; the next writer, holding the lock, truncates it before appending. A bad frame with
  good data after it cannot come from a crash: reading it raises :class:`CorruptLogError`.
- Partition of a key: Kafka's default partitioner (``base.partition_for_key``).
- Consumer groups: a consumer holds a member file lock; the live members (sorted by join time)
  split the ``(topic, partition)`` pairs round robin; a consumer reads a partition only while it
  holds that partition's owner lock, so no two consumers of a group read one partition at once,
  even when their views of the membership briefly differ. Ownership is re-evaluated only inside
  ``poll`` (at most every ``REBALANCE_INTERVAL_S``); a crashed process loses its locks at once.
  Members of one group are expected to subscribe to the same topics.
- ``commit`` writes ``offset = last + 1``, the byte position after that record and the base of its
  segment (``segment``; absent in files written before segments: 0) to a temporary
  file, ``fsync``s it, ``os.replace``s it into place and ``fsync``s the directory: durable when
  ``commit`` returns. A new owner starts at the committed offset (seeking straight to the stored
  position in its segment after checking the frame there; scanning that segment once if the check
  fails), or at the partition's first offset; a committed offset whose segment expired starts at the
  oldest segment kept (the records in between are gone), as does a reader whose segment was deleted.
- ``rewind`` puts every owned partition back at its committed offset (and byte position), as a new
  owner would start; the owner and member locks are kept, so no partition moves.
- Topics are created on first ``send`` or by ``ensure_topics`` with the bus's partition count;
  an existing topic keeps the count it was created with.
- ``lag`` reads a group's ``<p>.offset`` files as a new owner would (0 where none) and counts the
  good frames of each partition's newest segment from its base (its log end; a torn tail does not
  count, as readers stop before it); a committed offset below the oldest segment counts from there.
  It takes no file lock and creates nothing, so members are not disturbed. The bus remembers where
  each partition's count ended, so a later ``lag`` scans only what was appended since.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.bus.base import BusError, Record, dead_letter_headers, dlq_topic, partition_for_key
from flywheel.bus.frames import CorruptLogError, encode_frame, fsync_dir, scan, try_lock, write_atomic
from flywheel.bus.segments import (
    SEGMENT_BYTES,
    create,
    end_of,
    expire,
    first_timestamp_ms,
    open_for_append,
    scan_kept,
    segment_bases,
    segment_path,
    segment_s_for,
    taken_away,
)

__all__ = ["CorruptLogError", "LocalLogBus", "LocalLogConsumer", "LocalLogProducer", "encode_frame", "scan"]

log = logging.getLogger(__name__)

#: How often a consumer looks at the group membership (inside ``poll``).
REBALANCE_INTERVAL_S = 0.2
#: Sleep between looks for new data while ``poll`` waits.
POLL_INTERVAL_S = 0.02
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
#: Uncommitted record end positions remembered per partition (older ones fall back to a scan).
_MAX_TRACKED = 100_000


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"invalid {kind} name {name!r}: use 1-249 of [A-Za-z0-9._-]")
    return name


# The bus -----------------------------------------------------------------------------------------


class LocalLogBus:
    """Factory for producers and consumers over one bus directory."""

    def __init__(self, root: str | os.PathLike[str], partitions: int = 4, *, retention_s: float | None = None,
                 segment_bytes: int = SEGMENT_BYTES, segment_s: float | None = None) -> None:
        """``retention_s``: what :meth:`expire` keeps (None: everything); a segment rolls at
        ``segment_bytes`` or ``segment_s`` (default: from the retention, ``segments.segment_s_for``)."""
        if partitions < 1:
            raise ValueError("partitions must be at least 1")
        self.root = Path(root)
        self.partitions = partitions
        self.retention_s = retention_s
        self.segment_bytes = segment_bytes
        self.segment_s = segment_s if segment_s is not None else segment_s_for(retention_s)
        self._counts: dict[str, int] = {}
        self._ends: dict[tuple[str, int], tuple[int, int, int]] = {}  # (segment, position, next offset) so far
        self._ends_lock = threading.Lock()
        (self.root / "topics").mkdir(parents=True, exist_ok=True)
        (self.root / "groups").mkdir(parents=True, exist_ok=True)

    # topics
    def topic_dir(self, topic: str) -> Path:
        return self.root / "topics" / _check_name("topic", topic)

    def partition_count(self, topic: str, *, create: bool) -> int | None:
        """Partitions of ``topic``; creates the topic when ``create``; None if absent."""
        if topic in self._counts:
            return self._counts[topic]
        meta = self.topic_dir(topic) / "meta.json"
        if not meta.exists():
            if not create:
                return None
            meta.parent.mkdir(parents=True, exist_ok=True)
            tmp = meta.with_name(f".meta.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps({"partitions": self.partitions}))
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, meta)  # atomic create-if-absent: the first creator wins
            except FileExistsError:
                pass  # another process created it first; its count is the topic's count
            finally:
                tmp.unlink()
            fsync_dir(meta.parent)
            fsync_dir(meta.parent.parent)
        count = int(json.loads(meta.read_text())["partitions"])
        self._counts[topic] = count
        return count

    def ensure_topics(self, topics: Sequence[str]) -> None:
        for topic in topics:
            self.partition_count(topic, create=True)

    def producer(self, *, timeout_s: float | None = None) -> LocalLogProducer:
        """A producer; ``timeout_s`` is accepted for the interface (local files never wait on a peer)."""
        return LocalLogProducer(self)

    def consumer(self, group: str, topics: Sequence[str], client_id: str | None = None) -> LocalLogConsumer:
        return LocalLogConsumer(self, group, topics, client_id=client_id)

    def lag(self, group: str, topics: Sequence[str]) -> dict[str, int]:
        """Per topic, the records ``group`` has not committed (see the module docstring)."""
        group_dir = self.root / "groups" / _check_name("group", group)
        out: dict[str, int] = {}
        try:
            for topic in dict.fromkeys(topics):
                total = 0
                for partition in range(self.partition_count(topic, create=False) or 0):
                    committed = _read_committed(group_dir / topic / f"{partition}.offset")[0]
                    first, end = self._log_end(topic, partition)
                    total += max(0, end - max(committed, first))
                out[topic] = total
        except (OSError, ValueError, KeyError) as exc:
            raise BusError(f"cannot read the lag of group {group!r}: {exc}") from exc
        return out

    def _log_end(self, topic: str, partition: int) -> tuple[int, int]:
        """The partition's first offset kept and the offset the next record appended gets."""
        directory = self.topic_dir(topic)
        with self._ends_lock:
            for _ in range(3):  # the newest segment listed may be sealed and erased meanwhile
                bases = segment_bases(directory, partition)
                if not bases:
                    return 0, 0
                base, path = bases[-1], segment_path(directory, partition, bases[-1])
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    known, position, next_offset = self._ends.get((topic, partition), (base, 0, base))
                    if known != base or os.fstat(fd).st_size < position:  # a new segment (or a replaced file)
                        position, next_offset = 0, base
                    try:
                        position, next_offset, _ = end_of(fd, base, path, position, next_offset)
                    except CorruptLogError:
                        if not taken_away(fd, path):
                            raise
                        continue  # sealed and being erased meanwhile: list again
                finally:
                    os.close(fd)
                self._ends[(topic, partition)] = (base, position, next_offset)
                return bases[0], next_offset
            raise BusError(f"{directory}: partition {partition}'s segments kept changing while counted")

    def expire(self, retention_s: float | None = None, now: float | None = None) -> dict[str, int]:
        """Delete every partition's segments older than ``retention_s`` (default: the bus's), as
        ``flywheel.bus.segments.expire`` says; how many segments and bytes went."""
        retention_s = self.retention_s if retention_s is None else retention_s
        out = {"segments": 0, "bytes": 0}
        if retention_s is None:
            return out
        topics = self.root / "topics"
        for topic in sorted(os.listdir(topics)):
            for partition in range(self.partition_count(topic, create=False) or 0):
                segments, erased = expire(topics / topic, partition, retention_s, now)
                out["segments"] += segments
                out["bytes"] += erased
        if out["segments"]:
            log.info("local bus: %d expired segments erased (%d bytes)", out["segments"], out["bytes"])
        return out

    def close(self) -> None:
        """Nothing is held by the bus itself; producers and consumers close their own files."""


class _Writer:
    """Append end of one partition, owned by one producer: its newest segment, rolled as it fills."""

    def __init__(self, bus: LocalLogBus, directory: Path, partition: int) -> None:
        self.bus, self.dir, self.partition = bus, directory, partition
        bases = segment_bases(directory, partition)
        self._open(bases[-1] if bases else 0)
        self.dirty = False

    def _open(self, base: int) -> None:
        self.fd, self.base, self.path = open_for_append(self.dir, self.partition, base)
        self.position, self.next_offset = 0, self.base
        self.first_ms: int | None = None

    def _switch(self, base: int) -> None:
        """Leave the current segment (synced if written) for segment ``base``."""
        self.sync()
        os.close(self.fd)
        self._open(base)

    def _full(self, size: int, now_ms: int) -> bool:
        """Whether the segment should roll before the next append (segments.py)."""
        if self.next_offset == self.base:
            return False  # an empty segment never rolls
        if size >= self.bus.segment_bytes:
            return True
        if self.bus.segment_s is None:
            return False
        if self.first_ms is None:
            self.first_ms = first_timestamp_ms(self.fd, self.base, self.path)
        return self.first_ms is not None and now_ms - self.first_ms >= self.bus.segment_s * 1000

    def append(self, key: str | None, value: bytes, headers: dict[str, str]) -> int:
        while True:
            switch_to: int | None = None
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                stat = os.fstat(self.fd)
                if stat.st_nlink == 0:  # expired and erased (segments.py): go on in the newest segment
                    switch_to = segment_bases(self.dir, self.partition)[-1]
                    continue
                size = stat.st_size
                if size < self.position:  # cannot happen unless the file was replaced: start over
                    self.position, self.next_offset = 0, self.base
                if size != self.position:
                    found = scan(self.fd, self.position, self.next_offset, max_records=None, path=str(self.path))
                    self.position, self.next_offset = found.position, found.next_offset
                    if found.torn:
                        # We hold the append lock, so no writer is mid-append: this is a crashed one's tail.
                        log.warning("truncating torn tail of %s at byte %d", self.path, self.position)
                        os.ftruncate(self.fd, self.position)
                now_ms = int(time.time() * 1000)
                if self.next_offset != self.base and segment_path(self.dir, self.partition, self.next_offset).exists():
                    switch_to = self.next_offset  # sealed by another writer or the janitor
                    continue
                if self._full(self.position, now_ms):
                    os.fsync(self.fd)
                    create(self.dir, self.partition, self.next_offset)  # seals this segment
                    switch_to = self.next_offset
                    continue
                offset = self.next_offset
                frame = encode_frame(offset, key, value, headers, now_ms)
                written = os.write(self.fd, frame)
                if written != len(frame):
                    raise BusError(f"{self.path}: short write ({written} of {len(frame)} bytes)")
                self.position += len(frame)
                self.next_offset += 1
                self.dirty = True
                if self.first_ms is None and offset == self.base:
                    self.first_ms = now_ms
                return offset
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                if switch_to is not None:
                    self._switch(switch_to)

    def sync(self) -> None:
        if self.dirty:
            os.fsync(self.fd)
            self.dirty = False

    def close(self) -> None:
        os.close(self.fd)


class LocalLogProducer:
    """``send`` writes (visible, survives a killed process); ``flush`` fsyncs what was sent (durable)."""

    def __init__(self, bus: LocalLogBus) -> None:
        self._bus = bus
        self._writers: dict[tuple[str, int], _Writer] = {}
        self._round_robin = itertools.count()
        self._closed = False

    def send(self, topic: str, key: str | None, value: bytes, headers: dict[str, str] | None = None) -> None:
        if self._closed:
            raise BusError("producer is closed")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("value must be bytes")
        count = self._bus.partition_count(topic, create=True)
        assert count is not None
        partition = partition_for_key(key, count) if key is not None else next(self._round_robin) % count
        writer = self._writers.get((topic, partition))
        if writer is None:
            writer = _Writer(self._bus, self._bus.topic_dir(topic), partition)
            self._writers[(topic, partition)] = writer
        writer.append(key, bytes(value), dict(headers or {}))

    def flush(self, timeout_s: float | None = None) -> None:
        """``fsync`` every partition file written since the last flush (``timeout_s`` is not needed:
        a local ``fsync`` either completes or raises)."""
        for writer in self._writers.values():
            writer.sync()

    def close(self, timeout_s: float | None = None) -> None:
        try:
            if not self._closed:
                self.flush()
        finally:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
            self._closed = True


@dataclass
class _Owned:
    """One partition this consumer owns: its owner lock, read position and uncommitted ends."""

    topic: str
    partition: int
    owner_fd: int
    log_dir: Path
    offset_path: Path
    log_fd: int | None = None
    base: int = 0  # the segment ``log_fd`` reads
    position: int = 0
    next_offset: int = 0
    seeked: bool = False
    committed: tuple[int, int | None, int] = (0, 0, 0)  # offset, position, segment
    ends_base: int = 0
    ends: list[tuple[int, int]] = field(default_factory=list)  # (segment, position) after each record read

    @property
    def log_path(self) -> Path:
        return segment_path(self.log_dir, self.partition, self.base)

    def sealed(self) -> bool:
        """Whether the segment read is complete: its successor exists (segments.py)."""
        return self.next_offset != self.base and segment_path(self.log_dir, self.partition, self.next_offset).exists()

    def close_log(self) -> None:
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None

    def close(self) -> None:
        self.close_log()
        os.close(self.owner_fd)  # releases the owner lock


class _Membership:
    """This consumer's presence in a group: a member file whose flock is held while alive."""

    def __init__(self, directory: Path, client_id: str | None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        tag = re.sub(r"[^A-Za-z0-9_-]", "_", client_id or "c")[:40]
        self.member_id = f"{time.time_ns():020d}-{tag}-{uuid.uuid4().hex[:8]}"
        tmp = directory / f".tmp-{self.member_id}"
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Renamed only once locked, so a member file without a held lock belongs to a dead member.
        self.path = directory / f"{self.member_id}.member"
        os.rename(tmp, self.path)

    def live_members(self) -> list[str]:
        live = []
        for name in os.listdir(self.dir):
            path = self.dir / name
            if name.endswith(".member"):
                member = name[: -len(".member")]
                if member == self.member_id:
                    live.append(member)
                    continue
                try:
                    fd = try_lock(path, create=False)
                except FileNotFoundError:
                    continue  # it just left
                if fd is None:
                    live.append(member)
                    continue
                try:
                    path.unlink(missing_ok=True)  # its process is gone
                finally:
                    os.close(fd)
            elif name.startswith(".tmp-") and time.time() - _mtime(path) > 60:
                try:
                    fd = try_lock(path, create=False)
                except FileNotFoundError:
                    continue
                if fd is not None:
                    path.unlink(missing_ok=True)
                    os.close(fd)
        if self.member_id not in live:  # our file vanished (directory wiped): we are still a member
            live.append(self.member_id)
        return sorted(live)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _read_committed(path: Path) -> tuple[int, int | None, int]:
    """A group's committed ``(offset, byte position, segment)`` of one partition; ``(0, 0, 0)`` where none."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return (0, 0, 0)
    position = None if data.get("position") is None else int(data["position"])
    return int(data["offset"]), position, int(data.get("segment", 0))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


class LocalLogConsumer:
    """A group member reading the partitions it owns; see the module docstring for semantics."""

    def __init__(self, bus: LocalLogBus, group: str, topics: Sequence[str], client_id: str | None = None) -> None:
        if not topics:
            raise ValueError("subscribe to at least one topic")
        self._bus = bus
        self.group = _check_name("group", group)
        self.topics = [_check_name("topic", t) for t in topics]
        self._group_dir = bus.root / "groups" / self.group
        self._member = _Membership(self._group_dir / "members", client_id)
        self._owned: dict[tuple[str, int], _Owned] = {}
        self._next_rebalance = 0.0
        self._rotation = 0
        self._dlq: LocalLogProducer | None = None
        self._closed = False

    # ownership -------------------------------------------------------------------------------

    def assignment(self) -> set[tuple[str, int]]:
        return set(self._owned)

    def caught_up(self, topic: str, partition: int) -> bool:
        state = self._owned.get((topic, partition))
        if state is None:
            return False
        if state.log_fd is None:
            return not segment_bases(state.log_dir, partition)  # no record was ever written there
        return state.seeked and os.fstat(state.log_fd).st_size <= state.position and not state.sealed()

    def _target(self) -> set[tuple[str, int]]:
        pairs = []
        for topic in self.topics:
            count = self._bus.partition_count(topic, create=False)
            pairs.extend((topic, p) for p in range(count or 0))
        members = self._member.live_members()
        me, n = members.index(self._member.member_id), len(members)
        return {pair for i, pair in enumerate(sorted(pairs)) if i % n == me}

    def _rebalance(self) -> None:
        target = self._target()
        for pair in sorted(set(self._owned) - target):
            self._owned.pop(pair).close()
            log.debug("group %s: %s released %s", self.group, self._member.member_id, pair)
        for topic, partition in sorted(target - set(self._owned)):
            state_dir = self._group_dir / topic
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = try_lock(state_dir / f"{partition}.owner")
            if fd is None:
                continue  # the previous owner has not let go yet; retry at the next rebalance
            owned = _Owned(topic, partition, fd, self._bus.topic_dir(topic), state_dir / f"{partition}.offset")
            owned.committed = _read_committed(owned.offset_path)
            owned.next_offset = owned.ends_base = owned.committed[0]
            self._owned[(topic, partition)] = owned
            log.debug("group %s: %s acquired %s", self.group, self._member.member_id, (topic, partition))

    def _open_log(self, owned: _Owned) -> bool:
        """Open the segment of the offset to read from, seeked there; False if it does not exist yet.

        Where: the committed offset (and its stored position, checked), or after a rewind the same;
        ``owned.next_offset`` once its segment was erased under the reader."""
        if owned.seeked:
            return owned.log_fd is not None
        offset, position, segment = owned.committed if owned.next_offset == owned.committed[0] else (
            owned.next_offset, None, -1)
        bases = segment_bases(owned.log_dir, owned.partition)
        if not bases:
            return False
        if offset < bases[0]:  # expired: the records in between are gone
            log.warning("group %s: %s offsets %d to %d expired before they were read", self.group,
                        (owned.topic, owned.partition), offset, bases[0] - 1)
            offset, position, segment = bases[0], 0, bases[0]
            owned.next_offset = owned.ends_base = offset
            owned.ends = []
        base = max(b for b in bases if b <= offset)
        owned.close_log()
        owned.base = base
        try:
            owned.log_fd = os.open(owned.log_path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # erased meanwhile: look again at the next read
        if offset == base:
            owned.position, owned.seeked = 0, True
            return True
        if segment == base and position is not None and self._position_holds(owned.log_fd, position, offset,
                                                                             owned.log_path):
            owned.position, owned.seeked = position, True
            return True
        # Scan the segment once from its start to find the offset.
        pos, nxt = 0, base
        while nxt < offset:
            found = scan_kept(owned.log_fd, pos, nxt, max_records=min(10_000, offset - nxt), path=owned.log_path)
            if found is None:
                return False  # being erased: look again at the next read
            if not found.frames:
                break  # fewer records than the offset (yet): wait at the end
            pos, nxt = found.position, found.next_offset
        if nxt < offset:
            return False
        owned.position, owned.seeked = pos, True
        return True

    @staticmethod
    def _position_holds(fd: int, position: int, offset: int, path: Path) -> bool:
        size = os.fstat(fd).st_size
        if position > size:
            return False
        if position == size:
            return position > 0  # at the end; a later frame there must carry ``offset`` (checked on read)
        found = scan_kept(fd, position, offset, max_records=1, path=path)
        if found is None:
            return False  # being erased since it was opened: the scan from its start says so too
        return bool(found.frames) or found.torn

    # the consumer API ------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Record]:
        if self._closed:
            raise BusError("consumer is closed")
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() >= self._next_rebalance:
                self._rebalance()
                self._next_rebalance = time.monotonic() + REBALANCE_INTERVAL_S
            records = self._read(max_records)
            remaining = deadline - time.monotonic()
            if records or remaining <= 0:
                return records
            time.sleep(min(POLL_INTERVAL_S, remaining))

    def _read(self, max_records: int) -> list[Record]:
        out: list[Record] = []
        owned = list(self._owned.values())
        if not owned:
            return out
        self._rotation = (self._rotation + 1) % len(owned)
        for state in owned[self._rotation :] + owned[: self._rotation]:
            if len(out) >= max_records:
                break
            if not self._open_log(state):
                continue
            assert state.log_fd is not None
            found = scan_kept(state.log_fd, state.position, state.next_offset, max_records=max_records - len(out),
                              path=state.log_path)
            if found is None:
                state.close_log()  # being erased under us (segments.erase): seek again (_open_log)
                state.seeked = False
                continue
            for decoded, end in found.frames:
                out.append(
                    Record(state.topic, state.partition, decoded.offset, decoded.key, decoded.value, decoded.headers)
                )
                state.ends.append((state.base, end))
            state.position, state.next_offset = found.position, found.next_offset
            if not found.frames:
                if state.sealed():  # on to the next segment (segments.py), read at the next look
                    state.close_log()
                    state.base, state.position = state.next_offset, 0
                    try:
                        state.log_fd = os.open(state.log_path, os.O_RDONLY)
                    except FileNotFoundError:  # already expired too: seek again (_open_log)
                        state.seeked = False
                elif taken_away(state.log_fd, state.log_path):  # erased under us: seek again (_open_log)
                    state.close_log()
                    state.seeked = False
            if len(state.ends) > _MAX_TRACKED:
                drop = len(state.ends) // 2
                del state.ends[:drop]
                state.ends_base += drop
        return out

    def rewind(self) -> None:
        if self._closed:
            raise BusError("consumer is closed")
        for state in self._owned.values():
            # This consumer is the partition's only committer, so ``committed`` is the file's content;
            # ``_open_log`` seeks there again on the next read.
            state.seeked = False
            state.next_offset = state.ends_base = state.committed[0]
            state.ends = []
            state.close_log()

    def commit(self, records: Sequence[Record]) -> None:
        last: dict[tuple[str, int], int] = {}
        for record in records:
            pair = (record.topic, record.partition)
            last[pair] = max(last.get(pair, -1), record.offset)
        for pair, offset in sorted(last.items()):
            state = self._owned.get(pair)
            if state is None:
                log.warning(
                    "group %s: not committing %s offset %d: partition no longer owned (redelivered to its owner)",
                    self.group,
                    pair,
                    offset,
                )
                continue
            index = offset - state.ends_base
            segment, position = 0, None
            if 0 <= index < len(state.ends):
                segment, position = state.ends[index]
                del state.ends[: index + 1]
                state.ends_base = offset + 1
            write_atomic(state.offset_path,
                         json.dumps({"offset": offset + 1, "position": position, "segment": segment}).encode())
            state.committed = (offset + 1, position, segment)

    def dead_letter(self, record: Record, reason: str) -> None:
        if self._dlq is None:
            self._dlq = LocalLogProducer(self._bus)
        self._dlq.send(dlq_topic(record.topic), record.key, record.value, dead_letter_headers(record, reason))
        self._dlq.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for state in self._owned.values():
            state.close()
        self._owned.clear()
        self._member.close()
        if self._dlq is not None:
            self._dlq.close()
