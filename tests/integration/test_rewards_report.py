"""``flywheel rewards report`` on a real database (SQLite and PostgreSQL): beside the reward rows,
what each version they list observed of the product metrics (rewards/rescore.py), in the text
table and in ``--json`` (the list it always was, each row with ``metrics`` added).

Sessions are inserted as ingest stores them: ``generations`` rows of a version, ``feedback`` rows
naming a metric (a built-in keeps its kind; a declared one is kind ``custom``, a boolean recorded as
1.0 or 0.0); reward statistics as the rewards worker keeps them (``reward_version_stats``).
"""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import UTC, datetime

import pytest

from flywheel.db.models import Feedback, Generation, RewardVersionStats
from flywheel.settings import load_settings
from rewards.rescore import format_report, main, report

pytestmark = pytest.mark.integration

LINE = "report-line"
DECLARED = {"solved": {"type": "boolean", "level": "session", "direction": "max"},
            "kept": {"type": "boolean", "level": "generation", "direction": "max"},
            "stars": {"type": "float", "level": "generation", "direction": "max", "min": 0, "max": 5},
            "note": {"type": "comment", "level": "generation"}}


def add_session(db, version: int, turns: int, reports: list[tuple[str, str, float | None, int | None]] = (),
                line: str = LINE) -> None:
    """One session of ``turns`` generations by ``version``; ``reports`` as ``(kind, signal, value,
    turn index or None for the session)``."""
    session_id = f"s-{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    gids = [uuid.uuid4().hex for _ in range(turns)]
    for gid in gids:
        db.add(Generation(event_id=gid, generation_id=gid, tenant="acme", session_id=session_id, model_line=line,
                          model_version=version, node_id="n1", ts=now, payload={"generation_id": gid}))
    for kind, signal, value, turn in reports:
        fid = uuid.uuid4().hex
        db.add(Feedback(event_id=fid, feedback_id=fid, tenant="acme", session_id=session_id,
                        generation_id=None if turn is None else gids[turn], kind=kind, signal=signal, value=value,
                        ts=now, state="joined", payload={}))


def add_stats(db, spec: str, version: int, line: str = LINE) -> None:
    db.add(RewardVersionStats(model_line=line, model_version=version, reward_spec_version=spec, train_count=4,
                              train_sum=2.0, held_out_count=0, held_out_sum=0.0, flagged=False, flag_reason="",
                              updated_at=datetime.now(UTC)))


@pytest.fixture
def served(sessions, migrated_db_url, tmp_path):
    """v1: thumbs on two sessions (+1, -1), solved 1 of 3; v2: a retry in 1 of 2 sessions, solved 1 of 2,
    one answer not kept; v3 served but never scored; another line's session. Nobody reports stars or edits."""
    with sessions() as db, db.begin():
        add_session(db, 1, 2, [("explicit", "thumbs", 1.0, 0), ("custom", "solved", 1.0, None)])
        add_session(db, 1, 1, [("explicit", "thumbs", -1.0, 0), ("custom", "solved", 0.0, None)])
        add_session(db, 1, 1)
        add_session(db, 2, 1, [("implicit", "retry", None, 0), ("custom", "solved", 1.0, None)])
        add_session(db, 2, 2, [("custom", "kept", 0.0, 1)])
        add_session(db, 3, 1, [("explicit", "thumbs", 1.0, 0)])
        add_session(db, 1, 1, [("explicit", "thumbs", 1.0, 0)], line="other-line")
        for spec in ("spec-a", "spec-b"):
            add_stats(db, spec, 1)
            add_stats(db, spec, 2)
    return load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url},
                         metrics={"declared": DECLARED})


def test_each_listed_version_reports_the_metrics_its_line_observed(served) -> None:
    rows = report(served)
    assert [(r["spec_version"], r["version"]) for r in rows] == [("spec-a", 1), ("spec-a", 2), ("spec-b", 1),
                                                                  ("spec-b", 2)]
    v1, v2 = rows[0]["metrics"], rows[1]["metrics"]
    assert rows[2]["metrics"] == v1 and rows[3]["metrics"] == v2  # per version, whatever the spec
    seen = {(m["version"], m["metric"]): (m["sessions"], pytest.approx(m["mean"])) for m in v1 + v2}
    # thumbs: the two sessions that reported it (v2 reported none: no row); booleans, once some session
    # reports them (a retry; kept: a false report), every session served (v1's zeros included).
    # Nobody reports stars (a declared float) or rating: not listed.
    assert seen == {(1, "thumbs"): (2, 0.0), (1, "retry"): (3, 0.0), (1, "solved"): (3, 1 / 3), (1, "kept"): (3, 0.0),
                    (2, "retry"): (2, 0.5), (2, "solved"): (2, 0.5), (2, "kept"): (2, 0.0)}
    assert [m["metric"] for m in v1] == ["thumbs", "retry", "solved", "kept"]  # built-ins first, then declared
    assert v1[0] == {"model_line": LINE, "version": 1, "metric": "thumbs", "type": "float", "level": "generation",
                     "direction": "max", "sessions": 2, "mean": 0.0}
    assert {m["metric"]: (m["type"], m["level"], m["direction"]) for m in v2} == {
        "retry": ("boolean", "generation", "min"), "solved": ("boolean", "session", "max"),
        "kept": ("boolean", "generation", "max")}
    assert report(served, "no-such-spec") == []


def test_the_text_report_has_a_second_table_and_json_stays_a_list(served, capsys) -> None:
    text = format_report(report(served, "spec-a"))
    rewards, metrics = text.split("\n\n")
    assert "spec-a" in rewards and "+0.500" in rewards
    lines = metrics.splitlines()
    assert lines[0].startswith("product metrics per version, all time")
    body = [line.split() for line in lines[2:]]
    assert body == [[LINE, "1", "thumbs", "float", "generation", "max", "2", "0"],
                    [LINE, "1", "retry", "boolean", "generation", "min", "3", "0"],
                    [LINE, "1", "solved", "boolean", "session", "max", "3", "0.3333"],
                    [LINE, "1", "kept", "boolean", "generation", "max", "3", "0"],
                    [LINE, "2", "retry", "boolean", "generation", "min", "2", "0.5"],
                    [LINE, "2", "solved", "boolean", "session", "max", "2", "0.5"],
                    [LINE, "2", "kept", "boolean", "generation", "max", "2", "0"]]
    assert main(argparse.Namespace(action="report", spec_version=None, json=True), served) == 0
    printed = json.loads(capsys.readouterr().out)
    assert isinstance(printed, list) and len(printed) == 4
    assert {"train_count", "held_out_rate", "flagged", "metrics"} <= set(printed[0])
    assert printed[0]["metrics"][2] == {"model_line": LINE, "version": 1, "metric": "solved", "type": "boolean",
                                        "level": "session", "direction": "max", "sessions": 3,
                                        "mean": pytest.approx(1 / 3)}


def test_versions_nobody_reported_on_say_so(sessions, migrated_db_url, tmp_path) -> None:
    with sessions() as db, db.begin():
        add_session(db, 1, 2)
        add_stats(db, "spec-a", 1)
    settings = load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url})
    rows = report(settings)
    assert rows[0]["metrics"] == []
    assert format_report(rows).endswith("no product metrics observed on these versions (no feedback reports a metric)")
