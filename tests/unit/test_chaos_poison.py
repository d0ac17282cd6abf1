"""The chaos suite's poison: the records the rogue producer writes, and ``poison_dead_lettered``
flagging what was not dead-lettered (hand-built snapshots; the checker is pure).

``flywheel chaos -s poison`` runs it for real; here a snapshot is altered one way at a time (a
dead letter missing, one from another topic, one without a reason, unknown-id feedback joined to a
trajectory, a good record dead-lettered) and the checker must flag each.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from chaos.invariants import (
    DEAD_LETTER,
    STORED_UNJOINED,
    DeadLetter,
    FeedbackRow,
    PoisonRecord,
    Snapshot,
    TrajectoryRow,
    check_poison,
    check_trajectories,
    dead_letter_reasons,
)
from chaos.poison import HEADER, RULES, TOPICS, bus_poison
from chaos.users import ClientLog
from flywheel.bus.envelope import encode
from flywheel.events import FeedbackEvent, GenerationEvent, ScoredTrajectory, TrajectoryEvent

pytestmark = pytest.mark.unit

DECODERS = {"generations": GenerationEvent, "feedback": FeedbackEvent, "trajectories": TrajectoryEvent,
            "scored": ScoredTrajectory}


def snapshot(**fields: Any) -> Snapshot:
    empty: dict[str, Any] = dict(client=ClientLog(), generations=[], feedback=[], session_status={}, trajectories=[],
                                 scored=[], live_spec="live", rescore_spec="again", versions=[], ever_stable=set(),
                                 promoted_at={}, node_loaded={}, node_live={}, node_final={}, expectations=[])
    return Snapshot(**{**empty, **fields})


def letter(p: PoisonRecord, offset: int = 7, reason: str = "undecodable: no") -> DeadLetter:
    return DeadLetter(p.topic, 1, offset, reason, p.id)


UNKNOWN_FB = PoisonRecord("r0-feedback-unknown_ids", "feedback", "unknown_ids", STORED_UNJOINED, "ev-fb", "s-poison")
POISON = [PoisonRecord("r0-generations-big_int", "generations", "big_int", DEAD_LETTER, None, "s1"),
          PoisonRecord("r0-trajectories-unknown_ids", "trajectories", "unknown_ids", DEAD_LETTER, "ev-t", "s2"),
          PoisonRecord("r0-scored-huge", "scored", "huge", DEAD_LETTER, None, "s3"),
          UNKNOWN_FB]


def all_lettered() -> Snapshot:
    """Every poison record dead-lettered, the huge one chunk by chunk, one of them twice (redelivered)."""
    letters = [letter(p) for p in POISON] + [letter(POISON[2], 8), letter(POISON[0])]
    return snapshot(poison=POISON, dead_letters=letters)


def test_no_poison_and_no_dead_letter_is_trivially_ok() -> None:
    result = check_poison(snapshot())
    assert result.ok and result.lost == 0 and "no poison" in result.detail


def test_every_poison_record_dead_lettered_holds() -> None:
    result = check_poison(all_lettered())
    assert result.ok, result.detail
    assert "'dead-lettered': 4" in result.detail and "0 unaccounted" in result.detail


def test_a_missing_dead_letter_is_flagged_with_its_kind_topic_and_stage() -> None:
    s = all_lettered()
    gone = replace(s, dead_letters=[d for d in s.dead_letters if d.poison != "r0-trajectories-unknown_ids"],
                   poison_found={"r0-trajectories-unknown_ids": ["trajectories[3]@41"]})
    result = check_poison(gone)
    assert not result.ok
    assert "1 unaccounted" in result.detail
    assert "unknown_ids on trajectories, not dead-lettered by rewards" in result.detail
    assert "trajectories[3]@41" in result.detail
    assert result.lost == 0  # poison is not a good record: nothing lost, only unaccounted


def test_a_dead_letter_from_another_topic_or_without_a_reason_does_not_count() -> None:
    s = all_lettered()
    big = POISON[0]
    for wrong in (DeadLetter("feedback", 1, 7, "undecodable", big.id), letter(big, reason="  ")):
        altered = replace(s, dead_letters=[d for d in s.dead_letters if d.poison != big.id] + [wrong])
        result = check_poison(altered)
        assert not result.ok and "big_int on generations, not dead-lettered by ingest" in result.detail


def test_unknown_id_feedback_may_instead_be_stored_joined_to_nothing() -> None:
    s = all_lettered()
    stored = replace(s, dead_letters=[d for d in s.dead_letters if d.poison != UNKNOWN_FB.id],
                     feedback=[FeedbackRow("poison-fb", "ev-fb", "s-poison", "pending", {})])
    result = check_poison(stored)
    assert result.ok, result.detail
    assert "stored as pending feedback, in no trajectory" in result.detail

    joined = replace(stored, trajectories=[TrajectoryRow("t", 0, "s-poison", "chaos-poison", "inactivity",
                                                         {"feedback": [{"event_id": "ev-fb"}]})])
    assert not check_poison(joined).ok
    as_joined = replace(stored, feedback=[FeedbackRow("poison-fb", "ev-fb", "s-poison", "joined", {})])
    assert not check_poison(as_joined).ok
    never_stored = replace(stored, feedback=[])
    assert not check_poison(never_stored).ok


def test_poison_that_must_be_dead_lettered_is_flagged_when_stored() -> None:
    dup = PoisonRecord("r1-feedback-duplicate_key", "feedback", "duplicate_key", DEAD_LETTER, "ev-dup", "s9")
    s = snapshot(poison=[dup], feedback=[FeedbackRow("fb", "ev-dup", "s9", "pending", {})])
    result = check_poison(s)
    assert not result.ok and "stored as pending feedback" in result.detail


def test_a_good_record_dead_lettered_is_flagged_and_on_scored_counted_lost_once() -> None:
    s = all_lettered()
    good = DeadLetter("scored", 2, 90, "untrainable: token id 99999", None)
    result = check_poison(replace(s, dead_letters=s.dead_letters + [good, good]))
    assert not result.ok and result.lost == 1 and "1 good records dead-lettered" in result.detail
    generation = DeadLetter("generations", 0, 5, "refused by the database", None)
    result = check_poison(replace(s, dead_letters=s.dead_letters + [generation]))
    assert not result.ok and result.lost == 0  # captured counts a lost generation; flagged here only
    alone = check_poison(snapshot(dead_letters=[generation]))  # any scenario: no poison, a good record gone
    assert not alone.ok


def test_dead_letter_reasons_name_each_poison_kind() -> None:
    s = all_lettered()
    s = replace(s, dead_letters=[d for d in s.dead_letters if d.poison != UNKNOWN_FB.id])
    figures = dead_letter_reasons(s)
    assert figures["per_topic"] == {"generations": 2, "trajectories": 1, "scored": 2}
    assert figures["reasons"]["generations/big_int"] == "undecodable: no"
    assert figures["reasons"]["feedback/unknown_ids"] == "not dead-lettered"


def test_a_poison_session_that_ended_empty_is_not_an_open_session() -> None:
    s = snapshot(session_status={"s-poison": ("empty", 0), "s-real": ("empty", 0)}, poison=[UNKNOWN_FB])
    result = check_trajectories(s)
    assert not result.ok and "1 sessions not closed" in result.detail
    assert check_trajectories(replace(s, session_status={"s-poison": ("empty", 0)})).ok
    assert not check_trajectories(replace(s, session_status={"s-poison": ("open", 0)})).ok


@pytest.mark.parametrize("round_no", [0, 1, 2])
def test_every_poison_record_is_poison_and_marked(round_no: int) -> None:
    """Every kind but ``unknown_ids`` is refused by its topic's decoder (so the scenario's verdict is
    about the consumers dead-lettering it); ``unknown_ids`` decodes, naming ids of its own; every
    record (every chunk of a huge one) carries its ``chaos.poison`` id."""
    rng = random.Random(round_no)
    ids = set()
    for topic, kind in RULES:
        p = bus_poison(topic, kind, round_no, "tiny-sim", 3, rng)
        assert p.record.topic == topic and p.record.kind == kind and p.headers == {HEADER: p.record.id}
        ids.add(p.record.id)
        if kind == "unknown_ids":
            event = DECODERS[topic].from_bytes(p.value)
            assert event.tenant == "chaos-poison" and event.event_id == p.record.event_id
            assert event.session_id == p.key == p.record.session_id
            continue
        with pytest.raises(ValueError):
            DECODERS[topic].from_bytes(p.value)
        chunks = encode(p.value, p.headers, 900_000)
        assert all(headers[HEADER] == p.record.id for _, headers in chunks)
        if kind == "huge":
            assert len(p.value) > 2_000_000 and len(chunks) > 1
        if kind == "big_int":
            assert "9" * 4000 in p.value.decode()
    assert len(ids) == len(RULES) and {t for t, _ in RULES} == set(TOPICS)
    assert ("generations", "unknown_ids") not in RULES and RULES[("feedback", "unknown_ids")] == STORED_UNJOINED


def test_a_duplicate_key_record_names_session_id_twice() -> None:
    p = bus_poison("feedback", "duplicate_key", 0, "tiny-sim", 0, random.Random(5))
    pairs = json.loads(p.value, object_pairs_hook=lambda kv: kv)
    assert [k for k, _ in pairs].count("session_id") == 2
