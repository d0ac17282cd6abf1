"""Realistic RL traffic for the trainer's benchmarks: seeded multi-turn sessions with heavy-tailed lengths.

A session is a ``ScoredTrajectory`` of one segment (two when a long session was restarted on a
compacted context) alternating context (system prompt, user messages, tool output: mask 0) and the
turn's completion (mask 1, behaviour logprobs in [-3, -0.01], neutral sampling, ``turn_advantages``
on every turn, so every completion token trains). Lengths are lognormal (:data:`LENGTH_SIGMA`)
around a median, clipped, taken at the distribution's quantiles in a seeded order, so that even a
dozen sessions hold the tail. Token ids are uniform in the vocabulary. Pure: no torch, no model.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

from flywheel.events import ScoredTrajectory, Segment, Turn

LINE = "bench-step"
LENGTH_SIGMA = 1.4  # lognormal sigma of session lengths: 9 sessions span ~0.1x to ~9x the median


def _split(rng: random.Random, total: int, parts: int, first_weight: float = 1.0) -> list[int]:
    """``total`` split into ``parts`` positive integers with random (exponential) weights."""
    weights = [rng.expovariate(1.0) * (first_weight if i == 0 else 1.0) for i in range(parts)]
    scale = (total - parts) / sum(weights)
    out = [1 + int(w * scale) for w in weights]
    out[-1] += total - sum(out)
    return out


def session(rng: random.Random, index: int, vocab: int, length: int, median: int) -> ScoredTrajectory:
    """One multi-turn session of ``length`` tokens: one segment, or two when a long session was
    restarted on a compacted context; each segment alternates context (system prompt, user
    messages, tool output: mask 0) and the turn's completion (mask 1)."""
    sid = f"bench-{index}"
    parts = [length]
    if length >= 0.75 * median and rng.random() < 0.2:
        first = rng.randint(length // 3, 2 * length // 3)
        parts = [first, length - first]
    segments, advantages = [], []
    for seg_len in parts:
        turns = min(16, 1 + int(seg_len / (median * rng.uniform(0.375, 1.5))))  # every 300-1200 tokens at median 800
        share = min(0.7, max(0.05, rng.lognormvariate(math.log(0.3 * (median / seg_len) ** 0.25), 0.3)))
        completion = max(turns, min(seg_len - turns - 1, round(seg_len * share)))
        contexts = _split(rng, seg_len - completion, turns, first_weight=3.0)  # the first holds the system prompt
        completions = _split(rng, completion, turns)
        tokens: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        turn_list = []
        for ctx, comp in zip(contexts, completions, strict=True):
            tokens += [rng.randrange(vocab) for _ in range(ctx + comp)]
            mask += [0] * ctx + [1] * comp
            logprobs += [0.0] * ctx + [rng.uniform(-3.0, -0.01) for _ in range(comp)]
            turn_list.append(Turn(generation_id=f"{sid}-{len(advantages)}", start=len(tokens) - comp, end=len(tokens),
                                  behaviour_version=0))
            advantages.append(rng.choice((-1.0, 1.0)) * rng.uniform(0.1, 2.0))
        segments.append(Segment(tokens=tokens, mask=mask, logprobs=logprobs, turns=turn_list))
    rewards = [float(a > 0) for a in advantages]
    return ScoredTrajectory(event_id=sid, tenant="bench", session_id=sid, trajectory_id=sid, model_line=LINE,
                            segments=segments, turn_rewards=rewards, total_reward=sum(rewards),
                            reward_spec_version="bench", turn_advantages=advantages)


def make_traffic(n: int, *, seed: int, vocab: int, median_len: int, min_len: int, max_len: int) -> list[ScoredTrajectory]:
    """``n`` sessions, lengths lognormal around ``median_len`` clipped to ``[min_len, max_len]``:
    the distribution's ``n`` quantiles ``(i + 0.5) / n``, in a seeded random order, so that even a
    dozen sessions hold the tail (a few random draws rarely do) and every run has the same shape."""
    rng = random.Random(seed)
    quantiles = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    lengths = [min(max_len, max(min_len, round(median_len * math.exp(LENGTH_SIGMA * z)))) for z in quantiles]
    rng.shuffle(lengths)
    return [session(rng, i, vocab, length, median_len) for i, length in enumerate(lengths)]


def trainable_tokens(sample: ScoredTrajectory) -> int:
    """Completion tokens of ``sample`` that train (position 0 of a row never does)."""
    return sum(sum(s.mask) - (s.mask[0] if s.mask else 0) for s in sample.segments)


def traffic_stats(samples: list[ScoredTrajectory]) -> dict[str, Any]:
    lengths = sorted(sum(len(s.tokens) for s in x.segments) for x in samples)
    total, trainable = sum(lengths), sum(trainable_tokens(x) for x in samples)
    return {"samples": len(samples), "segments": sum(len(x.segments) for x in samples),
            "turns": sum(len(s.turns) for x in samples for s in x.segments),
            "min_len": lengths[0], "median_len": statistics.median(lengths),
            "p90_len": lengths[min(len(lengths) - 1, math.ceil(0.9 * len(lengths)) - 1)], "max_len": lengths[-1],
            "total_tokens": total, "trainable_tokens": trainable, "trainable_share": round(trainable / total, 4)}
