"""Trajectory assembly against hand-built sessions (segments, masks, offsets, ids)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from flywheel.events import FeedbackEvent, GenerationEvent, SamplingParams, TrajectoryEvent, feedback_event_id, trajectory_id_for
from ingest.assemble import assemble, prompt_key_of, trajectory_event_id, turn_of

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def gen(gid: str, prompt: list[int], completion: list[int], logprobs: list[float], *, at: int, version: int = 3,
        user: str = "2+2?") -> GenerationEvent:
    return GenerationEvent(
        ts=T0 + timedelta(seconds=at),
        tenant="acme",
        session_id="s1",
        generation_id=gid,
        model_line="tiny-sim",
        model_version=version,
        node_id="node-0",
        request={"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": user}]},
        response={},
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        sampling=SamplingParams(),
        latency_ms=1.0,
    )


def fb(fid: str, signal: str, value: float | None, *, gid: str | None, at: int, kind: str = "explicit") -> FeedbackEvent:
    return FeedbackEvent(
        event_id=feedback_event_id("acme", fid),
        ts=T0 + timedelta(seconds=at),
        tenant="acme",
        session_id="s1",
        feedback_id=fid,
        generation_id=gid,
        kind=kind,
        signal=signal,
        value=value,
    )


def test_two_turns_that_extend_share_one_segment() -> None:
    g1 = gen("g1", [1, 2, 3], [4, 5], [-0.1, -0.2], at=0, version=3)
    # The second prompt is the first segment (1 2 3 4 5) followed by the new user turn (6 7).
    g2 = gen("g2", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [-0.3, -0.4, -0.5], at=5, version=4)
    thumbs = fb("f1", "thumbs", 1, gid="g2", at=6)
    traj = assemble("acme", "s1", [g2, g1], [thumbs], closed_reason="outcome")  # out of order on purpose

    assert traj.generation_ids == ["g1", "g2"]
    assert len(traj.segments) == 1
    seg = traj.segments[0]
    assert seg.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert seg.mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert [(t.generation_id, t.start, t.end, t.behaviour_version) for t in seg.turns] == [
        ("g1", 3, 5, 3),
        ("g2", 7, 10, 4),
    ]
    assert seg.tokens[3:5] == [4, 5] and seg.tokens[7:10] == [8, 9, 10]
    assert traj.feedback == [thumbs]
    assert traj.closed_reason == "outcome"
    assert traj.prompt_key == "2+2?"
    assert traj.model_line == "tiny-sim"
    assert traj.ts == T0 + timedelta(seconds=6)  # the newest event, not the wall clock


def test_a_turn_that_does_not_extend_starts_a_new_segment() -> None:
    g1 = gen("g1", [1, 2, 3], [4, 5], [-0.1, -0.2], at=0)
    # Truncated history (the client dropped the first answer): 1 2 3 9 does not start with 1 2 3 4 5.
    g2 = gen("g2", [1, 2, 3, 9], [7], [-0.7], at=1)
    traj = assemble("acme", "s1", [g1, g2], [], closed_reason="inactivity")
    assert [s.tokens for s in traj.segments] == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 7]]
    assert [s.mask for s in traj.segments] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert [s.logprobs for s in traj.segments] == [[0.0, 0.0, 0.0, -0.1, -0.2], [0.0, 0.0, 0.0, 0.0, -0.7]]
    assert [(t.start, t.end) for s in traj.segments for t in s.turns] == [(3, 5), (4, 5)]
    assert traj.feedback == []


def test_equal_timestamps_keep_input_order_and_feedback_is_sorted() -> None:
    g1 = gen("g1", [1], [2], [-1.0], at=0)
    g2 = gen("g2", [1, 2, 3], [4], [-2.0], at=0)
    late = fb("f2", "task_solved", 1, gid=None, at=9, kind="outcome")
    early = fb("f1", "thumbs", -1, gid="g1", at=1)
    traj = assemble("acme", "s1", [g1, g2], [late, early], closed_reason="outcome")
    assert traj.generation_ids == ["g1", "g2"]
    assert traj.segments[0].tokens == [1, 2, 3, 4] and traj.segments[0].mask == [0, 1, 0, 1]
    assert [f.feedback_id for f in traj.feedback] == ["f1", "f2"]


def test_ids_are_deterministic_per_session_and_revision() -> None:
    g1 = gen("g1", [1, 2], [3], [-0.5], at=0)
    a = assemble("acme", "s1", [g1], [], closed_reason="inactivity")
    b = assemble("acme", "s1", [g1], [], closed_reason="inactivity")
    r1 = assemble("acme", "s1", [g1], [], closed_reason="late_feedback", revision=1)
    assert a == b and a.to_bytes() == b.to_bytes()  # re-emission is byte-identical
    assert a.trajectory_id == r1.trajectory_id == trajectory_id_for("acme", "s1")
    assert a.event_id == trajectory_event_id(a.trajectory_id, 0) != r1.event_id
    assert trajectory_id_for("acme", "s2") != a.trajectory_id
    assert trajectory_id_for("other", "s1") != a.trajectory_id
    assert TrajectoryEvent.from_bytes(a.to_bytes()) == a


def test_no_generations_is_an_error() -> None:
    with pytest.raises(ValueError, match="no generations"):
        assemble("acme", "s1", [], [], closed_reason="inactivity")


def test_prompt_key_is_the_first_user_message() -> None:
    assert prompt_key_of({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "q"},
                                       {"role": "user", "content": "again"}]}) == "q"
    assert prompt_key_of({"messages": [{"role": "system", "content": "x"}]}) is None
    assert prompt_key_of({}) is None
    structured = [{"type": "text", "text": "q"}]
    assert prompt_key_of({"messages": [{"role": "user", "content": structured}]}) == '[{"text": "q", "type": "text"}]'


@pytest.mark.parametrize("sampling", [{"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_sampling_a_turn_cannot_carry_is_refused_before_it_is_stored(sampling: dict) -> None:
    """Ingest dead-letters such a generation (``turn_of`` raises) rather than store it and fail
    every later close of its session."""
    bad = gen("g1", [1, 2], [3], [-0.1], at=0).model_copy(update={"sampling": SamplingParams(**sampling)})
    with pytest.raises(ValueError):
        turn_of(bad, 2, 3)
    with pytest.raises(ValueError):
        assemble("acme", "s1", [bad], [], closed_reason="outcome")
    good = gen("g1", [1, 2], [3], [-0.1], at=0)
    assert turn_of(good, 2, 3).end == 3
