"""``flywheel data export`` on SQLite and PostgreSQL: one end user's (or one session's) rows and no
one else's, the raw id only where the user typed it, the command's exit codes and its 0600 file."""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flywheel.data_cli import main
from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, TrainedTrajectory, Trajectory
from flywheel.identity import SECRET_FILE, load_secret, user_hash
from flywheel.settings import load_settings
from flywheel.subjects import KINDS, Subject, export, user_subject
from launch.cli import build_parser
from launch.cli import main as cli_main

pytestmark = pytest.mark.integration

SECRET = "s" * 40
RAW = "alice@example.com"  # one raw id, for a user of acme and a user of globex: two people
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _generation(tenant: str, session_id: str, gen_id: str, user: str | None, text: str, secret: str = SECRET,
                minute: int = 0) -> Generation:
    hashed = None if user is None else user_hash(secret, tenant, user)
    payload: dict[str, Any] = {"generation_id": gen_id, "tenant": tenant, "session_id": session_id,
                               "request": {"messages": [{"role": "user", "content": text}]},
                               "response": {"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
                               "completion_logprobs": [-0.5]}
    if hashed is not None:
        payload["user_hash"] = hashed
    return Generation(event_id=f"ev-{gen_id}", generation_id=gen_id, tenant=tenant, session_id=session_id,
                      model_line="line", model_version=1, node_id="n1", ts=T0 + timedelta(minutes=minute),
                      payload=payload, user_hash=hashed)


def _feedback(tenant: str, session_id: str, fid: str, gen_id: str | None) -> Feedback:
    return Feedback(event_id=f"fe-{tenant}-{fid}", feedback_id=fid, tenant=tenant, session_id=session_id,
                    generation_id=gen_id, kind="explicit", signal="thumbs", value=1.0, ts=T0, state="joined",
                    payload={"feedback_id": fid, "signal": "thumbs", "value": 1.0, "generation_id": gen_id})


def _session(tenant: str, session_id: str) -> list[Any]:
    """A closed session's row, its trajectory (two revisions), their scores under two specs, and its trained row."""
    tid = f"tr-{tenant}-{session_id}"
    rows: list[Any] = [SessionState(tenant=tenant, session_id=session_id, status="closed", last_event_at=T0,
                                    closed_at=T0, revision=1)]
    for revision in (0, 1):
        rows.append(Trajectory(trajectory_id=tid, revision=revision, event_id=f"te-{tid}-{revision}", tenant=tenant,
                               session_id=session_id, model_line="line", closed_reason="outcome", ts=T0,
                               payload={"trajectory_id": tid, "revision": revision, "segments": []}))
        for spec in ("v1", "v2"):
            rows.append(ScoredTrajectoryRow(trajectory_id=tid, revision=revision, reward_spec_version=spec,
                                            event_id=f"se-{tid}-{revision}-{spec}", tenant=tenant, total_reward=0.5,
                                            ts=T0, payload={"trajectory_id": tid, "total_reward": 0.5}))
    rows.append(TrainedTrajectory(trajectory_id=tid, model_line="line", version=3, trained_at=T0))
    return rows


@pytest.fixture
def stored(sessions):
    """acme's alice (s1 hers alone, s2 shared with bob, s3 with a turn that names no user), acme's
    bob (s2, s4), and globex's user with alice's raw id in a session also called s1."""
    rows: list[Any] = [
        _generation("acme", "s1", "g1", RAW, f"hi, I am {RAW}, sort these letters"),
        _generation("acme", "s1", "g2", RAW, "and these", minute=1),
        _generation("acme", "s2", "g3", RAW, "alice in a shared session"),
        _generation("acme", "s2", "g4", "bob", "bob in the shared session"),
        _generation("acme", "s3", "g5", RAW, "alice again"),
        _generation("acme", "s3", "g6", None, "no user named"),
        _generation("acme", "s4", "g7", "bob", "bob alone"),
        _generation("globex", "s1", "g8", RAW, f"another company's {RAW}"),
        _feedback("acme", "s1", "f1", None), _feedback("acme", "s1", "f2", "g2"),
        _feedback("acme", "s2", "f3", "g3"), _feedback("acme", "s2", "f4", None), _feedback("acme", "s2", "f5", "g4"),
        _feedback("acme", "s4", "f6", "g7"), _feedback("globex", "s1", "f1", None),
        *_session("acme", "s1"), *_session("acme", "s2"), *_session("acme", "s3"), *_session("acme", "s4"),
        *_session("globex", "s1"),
    ]
    with sessions() as session:
        session.add_all(rows)
        session.commit()
    return sessions


def _export(sessions, subject: Subject, **kwargs: Any) -> tuple[str, list[dict[str, Any]]]:
    out = io.BytesIO()
    counts = export(sessions, subject, out, batch=2, **kwargs)  # batch 2: every kind takes several pages
    text = out.getvalue().decode()
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines[0]["type"] == "subject"
    assert counts == {kind: sum(1 for r in lines if r["type"] == kind) for kind in KINDS}
    assert lines[-1] == {"type": "end", "counts": counts, "rows": sum(counts.values())}  # else it was cut short
    return text, lines


def _ids(lines: list[dict[str, Any]], kind: str, field: str) -> list[Any]:
    return sorted(r[field] for r in lines if r["type"] == kind)


def test_an_export_holds_the_subjects_rows_and_no_one_elses(stored) -> None:
    alice = user_subject(SECRET, "acme", RAW)
    text, lines = _export(stored, alice)
    assert lines[0] == {"type": "subject", "tenant": "acme", "user_hash": user_hash(SECRET, "acme", RAW),
                        "session_id": None, "exported_at": lines[0]["exported_at"]}
    assert _ids(lines, "generation", "generation_id") == ["g1", "g2", "g3", "g5"]
    assert {r["user_hash"] for r in lines if r["type"] == "generation"} == {alice.user_hash}
    assert _ids(lines, "session", "session_id") == ["s1", "s2", "s3"]
    # s2 is shared with bob: only the feedback on alice's own generation of it
    assert _ids(lines, "feedback", "feedback_id") == ["f1", "f2", "f3"]
    assert {r["tenant"] for r in lines[1:] if "tenant" in r} == {"acme"}
    assert _ids(lines, "trajectory", "event_id") == ["te-tr-acme-s1-0", "te-tr-acme-s1-1",
                                                     "te-tr-acme-s3-0", "te-tr-acme-s3-1"]
    assert {r["trajectory_id"] for r in lines if r["type"] == "scored"} == {"tr-acme-s1", "tr-acme-s3"}
    assert len([r for r in lines if r["type"] == "scored"]) == 8
    assert _ids(lines, "trained", "trajectory_id") == ["tr-acme-s1", "tr-acme-s3"]
    # payloads are decoded objects, timestamps ISO 8601 in UTC
    first = next(r for r in lines if r["type"] == "generation" and r["generation_id"] == "g1")
    assert first["payload"]["request"]["messages"][0]["content"] == f"hi, I am {RAW}, sort these letters"
    assert datetime.fromisoformat(first["ts"]) == T0
    # the raw id only where alice typed it: her first prompt, once
    assert text.count(RAW) == 1 and RAW in json.dumps(first, ensure_ascii=False)
    assert "bob" not in text and "globex" not in text and "g8" not in text

    _, whole = _export(stored, alice, whole_shared=True)  # what an erasure takes: the shared session whole
    assert _ids(whole, "generation", "generation_id") == ["g1", "g2", "g3", "g5"]
    assert _ids(whole, "feedback", "feedback_id") == ["f1", "f2", "f3", "f4", "f5"]
    assert {r["trajectory_id"] for r in whole if r["type"] == "trajectory"} == {"tr-acme-s1", "tr-acme-s2",
                                                                                "tr-acme-s3"}

    _, other = _export(stored, user_subject(SECRET, "globex", RAW))  # the same raw id, another person
    assert _ids(other, "generation", "generation_id") == ["g8"]
    assert _ids(other, "feedback", "feedback_id") == ["f1"]
    assert {r["tenant"] for r in other[1:] if "tenant" in r} == {"globex"}
    assert _ids(other, "trained", "trajectory_id") == ["tr-globex-s1"]

    _, nobody = _export(stored, user_subject(SECRET, "acme", "carol"))
    assert [r["type"] for r in nobody] == ["subject", "end"]  # nothing between
    _, wrong_secret = _export(stored, user_subject("x" * 40, "acme", RAW))
    assert len(wrong_secret) == 2


def test_a_session_export_holds_the_whole_session(stored) -> None:
    _, lines = _export(stored, Subject("acme", session_id="s2"))
    assert lines[0]["session_id"] == "s2" and lines[0]["user_hash"] is None
    assert _ids(lines, "generation", "generation_id") == ["g3", "g4"]
    assert _ids(lines, "session", "session_id") == ["s2"]
    assert _ids(lines, "feedback", "feedback_id") == ["f3", "f4", "f5"]
    assert {r["trajectory_id"] for r in lines if r["type"] in ("trajectory", "scored", "trained")} == {"tr-acme-s2"}
    _, globex = _export(stored, Subject("globex", session_id="s1"))
    assert _ids(globex, "generation", "generation_id") == ["g8"]
    assert {r["tenant"] for r in globex[1:] if "tenant" in r} == {"globex"}


@pytest.fixture
def cli(migrated_db_url, tmp_path, monkeypatch, capsys):
    """``flywheel data export ...`` on the test database: returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("FLYWHEEL_DB__URL", migrated_db_url)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = cli_main(["data", "export", *argv])
        except SystemExit as exc:  # argparse refuses bad arguments with exit 2
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_the_command_finds_the_user_with_the_gateways_secret_file(cli, sessions, tmp_path: Path, capsys) -> None:
    data_dir = tmp_path / "data"
    assert cli("--tenant", "acme", "--user", RAW)[0] == 1  # no secret anywhere: nothing can match
    assert not (data_dir / SECRET_FILE).exists()  # and none is made
    secret = load_secret("", data_dir)  # what the gateway makes on its first start
    with sessions() as session:
        session.add_all([_generation("acme", "s1", "g1", RAW, f"I am {RAW}", secret=secret),
                         _generation("acme", "s1", "g2", "bob", "bob", secret=secret), *_session("acme", "s1")])
        session.commit()

    code, out, err = cli("--tenant", "acme", "--user", RAW)
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err
    assert [r["generation_id"] for r in lines if r["type"] == "generation"] == ["g1"]
    # s1 is shared with bob: its session row, but not its trajectories
    assert [r["type"] for r in lines] == ["subject", "generation", "session", "end"]
    assert user_hash(secret, "acme", RAW) in err and RAW not in err
    assert "2 rows" in err and "1 session(s) also hold" in err

    out_path = tmp_path / "export" / "alice.jsonl"
    out_path.parent.mkdir(mode=0o755)
    args = build_parser().parse_args(["data", "export", "--tenant", "acme", "--user", RAW, "--out", str(out_path)])
    old = os.umask(0)  # the command itself, under a umask that hides nothing (the CLI would set 077 first)
    try:
        code = main(args, load_settings(None))
    finally:
        os.umask(old)
    assert code == 0 and capsys.readouterr().out == ""
    assert stat.S_IMODE(out_path.stat().st_mode) == 0o600
    assert [p.name for p in out_path.parent.iterdir()] == ["alice.jsonl"]  # no temporary file left
    assert [json.loads(line)["type"] for line in out_path.read_text().splitlines()] == ["subject", "generation",
                                                                                       "session", "end"]
    assert out_path.read_text().count(RAW) == 1  # in the prompt alone

    code, out, err = cli("--tenant", "acme", "--session", "s1")
    assert code == 0 and "10 rows" in err
    assert {json.loads(line)["type"] for line in out.splitlines()} == {"subject", *KINDS, "end"} - {"feedback"}


def test_the_command_exit_codes(cli, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLYWHEEL_GATEWAY__USER_ID_SECRET", SECRET)
    code, out, err = cli("--tenant", "acme", "--user", "nobody")
    assert code == 0 and "0 rows" in err and "nobody" not in err
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["subject", "end"]
    assert cli("--tenant", "acme", "--session", "none")[0] == 0
    assert cli("--tenant", "acme")[0] == 2  # neither --user nor --session
    assert cli("--tenant", "acme", "--user", "a", "--session", "s")[0] == 2  # both
    assert cli("--tenant", "acme", "--user", "")[0] == 2
    assert cli("--tenant", "bad tenant!", "--user", "a")[0] == 2
    assert cli("--user", "a")[0] == 2
    code, _, err = cli("--tenant", "acme", "--user", "a", "--out", str(tmp_path / "missing" / "x.jsonl"))
    assert code == 1 and "cannot write" in err

    settings = argparse.Namespace()  # the command's own check, when called without the parser
    assert main(argparse.Namespace(action="export", tenant="acme", user=None, session=None, out=None), settings) == 2
    assert main(argparse.Namespace(action="export", tenant="acme", user="a", session="s", out=None), settings) == 2
