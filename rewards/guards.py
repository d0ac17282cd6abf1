"""Guards against reward hacking, as pure functions: clipping, the held-out slice, anomaly detection.

(The length penalty is a builder, ``rewards.builders.length_penalty``, weighted like the others.)

- :func:`clip`: every turn reward is clipped to ``±clip_turn``; then if ``|total|`` exceeds
  ``clip_total`` every turn is scaled by the same factor so the total is exactly ``±clip_total``
  (the turns keep their proportions). 0 turns either off.
- :func:`is_held_out`: a session is held out when the SHA-256 of ``tenant \\x1f session_id``, read
  as a number in [0, 1), is below ``held_out_fraction``: deterministic, the same on every worker,
  every revision and every rescore, and independent of the spec's other settings. Held-out sessions
  are scored and stored but never produced to the training topic; their rewards are the promotion
  gate's evaluation set (per-version stats, ``rewards.store``).
- :func:`anomalies`: a version is compared with the nearest earlier version of its model line that
  has enough samples (``min_train`` training and ``min_held_out`` held-out trajectories, both
  needed). It is flagged when its training reward rate (mean total reward of the trajectories it
  served) rose by at least ``train_jump`` while its held-out rate rose by less than
  ``held_out_ratio`` times that: reward that the held-out slice does not confirm.
- :func:`served_version`: a trajectory counts for the version that served its last turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from flywheel.events import Segment
from rewards.spec import AnomalySpec


def clip(turn_rewards: Sequence[float], clip_turn: float, clip_total: float) -> list[float]:
    out = [max(-clip_turn, min(clip_turn, r)) if clip_turn else float(r) for r in turn_rewards]
    total = sum(out)
    if clip_total and abs(total) > clip_total:
        factor = clip_total / abs(total)
        out = [r * factor for r in out]
    return out


def held_out_point(tenant: str, session_id: str) -> float:
    """Where the session falls in [0, 1)."""
    digest = hashlib.sha256(f"{tenant}\x1f{session_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(tenant: str, session_id: str, fraction: float) -> bool:
    return held_out_point(tenant, session_id) < fraction


def served_version(segments: Sequence[Segment]) -> int | None:
    """The behaviour version of the last turn (``None``: no turns)."""
    turns = [turn for segment in segments for turn in segment.turns]
    return turns[-1].behaviour_version if turns else None


@dataclass(frozen=True)
class VersionStats:
    """Reward sums of one model version under one spec, split training / held-out."""

    version: int
    train_count: int = 0
    train_sum: float = 0.0
    held_out_count: int = 0
    held_out_sum: float = 0.0

    @property
    def train_rate(self) -> float | None:
        return self.train_sum / self.train_count if self.train_count else None

    @property
    def held_out_rate(self) -> float | None:
        return self.held_out_sum / self.held_out_count if self.held_out_count else None


def anomalies(stats: Sequence[VersionStats], spec: AnomalySpec) -> dict[int, str | None]:
    """Every version of ``stats`` (one model line, one spec) -> why it is flagged, or ``None``."""
    out: dict[int, str | None] = {s.version: None for s in stats}
    ready = sorted(
        (s for s in stats if s.train_count >= spec.min_train and s.held_out_count >= spec.min_held_out),
        key=lambda s: s.version,
    )
    for prev, cur in zip(ready, ready[1:]):
        t0, t1, h0, h1 = prev.train_rate, cur.train_rate, prev.held_out_rate, cur.held_out_rate
        assert t0 is not None and t1 is not None and h0 is not None and h1 is not None
        rise, held_rise = t1 - t0, h1 - h0
        if rise >= spec.train_jump and held_rise < spec.held_out_ratio * rise:
            out[cur.version] = (
                f"training reward rate rose {rise:+.3f} (v{prev.version} {t0:.3f} -> v{cur.version} {t1:.3f}, "
                f"n={cur.train_count}) while held-out moved {held_rise:+.3f} ({h0:.3f} -> {h1:.3f}, "
                f"n={cur.held_out_count}); expected at least {spec.held_out_ratio * rise:+.3f}"
            )
    return out
