"""Promotion on evidence on a real database (SQLite and PostgreSQL): the controller's must_win and
must_not_lose gates on product metrics (serving/rollout_metrics.py), what a version observed of a
metric (flywheel/db/observed.py), and the settings that declare the gates (flywheel/promotion.py).

Sessions are inserted as ingest stores them: ``generations`` rows of a version, ``feedback`` rows
naming a metric (a declared one is kind ``custom`` with the metric's name as the signal, a boolean
recorded as 1.0 or 0.0).
"""

from __future__ import annotations

import random
import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from flywheel.db.models import Feedback, Generation
from flywheel.db.observed import NOTHING, observe
from flywheel.settings import RolloutSettings, SettingsError, load_settings
from serving.rollout import evaluate, status_report, step
from serving.rollout_record import record
from tests.integration.test_rollout_controller import LINE, publish, registry, statuses  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

DECLARED = {"solved": {"type": "boolean", "level": "session", "direction": "max"},
            "kept": {"type": "boolean", "level": "generation", "direction": "max"},
            "stars": {"type": "float", "level": "generation", "direction": "max", "min": 0, "max": 5},
            "note": {"type": "comment", "level": "generation"}}


def settings_with(**rollout) -> object:
    base = dict(canary_fraction=0.5, window_s=0, min_samples=50, max_window_s=3600)
    return load_settings(metrics={"declared": DECLARED}, rollout={**base, **rollout})


def add_session(db, version: int, turns: int, now: datetime, *, solved: bool | None = None,
                kept: list[bool] | None = None, stars: list[float | None] | None = None) -> str:
    """One session of ``turns`` generations by ``version``, with the metrics' reports."""
    session_id = f"s-{uuid.uuid4().hex[:10]}"

    def feedback(signal: str, value: float | None, generation_id: str | None) -> None:
        fid = uuid.uuid4().hex
        db.add(Feedback(event_id=fid, feedback_id=fid, tenant="acme", session_id=session_id,
                        generation_id=generation_id, kind="custom", signal=signal, value=value, ts=now,
                        state="pending", payload={}))

    for t in range(turns):
        gid = uuid.uuid4().hex
        db.add(Generation(event_id=gid, generation_id=gid, tenant="acme", session_id=session_id, model_line=LINE,
                          model_version=version, node_id="n1", ts=now,
                          payload={"generation_id": gid, "latency_ms": 100.0, "finish_reason": "stop"}))
        if kept is not None and t < len(kept):
            feedback("kept", 1.0 if kept[t] else 0.0, gid)
        if stars is not None and t < len(stars) and stars[t] is not None:
            feedback("stars", stars[t], gid)
    if solved is not None:
        feedback("solved", 1.0 if solved else 0.0, None)
    return session_id


def serve_sessions(sessions, version: int, n: int, solved_rate: float, seed: int, now: datetime | None = None) -> None:
    rng = random.Random(seed)
    now = now or datetime.now(UTC)
    with sessions() as db, db.begin():
        for _ in range(n):
            add_session(db, version, 2, now, solved=rng.random() < solved_rate)


def canary_run(registry, sessions, settings, stable_rate: float, canary_rate: float, n: int, seed: int) -> tuple:  # noqa: F811
    """A candidate made canary, then ``n`` sessions on each arm solved at the given rates; (v, metrics)."""
    metrics = settings.product_metrics()
    v1 = publish(registry)
    assert step(registry, sessions, settings.rollout, metrics=metrics).action == "canary"
    serve_sessions(sessions, 0, n, stable_rate, seed=seed)
    serve_sessions(sessions, v1, n, canary_rate, seed=seed + 1)
    return v1, metrics


