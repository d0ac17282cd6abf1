"""Credit assignment across turns: per-turn rewards plus the session outcome, shared by a rule.

Builders (``rewards.builders``) leave two things per turn: the rewards of signals about that turn
(they stay where they are) and session outcomes anchored at a turn (the last turn, or the turn an
outcome names). The spec's ``[credit]`` rule decides which turns share an outcome ``o`` anchored at
turn ``a``; turns after the anchor never get any of it:

- ``discounted`` (default, ``discount`` = γ): turn ``a - k`` gets ``o * γ**k``; the anchor gets
  all of ``o``, earlier turns less the further back they are (γ = 1: every turn gets ``o``;
  γ = 0: the same as ``last_turn``). The session total grows by ``o * (γ + γ² + ...)``.
- ``last_turn``: the anchor gets ``o``; earlier turns nothing.
- ``uniform``: each of the ``a + 1`` turns up to the anchor gets ``o / (a + 1)``; the total is ``o``.

Worked example: three turns. Turn 0 is wrong (thumbs down -1, retry -0.5), turn 1 is wrong (retry
-0.5), turn 2 is right (thumbs up +1), then ``task_solved`` (outcome +1 at turn 2). Per-turn
rewards ``[-1.5, -0.5, 1.0]``, outcome ``1.0`` at turn 2:

- ``discounted``, γ = 0.5: shares ``[0.25, 0.5, 1.0]`` -> turn rewards ``[-1.25, 0.0, 2.0]``, total 0.75;
- ``last_turn``: ``[-1.5, -0.5, 2.0]``, total 0.0;
- ``uniform``: ``[-1.5 + 1/3, -0.5 + 1/3, 1.0 + 1/3]`` = ``[-1.1667, -0.1667, 1.3333]``, total 0.0.

All functions here are pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from rewards.spec import CreditSpec


def shares(rule: str, anchor: int, n: int, discount: float = 0.5) -> list[float]:
    """The fraction of an outcome anchored at turn ``anchor`` that each of ``n`` turns gets."""
    if not 0 <= anchor < n:
        raise ValueError(f"anchor {anchor} outside {n} turns")
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


def assign(turn_rewards: Sequence[float], outcome: Sequence[float], credit: CreditSpec) -> list[float]:
    """``turn_rewards`` plus every anchored outcome of ``outcome`` (same length, or empty) spread by ``credit``."""
    n = len(turn_rewards)
    if outcome and len(outcome) != n:
        raise ValueError(f"{len(outcome)} outcome slots for {n} turns")
    out = [float(r) for r in turn_rewards]
    for anchor, amount in enumerate(outcome):
        if amount:
            for i, share in enumerate(shares(credit.rule, anchor, n, credit.discount)):
                out[i] += amount * share
    return out
