"""Trajectories into tensors: which tokens train, micro-batches by token budget, padded or packed rows.

- :func:`trainable_mask` is a segment's mask less the turns the trainer cannot train on (greedy,
  or sampled with a knob it cannot recompute), counted by reason.
- :func:`micro_batches` groups a step's samples under ``trainer.micro_batch_tokens``: padded, rows
  x longest row within the budget, consecutive samples; packed, the samples' tokens within the
  budget, fullest first (first-fit decreasing), since no padding depends on the order.
- :func:`collate` lays a micro-batch out as a :class:`Batch` of ``[B, T]`` tensors, either way:

  - padded: one row per segment, right-padded to the longest;
  - packed: one row holding every segment back to back, no padding. ``positions`` restart at 0
    on each segment (rotary positions are the segment's own) and ``cu_seqlens`` bounds the
    segments, so attention never crosses one (trainer/head.py runs it segment by segment).

  Either way position 0 of a segment is never trainable (nothing before it predicts it), so the
  two layouts train exactly the same tokens with the same per-token inputs: the same loss and
  gradients up to float summation order (tests/unit/test_packing.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from flywheel.events import ScoredTrajectory, Segment, Turn
from flywheel.sampling import GREEDY_BELOW, Processing
from trainer.loss import token_advantages

#: A turn whose tokens were sampled from a processed distribution: ``(row, begin, start, end,
#: processing)``, ``tokens[row, start:end]`` sampled after the segment's ``tokens[row, begin:start]``
#: (the penalties' history).
ProcessedTurn = tuple[int, int, int, int, Processing]


def untrainable_reason(turn: Turn) -> str | None:
    """Why the trainer cannot train on ``turn`` (None: it can). A greedy turn's behaviour logprobs
    are all 0.0 (a point mass); a turn sampled with a knob ``flywheel.sampling`` cannot recompute
    (structured output, banned tokens...) has a distribution the ratio cannot be exact against."""
    if turn.untrainable:
        return turn.untrainable
    if turn.temperature < GREEDY_BELOW:
        return "greedy"
    return None


def trainable_mask(segment: Segment) -> tuple[list[int], Counter[str]]:
    """The segment's mask less the turns the trainer cannot train on, and those turns' completion
    tokens by reason (:func:`untrainable_reason`). They still shape the session's rewards."""
    mask = list(segment.mask)
    masked: Counter[str] = Counter()
    for turn in segment.turns:
        reason = untrainable_reason(turn)
        if reason is not None:
            masked[reason] += sum(mask[turn.start : turn.end])
            mask[turn.start : turn.end] = [0] * (turn.end - turn.start)
    return mask, masked


def sample_tokens(sample: ScoredTrajectory) -> int:
    """Tokens of ``sample`` (prompts and completions of every segment): its cost in a batch."""
    return sum(len(segment.tokens) for segment in sample.segments)


def micro_batches(samples: Sequence[ScoredTrajectory], budget: int, *, packed: bool = True) -> list[list[int]]:
    """Groups of sample indices for one forward/backward pass each (module docstring); a sample
    larger than ``budget`` goes alone. Every index appears once."""
    if packed:
        sizes = [sample_tokens(s) for s in samples]
        bins: list[tuple[int, list[int]]] = []  # (tokens, indices)
        for i in sorted(range(len(samples)), key=lambda i: -sizes[i]):
            size = sizes[i]
            for b, (used, members) in enumerate(bins):
                if used + size <= budget:
                    bins[b] = (used + size, [*members, i])
                    break
            else:
                bins.append((size, [i]))
        return [sorted(members) for _, members in bins]
    groups: list[list[int]] = []
    rows = longest = 0
    for i, sample in enumerate(samples):
        segments = [len(s.tokens) for s in sample.segments if s.tokens]
        n, top = len(segments), max(segments, default=0)
        if groups and (rows + n) * max(longest, top) <= budget:
            groups[-1].append(i)
            rows, longest = rows + n, max(longest, top)
        else:
            groups.append([i])
            rows, longest = n, top
    return groups


