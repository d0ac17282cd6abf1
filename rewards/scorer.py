"""A reward spec compiled into one function ``trajectory -> RewardOutput``, and the scored event it makes.

Order: every enabled builder, each output times its ``weight`` -> the credit rule spreads the
session outcomes over the turns, by step (the choices of one sampled group are one step:
``rewards.credit``) -> clipping (``rewards.guards.clip``).

The final output's components are the builders' per-signal sums (weighted; builders naming the same
signal add up) plus two adjustments, present when not zero: ``credit``, what the credit rule added
by giving earlier steps, and the siblings of an outcome's anchor, a share of it, and ``clip``, what
clipping changed. Invariant: ``total == sum(turn_rewards) == sum(components.values())`` (to 1e-9),
and ``outcome`` is empty.

The text guards (``rewards.text_guards``) read what each turn said from a ``generations`` source
(``rewards.texts``), once per trajectory; a spec that enables one needs it, as the judge needs its
transcripts: without one the scorer is not built.

Custom builders are found by entry point (group ``flywheel.reward_builders``, :data:`ENTRY_POINT_GROUP`)
or by ``module:function``, when the scorer is built: a missing one fails at start, not mid-stream.
A builder returning the wrong number of turns or a non-finite value raises :class:`BuilderError`.
"""

from __future__ import annotations

import importlib
import math
import uuid
from importlib.metadata import entry_points
from typing import Any

import httpx

from flywheel.events import ScoredTrajectory, TrajectoryEvent
from rewards import credit, guards
from rewards.builders import BUILTIN, Builder, RewardOutput
from rewards.judge import Judge, Transcripts
from rewards.spec import CustomBuilder, RewardSpec, SpecError
from rewards.text_guards import TEXT_BUILTIN
from rewards.texts import Generations, TurnTexts

ENTRY_POINT_GROUP = "flywheel.reward_builders"
_NOISE = 1e-12


class BuilderError(ValueError):
    """A builder broke the builder contract (``rewards.builders``)."""


def scored_event_id(trajectory_id: str, revision: int, spec_version: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel-scored:{trajectory_id}:{revision}:{spec_version}").hex


def load_custom(entry: CustomBuilder) -> Builder:
    """The function a custom builder entry names."""
    if entry.entry_point:
        found = list(entry_points(group=ENTRY_POINT_GROUP, name=entry.entry_point))
        if len(found) != 1:
            known = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
            what = "no" if not found else f"{len(found)} distributions register a"
            raise SpecError(f"{what} reward builder {entry.entry_point!r} in entry-point group "
                            f"{ENTRY_POINT_GROUP!r} (installed: {known})")
        return found[0].load()
    module, _, name = entry.target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"custom reward builder {entry.target!r}: {exc}") from exc


class Scorer:
    """Callable ``trajectory -> RewardOutput`` for one spec (module docstring)."""

    def __init__(self, spec: RewardSpec, *, transcripts: Transcripts | None = None, judge_api_key: str = "",
                 judge_client: httpx.Client | None = None, generations: Generations | None = None) -> None:
        self.spec = spec
        self._judges: list[Judge] = []
        texts = TurnTexts(generations) if generations is not None else None
        self.builders: list[tuple[str, Builder, Any, float]] = []
        for entry in spec.builders:
            if not entry.enabled:
                continue
            fn: Builder
            if entry.kind == "judge":
                if transcripts is None:
                    raise SpecError("the judge builder needs the sessions' conversations (a transcripts source)")
                judge = Judge(entry.params, transcripts, judge_api_key, judge_client)
                self._judges.append(judge)
                fn, label = judge, "judge"
            elif entry.kind in TEXT_BUILTIN:
                if texts is None:
                    raise SpecError(f"the {entry.kind} builder reads what the turns said: it needs a generations source")
                fn, label = texts.bind(TEXT_BUILTIN[entry.kind]), entry.kind
            elif isinstance(entry, CustomBuilder):
                fn, label = load_custom(entry), entry.entry_point or entry.target
            else:
                fn, label = BUILTIN[entry.kind], entry.kind
            self.builders.append((entry.name or label, fn, entry.params, entry.weight))

    def __call__(self, traj: TrajectoryEvent) -> RewardOutput:
        n = sum(len(segment.turns) for segment in traj.segments)
        turns, outcome = [0.0] * n, [0.0] * n
        components: dict[str, float] = {}
        for name, fn, params, weight in self.builders:
            out = fn(traj, params)
            if len(out.turn_rewards) != n or (out.outcome and len(out.outcome) != n):
                raise BuilderError(f"builder {name!r} returned {len(out.turn_rewards)} turn rewards and "
                                   f"{len(out.outcome)} outcome slots for {n} turns")
            values = [*out.turn_rewards, *out.outcome, *out.components.values()]
            if not all(math.isfinite(v) for v in values):
                raise BuilderError(f"builder {name!r} returned a non-finite reward")
            for i, r in enumerate(out.turn_rewards):
                turns[i] += weight * r
            for i, r in enumerate(out.outcome):
                outcome[i] += weight * r
            for signal, value in out.components.items():
                components[signal] = components.get(signal, 0.0) + weight * value
        credited = credit.assign(turns, outcome, self.spec.credit, credit.steps_of(credit.turn_groups(traj)))
        clipped = guards.clip(credited, self.spec.guards.clip_turn, self.spec.guards.clip_total)
        for key, delta in (("credit", sum(credited) - sum(turns) - sum(outcome)), ("clip", sum(clipped) - sum(credited))):
            if abs(delta) > _NOISE:
                components[key] = components.get(key, 0.0) + delta
        return RewardOutput(total=sum(clipped), turn_rewards=clipped, components=components)

    def scored(self, traj: TrajectoryEvent, out: RewardOutput, *, advantages: list[float] | None,
               held_out: bool) -> ScoredTrajectory:
        """The scored event for ``traj`` with its rewards ``out`` (deterministic given its inputs)."""
        return ScoredTrajectory(
            event_id=scored_event_id(traj.trajectory_id, traj.revision, self.spec.version),
            ts=traj.ts,
            tenant=traj.tenant,
            session_id=traj.session_id,
            trajectory_id=traj.trajectory_id,
            revision=traj.revision,
            model_line=traj.model_line,
            segments=traj.segments,
            turn_rewards=out.turn_rewards,
            total_reward=out.total,
            reward_components=out.components,
            reward_spec_version=self.spec.version,
            prompt_key=traj.prompt_key,
            turn_advantages=advantages,
            held_out=held_out,
            data_use=traj.data_use,
        )

    def held_out(self, traj: TrajectoryEvent) -> bool:
        return guards.is_held_out(traj.tenant, traj.session_id, self.spec.guards.held_out_fraction)

    def close(self) -> None:
        for judge in self._judges:
            judge.close()
