"""Samples in, batches out: the trainer's sample buffer, its staleness bound and its bus offsets.

- :class:`SampleBuffer` keeps scored trajectories first-in first-out. A sample's behaviour version
  is the oldest version that served any of its turns; a sample more than ``max_staleness``
  versions behind the version being trained is dropped, at admission and again when a batch is
  taken (the trained version moves on while samples wait), and every drop is counted by reason
  (``stale``, ``duplicate``, ``empty``, ``superseded``, ``already_trained``, ``not_for_training``,
  ``erased``: :meth:`SampleBuffer.purge_erased` takes out an erased subject's samples,
  flywheel/tombstones.py, so no later batch and no later checkpoint holds them).
  A sample whose ``data_use`` is not ``train`` (``flywheel.consent``: the tenant or the request
  said ``store_only``) never enters a batch: the rewards stage does not produce such samples, and
  one that reaches the trainer anyway is dropped at admission. A redelivered event
  (same ``event_id``) is dropped as a duplicate within a bounded memory of recent ids. A trajectory
  is trained at most once: a newer revision (late feedback re-emits the whole session) replaces a
  queued older one, and a revision arriving after its trajectory was trained is dropped.
- :class:`OffsetTracker` says which bus records may be committed: on each partition, only the
  prefix of records that are done (trained, dropped or dead-lettered), so a crash never skips a
  sample still waiting in the buffer. It also remembers how far each partition was read, so that
  after a restart from a checkpoint the records the bus delivers again (not yet committed) but
  whose fate the checkpoint already holds are recognised and not processed twice.
- Both have a ``state_dict`` / ``load_state_dict`` pair of plain Python data (ints, strings,
  bytes, lists, dicts) for the trainer's checkpoint: a restored buffer and tracker behave exactly
  as the ones saved (queued samples in order, de-dup memories, counters, pending records).
- A taken batch becomes tensors in trainer/batch.py.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flywheel.bus.base import Record
from flywheel.events import ScoredTrajectory
from trainer.batch import sample_tokens


def behaviour_version(sample: ScoredTrajectory) -> int | None:
    """The oldest version that served a turn of ``sample`` (``None``: no turns, nothing to train)."""
    versions = [turn.behaviour_version for segment in sample.segments for turn in segment.turns]
    return min(versions) if versions else None


@dataclass(frozen=True)
class Entry:
    sample: ScoredTrajectory
    record: Record | None
    version: int


class SampleBuffer:
    """FIFO of scored trajectories under the staleness bound (module docstring)."""

    def __init__(self, max_staleness: int, remember_ids: int = 100_000) -> None:
        self.max_staleness = max_staleness
        self._entries: deque[Entry] = deque()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember_n = remember_ids
        self._queued: dict[str, Entry] = {}  # trajectory_id -> its queued entry
        self._superseded: list[Entry] = []
        self._trained: OrderedDict[str, None] = OrderedDict()
        self.dropped: Counter[str] = Counter()
        self.added = 0
        self.taken = 0

    def __len__(self) -> int:
        return len(self._entries)

    def counters(self) -> dict[str, int]:
        return {"buffered": len(self), "added": self.added, "taken": self.taken,
                **{f"dropped_{reason}": n for reason, n in sorted(self.dropped.items())}}

    def is_stale(self, version: int, current_version: int) -> bool:
        return current_version - version > self.max_staleness

    def add(self, sample: ScoredTrajectory, record: Record | None, current_version: int) -> str | None:
        """Admit ``sample``; returns the drop reason, or ``None`` when it was buffered."""
        version = behaviour_version(sample)
        reason: str | None = None
        queued = self._queued.get(sample.trajectory_id)
        if sample.data_use != "train":
            reason = "not_for_training"
        elif sample.event_id in self._seen:
            reason = "duplicate"
        elif sample.trajectory_id in self._trained:
            reason = "already_trained"
        elif queued is not None and queued.sample.revision >= sample.revision:
            reason = "superseded"
        elif version is None:
            reason = "empty"
        elif self.is_stale(version, current_version):
            reason = "stale"
        self._remember(self._seen, sample.event_id)
        if reason is not None:
            self.dropped[reason] += 1
            return reason
        assert version is not None
        if queued is not None:  # an older revision waits: the newer one takes its place
            self._superseded.append(queued)
        entry = Entry(sample, record, version)
        self._queued[sample.trajectory_id] = entry
        self._entries.append(entry)
        self.added += 1
        return None

    def purge_stale(self, current_version: int) -> list[Entry]:
        """Drop (and count) every buffered sample that has become stale or was superseded by a
        newer revision; returns them (their records are done)."""
        superseded = {id(e) for e in self._superseded}
        kept: deque[Entry] = deque()
        stale: list[Entry] = []
        for entry in self._entries:
            if id(entry) in superseded:
                continue
            (stale if self.is_stale(entry.version, current_version) else kept).append(entry)
        self._entries = kept
        for entry in stale:
            del self._queued[entry.sample.trajectory_id]
        if stale:
            self.dropped["stale"] += len(stale)
        if self._superseded:
            self.dropped["superseded"] += len(self._superseded)
        out, self._superseded = stale + self._superseded, []
        return out

    def purge_erased(self, erased: Callable[[ScoredTrajectory], bool]) -> list[Entry]:
        """Drop (and count as ``erased``) every buffered sample ``erased`` names; returns them
        (their records are done)."""
        gone = [entry for entry in self._entries if erased(entry.sample)]
        if not gone:
            return []
        ids = {id(entry) for entry in gone}
        self._entries = deque(entry for entry in self._entries if id(entry) not in ids)
        self._superseded = [entry for entry in self._superseded if id(entry) not in ids]
        for entry in gone:
            if self._queued.get(entry.sample.trajectory_id) is entry:
                del self._queued[entry.sample.trajectory_id]
        self.dropped["erased"] += len(gone)
        return gone

    def take(self, n: int, max_tokens: int = 0) -> list[Entry]:
        """The oldest samples, up to ``n`` of them and, when ``max_tokens`` > 0, up to that many
        tokens (at least one sample): ready once ``n`` samples or ``max_tokens`` tokens are buffered;
        nothing before that (call :meth:`purge_stale` first)."""
        if self._superseded or not self._entries:
            return []
        count, tokens = 0, 0
        for entry in self._entries:
            size = sample_tokens(entry.sample)
            if count == n or (max_tokens and count and tokens + size > max_tokens):
                break
            count, tokens = count + 1, tokens + size
        else:
            if count < n and not (max_tokens and tokens >= max_tokens):
                return []  # everything buffered fits: wait for more
        self.taken += count
        batch = [self._entries.popleft() for _ in range(count)]
        for entry in batch:
            del self._queued[entry.sample.trajectory_id]
            self._remember(self._trained, entry.sample.trajectory_id)
        return batch

    def _remember(self, ids: OrderedDict[str, None], key: str) -> None:
        ids[key] = None
        ids.move_to_end(key)
        while len(ids) > self._remember_n:
            ids.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        """Everything the buffer knows, as plain data: queued samples as their raw bytes and record
        coordinates (in order, superseded ones flagged), the bounded de-dup memories, the counters."""
        superseded = {id(e) for e in self._superseded}
        return {
            "entries": [
                {
                    "raw": entry.record.value if entry.record is not None else entry.sample.to_bytes(),
                    "record": None if entry.record is None else _coordinates(entry.record),
                    "version": entry.version,
                    "superseded": id(entry) in superseded,
                }
                for entry in self._entries
            ],
            "seen": list(self._seen),
            "trained": list(self._trained),
            "dropped": dict(self.dropped),
            "added": self.added,
            "taken": self.taken,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the buffer that ``state`` was saved from (this one must be empty)."""
        if self._entries or self._seen or self._trained or self.added:
            raise ValueError("load_state_dict needs a fresh buffer")
        for item in state["entries"]:
            sample = ScoredTrajectory.from_bytes(item["raw"])
            record = None if item["record"] is None else _record(item["record"], item["raw"])
            entry = Entry(sample, record, item["version"])
            self._entries.append(entry)
            if item["superseded"]:
                self._superseded.append(entry)
            else:
                self._queued[sample.trajectory_id] = entry
        self._seen = OrderedDict.fromkeys(state["seen"])
        self._trained = OrderedDict.fromkeys(state["trained"])
        self.dropped = Counter(state["dropped"])
        self.added, self.taken = state["added"], state["taken"]


