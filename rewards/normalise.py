"""Normalisation: per-turn advantages from turn rewards, computed in the rewards worker.

Observations are turn rewards (a three-turn sample contributes three), so multi-turn samples are
compared with single-turn ones on the scale their tokens are credited on. For a sample with turn
rewards ``r``:

- Group-relative, when it has a ``prompt_key`` and at least ``group_min`` earlier samples of the
  same (tenant, model line, prompt key) are known (the newest ``group_window`` are kept): the
  baseline ``mean`` is the mean of those earlier samples' turn rewards (the sample's own reward is
  never in its baseline, as in RLOO) and ``std`` is the population std of the earlier ones and
  ``r`` together (as GRPO's group std).
- Otherwise, against running statistics per (tenant, model line): exponentially weighted, the
  k-th observation ``x`` with weight ``α = max(1/k, 1 - decay)`` (a plain mean until
  ``1 / (1 - decay)`` observations, exponential after): ``δ = x - mean; mean += α δ;
  var = (1 - α)(var + α δ²)``. ``mean`` is taken before the sample, ``std`` after it; before
  ``warmup`` observations the std is 1 (centring only); with no observation the mean is 0.
- Siblings instead, whatever the two rules above give: the turns of a sampled group (the ``n > 1``
  choices of one request, sharing a ``group_id``: ``rewards.credit.turn_groups``) with at least
  two members in the sample are compared with each other. A member's ``mean`` is the mean of the
  OTHER members' turn rewards (leave-one-out, as in RLOO) and its ``std`` the population std of
  all the members' (GRPO's group std). Siblings answered the same prompt in the same context, so
  what they share (a session outcome, their step's credit) cancels and what tells them apart
  stays. Every other turn gets the sample's baseline above, computed as if there were no groups
  (over all of the sample's turn rewards, the siblings' included).
- ``advantage_i = (r_i - mean_i) / max(std_i, std_floor)`` (``scale = "std"``) or ``r_i - mean_i``
  (``"none"``), clipped to ``±clip`` (0: no clip). Then the sample joins its group and the running
  statistics, every turn alike (:meth:`Normaliser.observe`: siblings are observations too).

Example: choices with turn rewards ``[1, 0, -1]``: means ``[-0.5, 0.0, 0.5]``, std ``sqrt(2/3)``,
advantages ``[1.5, 0.0, -1.5] / sqrt(2/3)`` (``scale = "std"``).

State is in memory and is **rebuilt, not persisted**: at start the worker replays the newest
``rewards.restore_rows`` scored, non-held-out rows of its spec version, oldest first, through
:meth:`Normaliser.observe`, so a restart continues from (nearly) the statistics it stopped with,
and several workers of one group converge on the same statistics (sibling baselines need no
state: they come from the sample alone). Held-out samples never enter the statistics (they must
not shape training) and get no advantages. ``rescore`` replays every stored trajectory in storage
order through a fresh normaliser, so its advantages are reproducible.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from statistics import fmean

from rewards.spec import NormaliseSpec

GroupKey = tuple[str, str, str]


class RunningStats:
    """Exponentially weighted mean and variance (module docstring)."""

    __slots__ = ("count", "mean", "var")

    def __init__(self, count: int = 0, mean: float = 0.0, var: float = 0.0) -> None:
        self.count, self.mean, self.var = count, mean, var

    def update(self, x: float, decay: float) -> None:
        self.count += 1
        alpha = max(1.0 / self.count, 1.0 - decay)
        delta = x - self.mean
        self.mean += alpha * delta
        self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)

    def copy(self) -> RunningStats:
        return RunningStats(self.count, self.mean, self.var)


def population_std(values: Sequence[float]) -> float:
    mean = fmean(values)
    return math.sqrt(fmean((v - mean) ** 2 for v in values))


def sibling_baselines(turn_rewards: Sequence[float], groups: Sequence[str | None]) -> list[tuple[float, float] | None]:
    """Per turn, ``(mean, std)`` against its siblings (module docstring); ``None`` for a turn in no
    group (``groups[i]`` None) or in a group with no other member in the sample."""
    if len(groups) != len(turn_rewards):
        raise ValueError(f"{len(groups)} group ids for {len(turn_rewards)} turn rewards")
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        if group is not None:
            members.setdefault(group, []).append(i)
    out: list[tuple[float, float] | None] = [None] * len(turn_rewards)
    for turns in members.values():
        if len(turns) < 2:
            continue
        rewards = [turn_rewards[i] for i in turns]
        std = population_std(rewards)
        for k, i in enumerate(turns):
            out[i] = (fmean(rewards[:k] + rewards[k + 1 :]), std)
    return out


class Normaliser:
    """Group-relative or running-statistics advantages (module docstring); not thread-safe."""

    def __init__(self, spec: NormaliseSpec, max_groups: int = 100_000) -> None:
        self.spec = spec
        self.max_groups = max_groups
        self._groups: OrderedDict[GroupKey, deque[tuple[float, ...]]] = OrderedDict()
        self._running: dict[tuple[str, str], RunningStats] = {}

    def reset(self) -> None:
        """Forget every sample (before replaying the committed ones)."""
        self._groups.clear()
        self._running.clear()

    def baseline(
        self, tenant: str, model_line: str, prompt_key: str | None, turn_rewards: Sequence[float]
    ) -> tuple[float, float, str]:
        """``(mean, std, source)`` for a sample, ``source`` being ``group`` or ``running``; no state changes."""
        group = self._groups.get((tenant, model_line, prompt_key)) if prompt_key is not None else None
        if group is not None and len(group) >= self.spec.group_min:
            earlier = [r for sample in group for r in sample]
            return fmean(earlier), population_std(earlier + list(turn_rewards)), "group"
        before = self._running.get((tenant, model_line)) or RunningStats()
        after = before.copy()
        for r in turn_rewards:
            after.update(r, self.spec.decay)
        std = math.sqrt(after.var) if after.count >= self.spec.warmup else 1.0
        return before.mean, std, "running"

    def advantages(self, tenant: str, model_line: str, prompt_key: str | None, turn_rewards: Sequence[float],
                   groups: Sequence[str | None] | None = None) -> list[float]:
        """The sample's per-turn advantages, ``groups`` being each turn's sampled group (None: no
        groups); then the sample is observed."""
        shared = self.baseline(tenant, model_line, prompt_key, turn_rewards)[:2]
        siblings = sibling_baselines(turn_rewards, groups) if groups is not None else [None] * len(turn_rewards)
        out = []
        for r, own in zip(turn_rewards, siblings, strict=True):
            mean, std = shared if own is None else own
            out.append((r - mean) / (max(std, self.spec.std_floor) if self.spec.scale == "std" else 1.0))
        if self.spec.clip:
            out = [max(-self.spec.clip, min(self.spec.clip, a)) for a in out]
        self.observe(tenant, model_line, prompt_key, turn_rewards)
        return out

    def observe(self, tenant: str, model_line: str, prompt_key: str | None, turn_rewards: Sequence[float]) -> None:
        """Add a sample to its group and to the running statistics."""
        if not turn_rewards:
            return
        if prompt_key is not None:
            key = (tenant, model_line, prompt_key)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = deque(maxlen=self.spec.group_window)
                while len(self._groups) > self.max_groups:
                    self._groups.popitem(last=False)
            else:
                self._groups.move_to_end(key)
            group.append(tuple(turn_rewards))
        stats = self._running.setdefault((tenant, model_line), RunningStats())
        for r in turn_rewards:
            stats.update(r, self.spec.decay)
