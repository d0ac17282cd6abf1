"""The rollout policy: the newest candidate newer than stable is promoted; nothing moves backwards."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from serving.rollout_policy import decide

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class V:
    version: int
    status: str


def test_nothing_to_decide():
    assert decide([]) is None
    assert decide([V(0, "stable")]) is None
    assert decide([V(0, "retired"), V(1, "stable"), V(2, "rolled_back")]) is None


def test_first_candidate_when_nothing_is_stable():
    assert decide([V(0, "candidate")]) == 0
    assert decide([V(0, "candidate"), V(1, "candidate")]) == 1


def test_newest_candidate_newer_than_stable_wins():
    versions = [V(0, "retired"), V(1, "stable"), V(2, "candidate"), V(3, "candidate"), V(4, "canary")]
    assert decide(versions) == 3


def test_candidates_older_than_stable_are_never_promoted():
    assert decide([V(0, "candidate"), V(1, "candidate"), V(2, "stable")]) is None


def test_gates_can_hold_back_a_candidate():
    versions = [V(1, "stable"), V(2, "candidate"), V(3, "candidate")]
    assert decide(versions, gates=[lambda v, _all: v.version != 3]) == 2
    assert decide(versions, gates=[lambda v, _all: False]) is None


def test_random_histories_match_a_direct_reading_of_the_rule():
    rng = random.Random()
    for _ in range(200):
        statuses = [rng.choice(["candidate", "retired", "rolled_back", "canary"]) for _ in range(rng.randint(0, 12))]
        if statuses and rng.random() < 0.7:
            statuses[rng.randrange(len(statuses))] = "stable"
        versions = [V(i, s) for i, s in enumerate(statuses)]
        rng.shuffle(versions)
        stable = max((v.version for v in versions if v.status == "stable"), default=-1)
        newer = [v.version for v in versions if v.status == "candidate" and v.version > stable]
        assert decide(versions) == (max(newer) if newer else None)