def _coordinates(record: Record) -> tuple[str, int, int, str | None]:
    return (record.topic, record.partition, record.offset, record.key)


def _record(coordinates: Sequence[Any], value: bytes = b"") -> Record:
    topic, partition, offset, key = coordinates
    return Record(topic, partition, offset, key, value)


class OffsetTracker:
    """Which polled records may be committed: per partition, the longest prefix that is done.

    ``positions`` is the next offset to read per partition; a record below it was seen before:
    after a restart, the bus redelivers everything after its committed offset, and the records up
    to the checkpoint's positions already have their fate in the restored state (buffered,
    trained, dropped), so :meth:`track` tells the caller to skip them.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[str, int], dict[int, Record]] = {}
        self._done: dict[tuple[str, int], set[int]] = {}
        self.positions: dict[tuple[str, int], int] = {}

    def track(self, record: Record) -> bool:
        """Start tracking a polled record; ``False`` when it was read before (redelivered after a
        restart): the caller skips it. One that is no longer tracked was done (the checkpoint's
        committed prefix, perhaps not committed on the bus yet), so it is tracked again as done."""
        pair = (record.topic, record.partition)
        records = self._records.setdefault(pair, {})
        done = self._done.setdefault(pair, set())
        if record.offset < self.positions.get(pair, 0):
            if record.offset not in records:
                records[record.offset] = record
                done.add(record.offset)
            return False
        self.positions[pair] = record.offset + 1
        records[record.offset] = record
        return True

    def done(self, record: Record) -> None:
        self._done.setdefault((record.topic, record.partition), set()).add(record.offset)

    def committable(self) -> list[Record]:
        """The last record of each partition's done prefix (committing it covers the prefix);
        those records stop being tracked."""
        out: list[Record] = []
        for pair, records in self._records.items():
            done = self._done.get(pair, set())
            last: Record | None = None
            for offset in sorted(records):
                if offset not in done:
                    break
                last = records.pop(offset)
                done.discard(offset)
            if last is not None:
                out.append(last)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Positions and the tracked records (coordinates and whether done), as plain data."""
        return {
            "positions": [[topic, partition, offset] for (topic, partition), offset in sorted(self.positions.items())],
            "records": [
                [*_coordinates(record), offset in self._done.get(pair, set())]
                for pair, records in sorted(self._records.items())
                for offset, record in sorted(records.items())
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the tracker that ``state`` was saved from (commits need only the coordinates)."""
        self.positions = {(topic, partition): offset for topic, partition, offset in state["positions"]}
        self._records, self._done = {}, {}
        for *coordinates, done in state["records"]:
            record = _record(coordinates)
            pair = (record.topic, record.partition)
            self._records.setdefault(pair, {})[record.offset] = record
            done_here = self._done.setdefault(pair, set())
            if done:
                done_here.add(record.offset)
