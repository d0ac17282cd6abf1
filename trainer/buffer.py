"""Samples in, batches out: the trainer's sample buffer, its staleness bound, offsets and padding.

- :class:`SampleBuffer` keeps scored trajectories first-in first-out. A sample's behaviour version
  is the oldest version that served any of its turns; a sample more than ``max_staleness``
  versions behind the version being trained is dropped, at admission and again when a batch is
  taken (the trained version moves on while samples wait), and every drop is counted by reason
  (``stale``, ``duplicate``, ``empty``, ``superseded``, ``already_trained``). A redelivered event
  (same ``event_id``) is dropped as a duplicate within a bounded memory of recent ids. A trajectory
  is trained at most once: a newer revision (late feedback re-emits the whole session) replaces a
  queued older one, and a revision arriving after its trajectory was trained is dropped.
- :class:`OffsetTracker` says which bus records may be committed: on each partition, only the
  prefix of records that are done (trained, dropped or dead-lettered), so a crash never skips a
  sample still waiting in the buffer.
- :func:`collate` pads a batch of trajectories into ``[B, T]`` tensors, one row per segment.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flywheel.bus.base import Record
from flywheel.events import ScoredTrajectory, Segment
from trainer.loss import token_advantages


def trainable_mask(segment: Segment) -> list[int]:
    """The segment's mask, less turns not sampled at temperature 1 and top_p 1.

    Their behaviour logprobs belong to a reshaped distribution (greedy ones are all 0.0), so the
    importance ratio against the model's own distribution would be wrong; such turns still shape
    the rewards of the session but are not trained on.
    """
    mask = list(segment.mask)
    for turn in segment.turns:
        if turn.temperature != 1.0 or turn.top_p != 1.0:
            mask[turn.start : turn.end] = [0] * (turn.end - turn.start)
    return mask


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
        if sample.event_id in self._seen:
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

    def take(self, n: int) -> list[Entry]:
        """The ``n`` oldest samples, or nothing while fewer are buffered (call :meth:`purge_stale` first)."""
        if len(self._entries) - len(self._superseded) < n or self._superseded:
            return []
        self.taken += n
        batch = [self._entries.popleft() for _ in range(n)]
        for entry in batch:
            del self._queued[entry.sample.trajectory_id]
            self._remember(self._trained, entry.sample.trajectory_id)
        return batch

    def _remember(self, ids: OrderedDict[str, None], key: str) -> None:
        ids[key] = None
        ids.move_to_end(key)
        while len(ids) > self._remember_n:
            ids.popitem(last=False)


class OffsetTracker:
    """Which polled records may be committed: per partition, the longest prefix that is done."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], OrderedDict[int, Record]] = {}
        self._done: set[tuple[str, int, int]] = set()

    def track(self, record: Record) -> None:
        self._pending.setdefault((record.topic, record.partition), OrderedDict())[record.offset] = record

    def done(self, record: Record) -> None:
        self._done.add((record.topic, record.partition, record.offset))

    def committable(self) -> list[Record]:
        """The last record of each partition's done prefix (committing it covers the prefix);
        those records stop being tracked."""
        out: list[Record] = []
        for (topic, partition), records in self._pending.items():
            last: Record | None = None
            while records:
                offset, record = next(iter(records.items()))
                if (topic, partition, offset) not in self._done:
                    break
                records.popitem(last=False)
                self._done.discard((topic, partition, offset))
                last = record
            if last is not None:
                out.append(last)
        return out


@dataclass(frozen=True)
class Batch:
    """One row per segment; all ``[B, T]`` except ``row_sample`` ``[B]`` (index of the row's sample)."""

    tokens: torch.Tensor  # int64, 0 on padding
    attention: torch.Tensor  # int64, 1 on real tokens
    logp_behaviour: torch.Tensor  # float32, served logprobs (0 off the mask)
    mask: torch.Tensor  # float32, 1 on trainable tokens
    advantages: torch.Tensor  # float32
    row_sample: torch.Tensor  # int64


def collate(samples: Sequence[ScoredTrajectory], baselines: Sequence[float]) -> Batch:
    """Pad ``samples`` (with one baseline each) into a :class:`Batch`, right-padded to the longest segment.

    Position 0 of a row is never trainable (no token before it to predict it from).
    """
    rows: list[tuple[int, list[int], list[int], list[float], torch.Tensor]] = []
    for i, (sample, baseline) in enumerate(zip(samples, baselines, strict=True)):
        advantages = token_advantages(sample.turn_rewards, sample.segments, baseline)
        for segment, adv in zip(sample.segments, advantages, strict=True):
            if segment.tokens:
                rows.append((i, segment.tokens, trainable_mask(segment), segment.logprobs, adv))
    B = len(rows)
    T = max((len(r[1]) for r in rows), default=1)
    tokens = torch.zeros(B, T, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    logp_b = torch.zeros(B, T, dtype=torch.float32)
    mask = torch.zeros(B, T, dtype=torch.float32)
    adv_t = torch.zeros(B, T, dtype=torch.float32)
    row_sample = torch.zeros(B, dtype=torch.long)
    for b, (i, toks, msk, lps, adv) in enumerate(rows):
        n = len(toks)
        tokens[b, :n] = torch.tensor(toks, dtype=torch.long)
        attention[b, :n] = 1
        logp_b[b, :n] = torch.tensor(lps, dtype=torch.float32)
        mask[b, :n] = torch.tensor(msk, dtype=torch.float32)
        adv_t[b, :n] = adv
        row_sample[b] = i
    mask[:, 0] = 0.0
    return Batch(tokens, attention, logp_b, mask, adv_t, row_sample)
