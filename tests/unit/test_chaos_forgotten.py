"""The ``forgotten_leave_no_trace`` invariant (chaos/forgotten.py) on hand-built snapshots: a clean
erasure passes, and each trace it is there to catch fails it, saying which."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from chaos.forgotten import GRACE, ErasureRow, ForgetSubject, Forgotten, TopicRecord, check_no_trace
from flywheel.events import trajectory_id_for

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
DONE = T0 + timedelta(seconds=10)


def forgotten() -> Forgotten:
    row = ErasureRow(id=1, tenant="acme", user_hash="h-alice", session_id=None, state="done", requested_at=T0,
                     completed_at=DONE, counts={"generations": 4, "trajectories": 1}, trained_into=(3,))
    return Forgotten(erasures=[row], sessions={("acme", "s1"): (1, T0), ("acme", "s2"): (1, T0)},
                     subjects=[ForgetSubject("acme", "h-alice", before=("s1", "s2"), after=("s9",))])


def rows(**extra) -> dict:
    """A snapshot's rows after a clean erasure: only other users' sessions, and v3 trained on s1."""
    base = {
        "generations": [SimpleNamespace(session_id="s5", ts=T0 - timedelta(seconds=5),
                                        payload={"tenant": "acme", "user_hash": "h-bob"}),
                        SimpleNamespace(session_id="s9", ts=DONE + timedelta(seconds=5),
                                        payload={"tenant": "acme", "user_hash": "h-alice"})],
        "feedback": [SimpleNamespace(session_id="s5")],
        "session_status": {"s5": "closed", "s9": "open"},
        "trajectories": [SimpleNamespace(session_id="s5")],
        "scored": [SimpleNamespace(trajectory_id=trajectory_id_for("acme", "s5"))],
        "versions": [SimpleNamespace(version=3, created_at=T0 - timedelta(seconds=30),
                                     trajectory_ids=[trajectory_id_for("acme", "s1")]),
                     SimpleNamespace(version=4, created_at=DONE + timedelta(seconds=20), trajectory_ids=[])],
    }
    for key, value in extra.items():
        base[key] = base[key] + value if isinstance(value, list) else {**base[key], **value}
    return base


def check(f: Forgotten, **extra) -> tuple[bool, str]:
    r = rows(**extra)
    return check_no_trace(f, r["generations"], r["feedback"], r["session_status"], r["trajectories"], r["scored"],
                          r["versions"])


def test_a_clean_erasure_passes_and_no_erasure_is_nothing_to_check() -> None:
    ok, detail = check(forgotten())
    assert ok, detail
    assert "2 sessions tombstoned" in detail and "rows left none" in detail
    assert check_no_trace(Forgotten(), [], [], {}, [], [], []) == (True, "no erasure requested")


@pytest.mark.parametrize(("extra", "says"), [
    ({"generations": [SimpleNamespace(session_id="s1", ts=T0, payload={})]}, "'generations': 1"),
    ({"generations": [SimpleNamespace(session_id="s7", ts=T0 - timedelta(seconds=1),  # before the request
                                      payload={"tenant": "acme", "user_hash": "h-alice"})]}, "'generations': 1"),
    ({"feedback": [SimpleNamespace(session_id="s2")]}, "'feedback': 1"),
    ({"session_status": {"s2": "open"}}, "'sessions': 1"),
    ({"trajectories": [SimpleNamespace(session_id="s1")]}, "'trajectories': 1"),
    ({"scored": [SimpleNamespace(trajectory_id=trajectory_id_for("acme", "s2"))]}, "'scored': 1"),
    ({"versions": [SimpleNamespace(version=5, created_at=DONE + timedelta(seconds=40),  # after v4, the first after
                                   trajectory_ids=[trajectory_id_for("acme", "s2")])]}, "not in trained_into [5]"),
])
def test_each_trace_left_of_a_forgotten_session_fails_it(extra: dict, says: str) -> None:
    ok, detail = check(forgotten(), **extra)
    assert not ok and says in detail, detail


def test_an_unfinished_erasure_a_missed_session_a_wrongly_kept_one_and_a_late_record_each_fail_it() -> None:
    f = forgotten()
    f.erasures = [replace(f.erasures[0], state="pending", completed_at=None)]
    ok, detail = check(f)
    assert not ok and "erasure 1: pending" in detail, detail

    f = forgotten()
    del f.sessions[("acme", "s2")]  # served to the user before the request, never tombstoned
    ok, detail = check(f)
    assert not ok and "not tombstoned ['s2']" in detail, detail

    f = forgotten()
    f.sessions[("acme", "s9")] = (1, DONE)  # begun after the erasure completed: new data, not theirs to erase
    ok, detail = check(f)
    assert not ok and "new sessions tombstoned ['s9']" in detail, detail

    f = forgotten()
    f.records = [TopicRecord("scored", "s1", "scored[0]@7", DONE - timedelta(seconds=1)),  # before completion: fine
                 TopicRecord("scored", "s2", "scored[1]@9", DONE + GRACE + timedelta(seconds=1))]
    ok, detail = check(f)
    assert not ok and "1 produced after completion ['scored[1]@9" in detail, detail
