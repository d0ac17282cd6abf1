"""Reward builders: pure functions ``(trajectory, params) -> RewardOutput``.

No IO and no clock (the LLM judge, ``rewards.judge``, is the one builder that calls out, and it is
off by default): the same trajectory and params always give the same rewards, so a score can be
recomputed from the stored trajectory at any time (``flywheel rewards rescore``).

A builder returns, for the ``n`` turns of the trajectory in order across segments:

- ``turn_rewards`` (``n`` floats): rewards for signals about one turn, which stay on that turn;
- ``outcome`` (``n`` floats, or empty for none): session outcomes, each at the turn it is anchored
  to (the turn an outcome names, else the last turn); the spec's credit rule (``rewards.credit``)
  spreads them over the steps up to their anchor's;
- ``components``: the same amounts summed per signal name.

Invariant of a builder's output: ``total == sum(turn_rewards) + sum(outcome) == sum(components.values())``.
:class:`Ledger` keeps it for any builder, custom ones included.

Where signals land: feedback naming a generation lands on that turn, whichever choice of a sampled
group it is (a verifier's ``tests_passed`` on choice 2 is choice 2's alone); feedback naming a
generation outside the trajectory is ignored; session-level feedback (naming no generation: explicit,
implicit and outcomes) lands on the last step, and ``abandon`` always does (abandoning is about how
the session ended). The last step is the last turn, or, when the session ended on an ``n > 1``
request, its ``k`` choices (``rewards.credit.steps_of``), each getting ``1/k`` of the amount
(:meth:`Ledger.parts`): a session-level signal weighs the same whatever ``n`` was, says nothing
about one choice against another, and spreads to earlier steps as from one turn (``rewards.credit``).
For a session without groups all of this is "the last turn", as it always was.

The ``metrics`` builder maps a deployment's own product metrics (any feedback signal, by name) the
same way: a ``generation``-level metric as explicit feedback, a ``session``-level one as an outcome.
The guards that read the turns' text live in ``rewards.text_guards``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flywheel.events import FeedbackEvent, TrajectoryEvent
from rewards.credit import steps_of, turn_groups
from rewards.spec import BooleanMetric, ExplicitParams, FloatMetric, ImplicitParams, LengthParams, MetricsParams, OutcomeParams


@dataclass(frozen=True)
class RewardOutput:
    total: float
    #: One reward per turn, in turn order across segments.
    turn_rewards: list[float]
    #: Per-signal sums; a scorer's final output adds ``credit`` and ``clip`` (rewards.scorer).
    components: dict[str, float] = field(default_factory=dict)
    #: A builder's session outcomes by anchor turn, before the credit rule (empty: none). A
    #: scorer's final output has none: they are in ``turn_rewards``.
    outcome: list[float] = field(default_factory=list)


#: What every builder is: ``params`` is the builder's validated params model (a dict for custom builders).
Builder = Callable[[TrajectoryEvent, Any], RewardOutput]


class Ledger:
    """Where a builder writes its credits; :meth:`output` returns them as a :class:`RewardOutput`."""

    def __init__(self, traj: TrajectoryEvent) -> None:
        self.turn_ids = [turn.generation_id for segment in traj.segments for turn in segment.turns]
        self.n = len(self.turn_ids)
        #: The step of each turn (``rewards.credit.steps_of``); the turns of the last step, in turn
        #: order (empty: no turns); and the last of those, where session-level outcomes are anchored.
        self.steps = steps_of(turn_groups(traj))
        final = max(self.steps, default=-1)
        self.last_step = [i for i, step in enumerate(self.steps) if step == final]
        self.last = self.last_step[-1] if self.last_step else None
        self._index = {gid: i for i, gid in enumerate(self.turn_ids)}
        self._turns = [0.0] * self.n
        self._outcome = [0.0] * self.n
        self._components: dict[str, float] = {}

    def target(self, fb: FeedbackEvent) -> int | None:
        """The turn an outcome ``fb`` is anchored at: the one it names, :attr:`last` when it names
        none, ``None`` when it names a generation outside the trajectory (or there are no turns)."""
        if fb.generation_id is None:
            return self.last
        return self._index.get(fb.generation_id)

    def parts(self, fb: FeedbackEvent) -> list[tuple[int, float]]:
        """Where ``fb`` lands, as ``(turn, fraction of its amount)``: all of it on the turn it names;
        split evenly over the turns of the last step when it names none (:meth:`last_parts`);
        nowhere when it names a generation outside the trajectory (or there are no turns)."""
        if fb.generation_id is None:
            return self.last_parts()
        i = self._index.get(fb.generation_id)
        return [] if i is None else [(i, 1.0)]

    def last_parts(self) -> list[tuple[int, float]]:
        """The last step's turns, each with an equal fraction: a session-level signal weighs the same
        whatever ``n`` the session ended with."""
        return [(i, 1.0 / len(self.last_step)) for i in self.last_step]

    def turn(self, signal: str, i: int, amount: float) -> None:
        """A reward for turn ``i`` only."""
        self._turns[i] += amount
        self._components[signal] = self._components.get(signal, 0.0) + amount

    def session(self, signal: str, anchor: int, amount: float) -> None:
        """A session outcome anchored at turn ``anchor`` (the credit rule spreads it)."""
        self._outcome[anchor] += amount
        self._components[signal] = self._components.get(signal, 0.0) + amount

    def output(self) -> RewardOutput:
        total = sum(self._turns) + sum(self._outcome)
        return RewardOutput(total, list(self._turns), dict(self._components), list(self._outcome))


def scale_rating(value: float, p: ExplicitParams) -> float:
    """``rating_min..rating_max`` maps linearly to ``[-1, 1]`` (the middle to 0); values outside clamp."""
    x = 2.0 * (value - p.rating_min) / (p.rating_max - p.rating_min) - 1.0
    return max(-1.0, min(1.0, x))


def explicit(traj: TrajectoryEvent, p: ExplicitParams) -> RewardOutput:
    """``thumbs``: value > 0 -> ``thumbs_up``, < 0 -> ``thumbs_down`` (0 or missing: nothing);
    ``rating``: :func:`scale_rating` times ``rating``. Comments do not score."""
    ledger = Ledger(traj)
    for fb in traj.feedback:
        if fb.kind != "explicit" or fb.value is None:
            continue
        if fb.signal == "thumbs" and fb.value != 0:
            amount = p.thumbs_up if fb.value > 0 else p.thumbs_down
        elif fb.signal == "rating":
            amount = p.rating * scale_rating(fb.value, p)
        else:
            continue
        for i, part in ledger.parts(fb):
            ledger.turn(fb.signal, i, amount * part)
    return ledger.output()


def implicit(traj: TrajectoryEvent, p: ImplicitParams) -> RewardOutput:
    """``edit_accepted``, ``edit_rejected``, ``retry``: their amount on the turn;
    ``text_kept``: ``text_kept`` times the kept fraction (value clamped to [0, 1], missing = 1);
    ``abandon``: its amount on the last step, whatever it names (if it names one of this trajectory)."""
    ledger = Ledger(traj)
    for fb in traj.feedback:
        if fb.kind != "implicit" or not (parts := ledger.parts(fb)):
            continue
        if fb.signal == "abandon":
            amount, parts = p.abandon, ledger.last_parts()
        elif fb.signal == "text_kept":
            amount = p.text_kept * (1.0 if fb.value is None else max(0.0, min(1.0, fb.value)))
        elif fb.signal in ("edit_accepted", "edit_rejected", "retry"):
            amount = getattr(p, fb.signal)
        else:
            continue
        for i, part in parts:
            ledger.turn(fb.signal, i, amount * part)
    return ledger.output()


def outcome(traj: TrajectoryEvent, p: OutcomeParams) -> RewardOutput:
    """``task_solved`` / ``tests_passed``: value 1 (or missing) -> ``success``, 0 -> ``failure``,
    linear in between (a fraction of tests passed; clamped to [0, 1]); a session outcome anchored
    at the turn it names, else split over the last step's turns (:meth:`Ledger.parts`)."""
    ledger = Ledger(traj)
    for fb in traj.feedback:
        if fb.kind != "outcome":
            continue
        v = 1.0 if fb.value is None else max(0.0, min(1.0, fb.value))
        for i, part in ledger.parts(fb):
            ledger.session("outcome", i, (p.failure + v * (p.success - p.failure)) * part)
    return ledger.output()


