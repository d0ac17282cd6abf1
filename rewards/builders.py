"""Reward builders: pure functions ``(trajectory, spec) -> RewardOutput``.

No IO and no clock: the same trajectory and spec always give the same rewards, so a score can be
recomputed from the stored trajectory at any time. Every builder returns one reward per turn, in
the order of the turns across segments (the order ``ScoredTrajectory.turn_rewards`` uses), and
``total == sum(turn_rewards) == sum(components.values())``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.events import FeedbackEvent, TrajectoryEvent
from flywheel.settings import RewardSettings


@dataclass(frozen=True)
class RewardOutput:
    total: float
    #: One reward per turn, in turn order across segments.
    turn_rewards: list[float]
    #: Per-signal sums (``thumbs``, ``rating``, ``retry``, ``abandon``, ``outcome``), present signals only.
    components: dict[str, float] = field(default_factory=dict)


def normalise_rating(value: float) -> float:
    """A rating on the 1..5 scale maps linearly to [-1, 1] (3 -> 0); anything else is clamped to [-1, 1]."""
    if 1.0 <= value <= 5.0:
        return (value - 3.0) / 2.0
    return max(-1.0, min(1.0, value))


def outcome_value(fb: FeedbackEvent, spec: RewardSettings) -> float:
    """``value`` 1 (or missing) -> ``outcome_success``, 0 -> ``outcome_failure``, linear in between
    (a fraction of tests passed); values outside [0, 1] are clamped."""
    v = 1.0 if fb.value is None else max(0.0, min(1.0, fb.value))
    return spec.outcome_failure + v * (spec.outcome_success - spec.outcome_failure)


def explicit_outcome_reward(traj: TrajectoryEvent, spec: RewardSettings) -> RewardOutput:
    """Score a trajectory from its explicit, implicit and outcome feedback.

    Per-turn signals land on the turn whose generation they name; a session-level one (no
    ``generation_id``) lands on the last turn; feedback naming a generation outside the trajectory
    is ignored. Signals:

    - ``thumbs``: value > 0 -> ``spec.thumbs_up``, value < 0 -> ``spec.thumbs_down`` (0/None: nothing);
    - ``rating``: :func:`normalise_rating` (1..5 -> [-1, 1]);
    - ``retry``: ``spec.retry_penalty`` on the generation the user retried (the one named);
    - ``abandon``: ``spec.abandon_penalty`` on the last turn, whatever it names;
    - outcomes (``task_solved``, ``tests_passed``): :func:`outcome_value`, credited by the rule below.
    Other signals (comments, edits, custom) do not score in this spec.

    Outcome credit rule: the anchor is the last turn (or the turn an outcome names). The anchor gets
    the full outcome value ``o``; a turn ``k`` turns before the anchor gets ``o * outcome_discount**k``;
    turns after the anchor get nothing from it. Worked example, three turns, ``outcome_discount=0.5``,
    ``task_solved`` value 1, ``outcome_success=1.0``: turn rewards ``[0.25, 0.5, 1.0]``; add a
    thumbs-down (``-1.0``) on turn 0 and they become ``[-0.75, 0.5, 1.0]``, total ``0.75``,
    components ``{"outcome": 1.75, "thumbs": -1.0}``.
    """
    turn_ids = [turn.generation_id for segment in traj.segments for turn in segment.turns]
    n = len(turn_ids)
    rewards = [0.0] * n
    components: dict[str, float] = {}
    if n == 0:
        return RewardOutput(total=0.0, turn_rewards=[], components={})
    index = {gid: i for i, gid in enumerate(turn_ids)}
    last = n - 1

    def credit(signal: str, turn: int, amount: float) -> None:
        rewards[turn] += amount
        components[signal] = components.get(signal, 0.0) + amount

    for fb in traj.feedback:
        if fb.generation_id is None:
            turn = last
        elif fb.generation_id in index:
            turn = index[fb.generation_id]
        else:
            continue
        if fb.signal == "thumbs":
            if fb.value is not None and fb.value > 0:
                credit("thumbs", turn, spec.thumbs_up)
            elif fb.value is not None and fb.value < 0:
                credit("thumbs", turn, spec.thumbs_down)
        elif fb.signal == "rating":
            if fb.value is not None:
                credit("rating", turn, normalise_rating(fb.value))
        elif fb.signal == "retry":
            credit("retry", turn, spec.retry_penalty)
        elif fb.signal == "abandon":
            credit("abandon", last, spec.abandon_penalty)
        elif fb.kind == "outcome":
            value = outcome_value(fb, spec)
            for k, i in enumerate(range(turn, -1, -1)):
                credit("outcome", i, value * spec.outcome_discount**k)
    return RewardOutput(total=sum(rewards), turn_rewards=rewards, components=components)