def test_a_metric_is_observed_per_session_at_either_level(sessions) -> None:
    metrics = settings_with().product_metrics()
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        add_session(db, 1, 3, now, solved=True, kept=[True, False], stars=[4.0, None, 2.0])  # kept 1/3; stars 3
        add_session(db, 1, 1, now, solved=False, kept=[True], stars=[5.0])  # kept 1; stars 5
        add_session(db, 1, 2, now)  # no reports: kept 0; solved 0; no stars
        add_session(db, 2, 2, now - timedelta(hours=2), solved=True)  # before the window
    with sessions() as db:
        kept = observe(db, metrics.get("kept"), LINE, [1, 2], since=now - timedelta(minutes=1))
        solved = observe(db, metrics.get("solved"), LINE, [1, 2], since=now - timedelta(minutes=1))
        stars = observe(db, metrics.get("stars"), LINE, [1])
        everything = observe(db, metrics.get("solved"), LINE, [2])
        with pytest.raises(ValueError, match="comment"):
            observe(db, metrics.get("note"), LINE, [1])
    assert kept[1].n == 3 and kept[1].total == pytest.approx(1 / 3 + 1) and kept[2] == NOTHING
    assert kept[1].total_sq == pytest.approx(1 / 9 + 1)
    assert (solved[1].n, solved[1].total) == (3, 1.0)
    assert (stars[1].n, stars[1].total, stars[1].total_sq) == (2, 8.0, 34.0)
    assert (everything[2].n, everything[2].total) == (1, 1.0)


def test_a_canary_that_wins_its_must_win_gate_is_promoted(registry, sessions) -> None:  # noqa: F811
    settings = settings_with(must_win=[{"metric": "solved", "min_effect": 0.05}],
                             must_not_lose=[{"metric": "kept", "tolerance": 0.1}])
    v1, metrics = canary_run(registry, sessions, settings, 0.4, 0.7, 400, seed=1)
    d = step(registry, sessions, settings.rollout, metrics=metrics)
    assert (d.action, d.version) == ("promote", v1), d.reason
    assert "evidence of a win" in d.reason and "solved must_win" in d.reason
    verdicts = {v["metric"]: v for v in d.figures["evidence"]["verdicts"]}
    assert verdicts["solved"]["outcome"] == "win" and verdicts["solved"]["lower"] > 0.05
    assert verdicts["kept"]["outcome"] == "undecided" and verdicts["solved"]["n_canary"] == 400
    assert statuses(registry)[v1] == "stable"
    assert "evidence of a win" in registry.transitions(v1)[-1]["reason"]


def test_no_win_by_the_maximum_window_is_rolled_back_as_no_evidence(registry, sessions) -> None:  # noqa: F811
    settings = settings_with(must_win=[{"metric": "solved", "min_effect": 0.05}])
    v1, metrics = canary_run(registry, sessions, settings, 0.5, 0.5, 200, seed=3)
    d = step(registry, sessions, settings.rollout, metrics=metrics)
    assert d.action == "wait" and "waiting" in d.reason, d.reason
    later = datetime.now(UTC) + timedelta(seconds=3601)
    d = step(registry, sessions, settings.rollout, now=later, metrics=metrics)
    assert (d.action, d.version) == ("rollback", v1) and "no evidence of a win" in d.reason, d.reason
    assert statuses(registry)[v1] == "rolled_back"


def test_a_canary_that_loses_a_must_not_lose_gate_is_rolled_back_at_once(registry, sessions) -> None:  # noqa: F811
    settings = settings_with(must_not_lose=[{"metric": "solved", "tolerance": 0.02}], window_s=3600)
    v1, metrics = canary_run(registry, sessions, settings, 0.6, 0.3, 400, seed=5)
    d = step(registry, sessions, settings.rollout, metrics=metrics)
    assert (d.action, d.version) == ("rollback", v1) and d.reason.startswith(f"canary v{v1} vs v0: worse"), d.reason
    assert statuses(registry)[v1] == "rolled_back"