def length_penalty(traj: TrajectoryEvent, p: LengthParams) -> RewardOutput:
    """Each turn: ``-min(max_penalty, per_token * max(0, completion tokens - free_tokens))``."""
    ledger = Ledger(traj)
    i = 0
    for segment in traj.segments:
        for turn in segment.turns:
            over = max(0, (turn.end - turn.start) - p.free_tokens)
            if over and p.per_token:
                ledger.turn("length", i, -min(p.max_penalty, p.per_token * over))
            i += 1
    return ledger.output()


def metric_value(m: BooleanMetric | FloatMetric, value: float | None) -> float | None:
    """What one event of metric ``m`` with ``value`` is worth (``rewards.spec.MetricSignal``);
    ``None``: nothing (a float metric's event without a value)."""
    if isinstance(m, BooleanMetric):
        return m.when_true if value is None or value > 0 else m.when_false
    if value is None:
        return None
    v = max(m.low, min(m.high, value))
    return m.at_low + (v - m.low) / (m.high - m.low) * (m.at_high - m.at_low)


def metrics(traj: TrajectoryEvent, p: MetricsParams) -> RewardOutput:
    """Product metrics by name: every feedback event whose ``signal`` is one of ``p.signals``,
    whatever its kind, is worth :func:`metric_value`; a ``generation``-level metric's reward stays on
    the turn the event names, a ``session``-level one is a session outcome anchored there (both land
    on the last step when the event names no generation). Components are named by signal."""
    ledger = Ledger(traj)
    for fb in traj.feedback:
        m = p.signals.get(fb.signal)
        if m is None or (amount := metric_value(m, fb.value)) is None:
            continue
        for i, part in ledger.parts(fb):
            if m.level == "generation":
                ledger.turn(fb.signal, i, amount * part)
            else:
                ledger.session(fb.signal, i, amount * part)
    return ledger.output()


BUILTIN: Mapping[str, Builder] = {
    "explicit": explicit,
    "implicit": implicit,
    "outcome": outcome,
    "length": length_penalty,
    "metrics": metrics,
}
