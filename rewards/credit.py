"""Credit assignment across turns: per-turn rewards plus the session outcome, shared by a rule.

Builders (``rewards.builders``) leave two things per turn: the rewards of signals about that turn
(they stay where they are) and session outcomes anchored at a turn (the turn an outcome names; a
session-level outcome is split evenly over the last step's turns).

Credit moves along *steps*, not turns: the turns of one sampled group (the ``n > 1`` choices of one
request, sharing a non-None ``Turn.group_id``) are one step, every other turn is a step of its own,
and steps are numbered in turn order, a group's step where its first turn is (:func:`steps_of`).
Without groups, step ``i`` is turn ``i``. An outcome anchored at a turn is anchored at that turn's
step: the anchor turn gets the anchor step's share and its siblings none (an outcome about one
choice, a verifier's ``tests_passed`` say, is that choice's), and every turn of an earlier step
gets that step's share (a user who went on from one of several choices sends a prompt that does
not say which, so all of them do).

The spec's ``[credit]`` rule decides which steps share an outcome ``o`` anchored at step ``a``;
steps after the anchor never get any of it:

- ``discounted`` (default, ``discount`` = γ): step ``a - k`` gets ``o * γ**k``; the anchor gets
  all of ``o``, earlier steps less the further back they are (γ = 1: every step gets ``o``;
  γ = 0: the same as ``last_turn``). The session total grows by ``o * (γ + γ² + ...)``.
- ``last_turn``: the anchor gets ``o``; earlier steps nothing.
- ``uniform``: each of the ``a + 1`` steps up to the anchor gets ``o / (a + 1)``; the total is ``o``
  when no earlier step has siblings (each sibling of an earlier step gets the step's share).

Worked example: three turns. Turn 0 is wrong (thumbs down -1, retry -0.5), turn 1 is wrong (retry
-0.5), turn 2 is right (thumbs up +1), then ``task_solved`` (outcome +1 at turn 2). Per-turn
rewards ``[-1.5, -0.5, 1.0]``, outcome ``1.0`` at turn 2:

- ``discounted``, γ = 0.5: shares ``[0.25, 0.5, 1.0]`` -> turn rewards ``[-1.25, 0.0, 2.0]``, total 0.75;
- ``last_turn``: ``[-1.5, -0.5, 2.0]``, total 0.0;
- ``uniform``: ``[-1.5 + 1/3, -0.5 + 1/3, 1.0 + 1/3]`` = ``[-1.1667, -0.1667, 1.3333]``, total 0.0.

With a group: turn 0 alone, then one request for three choices (choices 0-2 are turns 1-3, steps
``[0, 1, 1, 1]``). Choice 1 gets a thumbs up (+1), choice 2 a thumbs down (-1), then
``task_solved`` naming no generation (+1, a third anchored at each choice). Per-turn rewards
``[0, 0, 1, -1]``, outcome slots ``[0, 1/3, 1/3, 1/3]``:

- ``discounted``, γ = 0.5: ``[0.5, 1/3, 4/3, -2/3]``, total 1.5, as a one-choice session's;
- ``last_turn``: ``[0.0, 1/3, 4/3, -2/3]``, total 1.0;
- ``uniform``: ``[0.5, 1/6, 7/6, -5/6]``, total 1.0.

Under ``discounted`` the choices' leave-one-out baselines (``rewards.normalise``) are
``[1/3, -1/6, 5/6]``: centred ``[0.0, 1.5, -1.5]``, the thumbs alone, the shared outcome gone. Had
``tests_passed`` (+1) named choice 1 instead, choice 1 alone would get it: ``[0.5, 0.0, 2.0, -1.0]``.

All functions here are pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.events import TrajectoryEvent
from rewards.spec import CreditSpec


def turn_groups(traj: TrajectoryEvent) -> list[str | None]:
    """The sampled group of each turn of ``traj`` (in turn order across segments); None: n = 1."""
    return [turn.group_id for segment in traj.segments for turn in segment.turns]


def steps_of(groups: Sequence[str | None]) -> list[int]:
    """The step of each turn, given each turn's group (module docstring): turns of one non-None
    group are one step, numbered where the group's first turn is; every other turn is its own."""
    step_of_group: dict[str, int] = {}
    out: list[int] = []
    count = 0
    for group in groups:
        if group is None:
            out.append(count)
            count += 1
        else:
            if group not in step_of_group:
                step_of_group[group] = count
                count += 1
            out.append(step_of_group[group])
    return out


def shares(rule: str, anchor: int, n: int, discount: float = 0.5) -> list[float]:
    """The fraction of an outcome anchored at step ``anchor`` that each of ``n`` steps gets."""
    if not 0 <= anchor < n:
        raise ValueError(f"anchor {anchor} outside {n} steps")
    out = [0.0] * n
    if rule == "discounted":
        for k in range(anchor + 1):
            out[anchor - k] = discount**k
    elif rule == "last_turn":
        out[anchor] = 1.0
    elif rule == "uniform":
        for i in range(anchor + 1):
            out[i] = 1.0 / (anchor + 1)
    else:
        raise ValueError(f"unknown credit rule {rule!r}")
    return out


def assign(turn_rewards: Sequence[float], outcome: Sequence[float], credit: CreditSpec,
           steps: Sequence[int] | None = None) -> list[float]:
    """``turn_rewards`` plus every anchored outcome of ``outcome`` (same length, or empty) spread by
    ``credit`` over ``steps``, the step of each turn (:func:`steps_of`; None: each turn its own)."""
    n = len(turn_rewards)
    if outcome and len(outcome) != n:
        raise ValueError(f"{len(outcome)} outcome slots for {n} turns")
    steps = list(range(n)) if steps is None else list(steps)
    n_steps = max(steps, default=-1) + 1
    if len(steps) != n or set(steps) != set(range(n_steps)):
        raise ValueError(f"steps {steps} are not a numbering of {n} turns into consecutive steps")
    out = [float(r) for r in turn_rewards]
    for anchor, amount in enumerate(outcome):
        if amount:
            per_step = shares(credit.rule, steps[anchor], n_steps, credit.discount)
            for i, step in enumerate(steps):
                if step != steps[anchor] or i == anchor:  # the anchor's siblings get none of it
                    out[i] += amount * per_step[step]
    return out