@dataclass(frozen=True)
class Batch:
    """``[B, T]`` tensors of one micro-batch (module docstring: padded or packed).

    ``processed`` names the trainable turns whose behaviour distribution was not the model's own
    (temperature, top-p, top-k, min-p, penalties, logit bias): the trainer recomputes it there.
    ``completion_tokens`` counts every completion token of the batch, ``masked`` those left out by
    reason. ``cu_seqlens`` is set on a packed batch only (one row).
    """

    tokens: torch.Tensor  # int64, 0 on padding
    attention: torch.Tensor  # int64, 1 on real tokens
    positions: torch.Tensor  # int64, each token's position in its segment
    logp_behaviour: torch.Tensor  # float32, served logprobs (0 off the mask)
    mask: torch.Tensor  # float32, 1 on trainable tokens
    advantages: torch.Tensor  # float32
    sample_index: torch.Tensor  # int64, the token's sample in the micro-batch, -1 on padding
    processed: tuple[ProcessedTurn, ...] = ()
    completion_tokens: int = 0
    masked: dict[str, int] = field(default_factory=dict)
    cu_seqlens: torch.Tensor | None = None  # int32 [segments + 1], packed batches only
    max_seqlen: int = 0  # the longest segment, packed batches only

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def to(self, device: torch.device) -> Batch:
        """This batch on ``device`` (itself when it is there already)."""
        if self.tokens.device == device:
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def collate(samples: Sequence[ScoredTrajectory], baselines: Sequence[float], *, packed: bool = False) -> Batch:
    """Lay ``samples`` (with one baseline each) out as a :class:`Batch`: one right-padded row per
    segment, or with ``packed`` every segment back to back in one row (module docstring)."""
    segments: list[tuple[int, list[int], list[int], list[float], torch.Tensor]] = []
    processed: list[ProcessedTurn] = []
    completion_tokens = 0
    masked: Counter[str] = Counter()
    offset = 0  # where the next segment starts in a packed row
    for i, (sample, baseline) in enumerate(zip(samples, baselines, strict=True)):
        advantages = token_advantages(sample.turn_rewards, sample.segments, baseline)
        for segment, adv in zip(sample.segments, advantages, strict=True):
            if not segment.tokens:
                continue
            mask, left_out = trainable_mask(segment)
            completion_tokens += sum(segment.mask)
            masked.update(left_out)
            row, begin = (0, offset) if packed else (len(segments), 0)
            for turn in segment.turns:
                processing = Processing.of(turn)
                if not processing.neutral and untrainable_reason(turn) is None and turn.end > turn.start:
                    processed.append((row, begin, begin + max(turn.start, 1), begin + turn.end, processing))
            segments.append((i, segment.tokens, mask, segment.logprobs, adv))
            offset += len(segment.tokens)
    lengths = [len(s[1]) for s in segments]
    B, T = (1, max(offset, 1)) if packed else (len(segments), max(lengths, default=1))
    tokens = torch.zeros(B, T, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    logp_b = torch.zeros(B, T, dtype=torch.float32)
    mask = torch.zeros(B, T, dtype=torch.float32)
    adv_t = torch.zeros(B, T, dtype=torch.float32)
    sample_index = torch.full((B, T), -1, dtype=torch.long)
    start = 0
    for b, (i, toks, msk, lps, adv) in enumerate(segments):
        n = len(toks)
        row, at = (0, start) if packed else (b, 0)
        span = slice(at, at + n)
        tokens[row, span] = torch.tensor(toks, dtype=torch.long)
        attention[row, span] = 1
        positions[row, span] = torch.arange(n)
        logp_b[row, span] = torch.tensor(lps, dtype=torch.float32)
        mask[row, span] = torch.tensor(msk, dtype=torch.float32)
        mask[row, at] = 0.0  # nothing before a segment's first token predicts it
        adv_t[row, span] = adv
        sample_index[row, span] = i
        start += n
    cu_seqlens = None
    if packed:
        bounds = torch.tensor(lengths or [1], dtype=torch.long).cumsum(0).tolist()  # no segment: one padding token
        cu_seqlens = torch.tensor([0, *bounds], dtype=torch.int32)
    return Batch(tokens, attention, positions, logp_b, mask, adv_t, sample_index, tuple(processed),
                 completion_tokens, dict(masked), cu_seqlens, max(lengths, default=0) if packed else 0)
