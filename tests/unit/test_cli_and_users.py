"""The console script's validation-first behaviour and the simulated users' pure reactions."""

import json
import random

import pytest

from demo.users import Behaviour, react
from flywheel.events import FeedbackEvent
from launch.cli import main

pytestmark = pytest.mark.unit


def test_schema_prints_every_wire_contract(capsys):
    assert main(["schema"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == 1
    assert set(out["events"]) == {"GenerationEvent", "FeedbackEvent", "TrajectoryEvent", "ScoredTrajectory", "VersionEvent"}
    assert "completion_logprobs" in out["events"]["GenerationEvent"]["properties"]


def test_invalid_settings_exit_2_with_every_problem(monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_TRAINER__LR", "-1")
    monkeypatch.setenv("FLYWHEEL_GATEWAY__PORT", "99999")
    assert main(["settings"]) == 2
    err = capsys.readouterr().err
    assert "2 invalid setting(s)" in err and "trainer.lr" in err and "gateway.port" in err


def test_right_answers_end_the_session_with_a_solved_outcome():
    for seed in range(50):
        r = react(random.Random(seed), Behaviour(), correct=True, attempt=0, generation_id="g")
        assert not r.retry and r.feedback[-1] == {"kind": "outcome", "signal": "task_solved", "value": 1}


def test_wrong_answers_retry_until_the_last_attempt_then_abandon():
    b = Behaviour(p_retry_when_wrong=1.0, max_attempts=3)
    rng = random.Random(0)
    assert react(rng, b, correct=False, attempt=0, generation_id="g").retry
    last = react(rng, b, correct=False, attempt=2, generation_id="g")
    assert not last.retry and last.feedback[-1]["signal"] == "abandon"


def test_a_success_metric_is_reported_true_when_solved_and_false_when_given_up():
    b = Behaviour(p_retry_when_wrong=0.0, success_metric="solved")
    assert react(random.Random(1), b, correct=True, attempt=0, generation_id="g").feedback[-1] == {
        "metric": "solved", "value": True}
    assert react(random.Random(1), b, correct=False, attempt=0, generation_id="g").feedback[-1] == {
        "metric": "solved", "value": False}
    retrying = react(random.Random(1), Behaviour(p_retry_when_wrong=1.0, success_metric="solved"), False, 0, "g")
    assert retrying.retry and all("metric" not in item for item in retrying.feedback)  # the session goes on


def test_the_demo_summarises_its_canaries_from_the_audit_log():
    from datetime import UTC, datetime, timedelta

    from demo.run import rollout_summary

    t0 = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)

    def at(s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    log = [{"version": 0, "from_status": "candidate", "to_status": "stable", "reason": "up", "at": at(-5)},
           {"version": 3, "from_status": "candidate", "to_status": "canary", "reason": "rollout: canary", "at": at(10)},
           {"version": 3, "from_status": "canary", "to_status": "stable", "reason": "rollout: evidence of a win",
            "at": at(70)},
           {"version": 0, "from_status": "stable", "to_status": "retired", "reason": "v3 promoted", "at": at(70)},
           {"version": 9, "from_status": "candidate", "to_status": "canary", "reason": "rollout: canary", "at": at(74)},
           {"version": 9, "from_status": "canary", "to_status": "rolled_back",
            "reason": "rollout: canary v9 vs v3: no evidence of a win after 180s", "at": at(254)},
           {"version": 12, "from_status": "candidate", "to_status": "canary", "reason": "rollout: canary", "at": at(258)}]
    s = rollout_summary(log, t0)
    assert (s["promotions"], s["direct_promotions"], s["rollbacks_no_evidence"], s["rollbacks_other"]) == (1, 1, 1, 0)
    assert s["seconds_to_promotion"] == [60.0]
    assert [(c["version"], c["outcome"]) for c in s["canaries"]] == [(3, "promoted"), (9, "rolled_back"), (12, "running")]


def test_every_reaction_is_valid_feedback():
    rng = random.Random(7)
    for attempt in range(3):
        for correct in (True, False):
            for item in react(rng, Behaviour(), correct, attempt, "gen-1").feedback:
                FeedbackEvent(tenant="t", session_id="s", feedback_id="f", **item)  # raises if invalid


@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_up_registers_the_base_model_except_on_an_adapter_line(tmp_path, tiny_model_dir, publish) -> None:
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.settings import load_settings
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store
    from launch.up import prepare

    settings = prepare(load_settings(None, data_dir=str(tmp_path), model={"path": str(tiny_model_dir)},
                                     trainer={"lora_rank": 4, "lora_publish": publish}))
    registry = Registry(make_session_factory(make_engine(settings.database_url)), make_store(settings), settings.model.line)
    latest = registry.latest()
    # An adapter line's v0 is the zero adapter (the LoRA node or the trainer registers it), never full weights.
    assert (latest is None) if publish == "adapter" else (latest is not None and latest.version == 0 and latest.kind == "full")


def test_every_name_in_the_command_tables_resolves():
    from launch.cli import COMMANDS, ROLES, resolve
    from launch.up import DEFAULT_MODEL

    for target in [*ROLES.values(), *COMMANDS.values(), DEFAULT_MODEL]:
        assert callable(resolve(target)), target