def test_each_look_continues_from_the_recorded_one_and_a_new_canary_run_starts_afresh(registry, sessions) -> None:  # noqa: F811
    settings = settings_with(must_win=[{"metric": "solved", "min_effect": 0.0, "mixing_sd": 0.1}], window_s=3600)
    v1, metrics = canary_run(registry, sessions, settings, 0.4, 0.6, 300, seed=7)
    first = evaluate(registry, sessions, settings.rollout, metrics=metrics)
    won = first.figures["evidence"]["verdicts"][0]
    assert won["outcome"] == "win" and first.action == "wait", first.reason
    assert re.search(r"window \d+/3600s; evidence of a win", first.reason), first.reason
    record(sessions, LINE, first)
    serve_sessions(sessions, v1, 600, 0.4, seed=9)  # the canary's lead melts away
    again = evaluate(registry, sessions, settings.rollout, metrics=metrics)
    verdict = again.figures["evidence"]["verdicts"][0]
    assert verdict["outcome"] == "win" and verdict["p"] == won["p"] and verdict["lower"] == won["lower"]
    fresh = evaluate(registry, sessions, settings.rollout, metrics=metrics)  # nothing recorded for this look
    assert fresh.figures["evidence"]["verdicts"][0]["p"] == won["p"]  # still the recorded run's
    with sessions() as db, db.begin():  # a record about another canary run is not continued
        from flywheel.db.models import RolloutDecisionRow

        db.get(RolloutDecisionRow, LINE).figures = {**first.figures, "evidence": {
            **first.figures["evidence"], "since": "2001-01-01T00:00:00+00:00"}}
    alone = evaluate(registry, sessions, settings.rollout, metrics=metrics)
    assert alone.figures["evidence"]["verdicts"][0]["p"] > won["p"]


def test_status_shows_the_gates_verdicts(registry, sessions) -> None:  # noqa: F811
    settings = settings_with(must_win=[{"metric": "solved", "min_effect": 0.05}])
    v1 = publish(registry)
    step(registry, sessions, settings.rollout, metrics=settings.product_metrics())
    report = status_report(registry, sessions, settings.rollout, metrics=settings.product_metrics())
    evidence = report["next_decision"]["figures"]["evidence"]
    assert evidence["canary"] == v1 and evidence["verdicts"][0]["metric"] == "solved"
    assert "fewer than min_samples" in evidence["reason"]


@pytest.mark.parametrize("rollout, message", [
    ({"must_win": [{"metric": "nope", "min_effect": 0.1}]}, r"rollout.must_win\[0\].metric: unknown metric 'nope'"),
    ({"must_win": [{"metric": "note", "min_effect": 0.1}]}, "is a comment without a direction"),
    ({"must_not_lose": [{"metric": "kept"}]}, r"rollout.must_not_lose\[0\]: with tolerance 0 .* mixing_sd"),
    ({"must_win": [{"metric": "solved", "min_effect": 1.0}]}, "absolute difference below 1"),
    ({"must_win": [{"metric": "solved", "min_effect": 0.1}, {"metric": "solved", "min_effect": 0.2}]}, "gated twice"),
    ({"must_win": [{"metric": "solved", "min_effect": 0.1}], "window_s": 7200, "max_window_s": 3600},
     "max_window_s .* is shorter than window_s"),
    ({"must_win": [{"metric": "solved", "min_effect": 0.1, "alpha": 0.6}]}, "alpha"),
    ({"must_win": [{"metric": "solved", "min_effect": 0.1, "power": 0.8}]}, "power"),
])
def test_settings_refuse_a_gate_the_controller_cannot_judge(rollout, message) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(metrics={"declared": DECLARED}, rollout=rollout)


def test_a_built_in_metric_can_be_gated_without_declaring_anything() -> None:
    settings = load_settings(rollout={"must_not_lose": [{"metric": "retry", "tolerance": 0.05}]})
    assert isinstance(settings.rollout, RolloutSettings) and settings.rollout.must_not_lose[0].margin == 0.05
