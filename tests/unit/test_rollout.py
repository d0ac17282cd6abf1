"""The rollout policy: the newest candidate newer than stable is promoted; nothing moves backwards;
a pinned line decides nothing; rollout versions on the command line."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from flywheel.weights.registry import PinInfo
from launch.cli import build_parser
from serving.rollout import Decision, pinned_decision
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


# --- pinned lines (serving/rollout.py) --------------------------------------------------------------

PIN = PinInfo("line", 3, "alice@ops", "incident 42", datetime(2025, 3, 4, 12, 0, tzinfo=UTC))


def test_a_pinned_decision_changes_nothing_and_says_who_pinned_and_what_it_holds_back():
    versions = [V(0, "retired"), V(2, "candidate"), V(3, "stable"), V(4, "candidate"), V(5, "rolled_back"),
                V(6, "candidate")]
    d = pinned_decision(PIN, versions)
    assert (d.action, d.version, d.changed) == ("pinned", 3, False)
    assert d.reason == ("model line pinned to v3 by alice@ops at 2025-03-04T12:00:00+00:00: incident 42; automatic "
                        "rollout is frozen until `flywheel rollout unpin`; holding back candidates v4, v6")
    assert d.figures == {"pin": {"version": 3, "by": "alice@ops", "at": "2025-03-04T12:00:00+00:00",
                                 "reason": "incident 42"}, "held": [4, 6]}
    assert decide(versions) == 6  # what the unpinned controller would pick


def test_a_pinned_decision_without_candidates_or_reason():
    pin = PinInfo("line", 0, "bob@h", "", PIN.at)
    d = pinned_decision(pin, [V(0, "stable")])
    assert d.reason.endswith("at 2025-03-04T12:00:00+00:00; automatic rollout is frozen until `flywheel rollout unpin`")
    assert d.figures["held"] == []


def test_only_status_changing_actions_count_as_changes():
    assert [Decision(a, 1, "").changed for a in ("none", "wait", "pinned", "canary", "promote", "rollback")] == [
        False, False, False, True, True, True]


@pytest.mark.parametrize(("argv", "version"), [
    (["pin", "3"], 3), (["pin", "v3"], 3), (["pin", "V12"], 12), (["pin", "my-line:7"], ("my-line", 7)),
    (["pin", "a/b:v0"], ("a/b", 0)), (["promote", "5", "--force"], 5), (["unpin"], None),
])
def test_rollout_versions_parse(argv, version):
    args = build_parser().parse_args(["rollout", *argv])
    assert (args.action, args.version) == (argv[0], version)
    assert args.force == ("--force" in argv)


@pytest.mark.parametrize("bad", ["x3", "-1", ":3", "line:", "3.0", "v", "²", str(2**31), "line:x"])
def test_malformed_rollout_versions_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["rollout", "pin", bad])
    assert exit_.value.code == 2
    assert "expected V, vV or LINE:V" in capsys.readouterr().err
