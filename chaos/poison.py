"""Poison: records a rogue producer writes straight onto the consumed topics, and API requests the
gateway must refuse (sent by :mod:`chaos.poison_faults`). What each must become is checked by
``poison_dead_lettered`` and ``fault_checks``.

**On the bus** (:func:`bus_poison`, pure; :class:`RogueProducer` writes it with the run's settings
and topic prefix, through the project's bus): onto every topic a stage consumes (``generations``
and ``feedback``, read by ingest; ``trajectories``, rewards; ``scored``, the trainer), one record at
a time between the good ones, keyed like a session (a fresh hex id), every record carrying the
header ``chaos.poison: <id>``, which its dead letter keeps. The kinds (:data:`KINDS`), each built
from a valid event of the topic's type (tenant :data:`POISON_TENANT`, ids that exist nowhere):

- ``not_json``: bytes that are no JSON (NUL and invalid UTF-8; a document cut off; empty);
- ``wrong_shape``: JSON that is no event of the topic (an array; ``null``; an event of another type);
- ``big_int``: a 4,000-digit integer in a free-form field (``request``, feedback ``data``; in a
  scored trajectory, which has none, ``total_reward``), the pill that crash-looped ingest;
- ``float_overflow``: ``1e400`` (a double's range is exceeded: infinity);
- ``non_finite``: a ``NaN``, ``Infinity`` or ``-Infinity`` literal (no JSON has them);
- ``lone_surrogate``: a ``\\ud800`` escape in a string (no Unicode text, refused by PostgreSQL);
- ``duplicate_key``: ``session_id`` twice, with two values (readers disagree on which wins);
- ``huge``: a 2 MB ``session_id`` (at most 256 characters), split into chunks by the bus envelope
  as the gateway ships a large event;
- ``unknown_ids`` (not on ``generations``: a generation is a fact the gateway reports, and any
  session may be new): a valid event naming ids that exist nowhere: feedback for a generation and
  session no one served, a trajectory ingest never stored, a scored trajectory rewards never
  scored (with the newest version as its behaviour version, so staleness cannot drop it).

Every kind must be dead-lettered by the stage that reads the topic (:data:`RULES`), with one
exception: feedback naming ids that exist nowhere cannot be told from feedback that came before
its generation (ingest keeps such feedback, by design), so it may instead be stored, joined to no
trajectory, its session ending ``empty``. A trajectory or scored trajectory naming unknown ids can
be told: ingest stores every trajectory before it puts it on the bus, and rewards every score.

**At the gateway** (:func:`api_round`): between good requests of its own (recorded in the client
log like any user's), one tenant sends the requests issue 21 found: feedback whose ``data`` holds a
4,000-digit integer; ``NaN``/``Infinity``/``1e400`` in free-form fields (an unknown chat field,
``logit_bias``, feedback ``data``); duplicate keys; a lone surrogate; a feedback id replayed with
another value, kind or target. Each must get a 4xx (400; 409 for the replays), never a 5xx or an
acceptance, and an identical replay must still be accepted (202). A poison request the gateway
accepts anyway is recorded as accepted, so what became of it is checked like any other.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from chaos.invariants import DEAD_LETTER, STORED_UNJOINED, PoisonRecord
from chaos.users import GENERATION_HEADER, SESSION_HEADER, VERSION_HEADER, Received, Users
from flywheel.settings import Settings

#: The tenant every poison event names (settle and the invariants tell its sessions apart).
POISON_TENANT = "chaos-poison"
#: The header that names a poison record; ``dead_letter`` keeps a record's headers.
HEADER = "chaos.poison"
TOPICS = ("generations", "feedback", "trajectories", "scored")
KINDS = ("not_json", "wrong_shape", "big_int", "float_overflow", "non_finite", "lone_surrogate", "duplicate_key",
         "huge", "unknown_ids")
#: (topic, kind) -> what it must become; a pair not listed is not produced.
RULES: dict[tuple[str, str], str] = {
    **{(t, k): DEAD_LETTER for t in TOPICS for k in KINDS if not (t == "generations" and k == "unknown_ids")},
    ("feedback", "unknown_ids"): STORED_UNJOINED,
}
BIG_INT = int("9" * 4000)
HUGE_BYTES = 2 * 1024 * 1024
#: A placeholder value, replaced in the JSON text by a literal written as is (``1e400``, ``NaN``).
_MARK = "@@chaos-poison@@"


@dataclass(frozen=True)
class BusPoison:
    """One poison record: its key, value and headers, and what the invariant needs to know of it."""

    record: PoisonRecord
    key: str
    value: bytes
    headers: dict[str, str]


def _template(topic: str, n: str, session: str, model_line: str, version: int) -> dict[str, Any]:
    """A valid event of ``topic``'s type, as JSON data, naming ids that exist nowhere."""
    from flywheel.events import FeedbackEvent, GenerationEvent, SamplingParams, ScoredTrajectory, Segment, TrajectoryEvent, Turn

    common = {"event_id": f"poison-{n}", "tenant": POISON_TENANT, "session_id": session}
    gid = f"poison-gen-{n}"
    feedback = FeedbackEvent(**{**common, "event_id": f"poison-fb-{n}"}, feedback_id=f"poison-fb-{n}",
                             generation_id=gid, kind="explicit", signal="thumbs", value=1.0, data={"note": "rogue"})
    segment = Segment(tokens=[1, 2, 3, 4], mask=[0, 0, 0, 1], logprobs=[0.0, 0.0, 0.0, -0.5],
                      turns=[Turn(generation_id=gid, start=3, end=4, behaviour_version=version)])
    if topic == "generations":
        event: Any = GenerationEvent(
            **common, generation_id=gid, model_line=model_line, model_version=version, node_id="rogue",
            request={"messages": [{"role": "user", "content": "sort 3 1 2"}], "max_tokens": 4},
            response={"choices": [{"message": {"role": "assistant", "content": "1 2 3"}}]},
            prompt_token_ids=[1, 2, 3], completion_token_ids=[4], completion_logprobs=[-0.5],
            sampling=SamplingParams(), latency_ms=1.0)
    elif topic == "feedback":
        event = FeedbackEvent(**common, feedback_id=f"poison-{n}", generation_id=gid, kind="explicit", signal="thumbs",
                              value=1.0, data={"note": "rogue"})
    elif topic == "trajectories":
        event = TrajectoryEvent(**common, trajectory_id=f"poison-{n}", model_line=model_line, segments=[segment],
                                generation_ids=[gid], feedback=[feedback], closed_reason="inactivity",
                                prompt_key="poison")
    else:
        event = ScoredTrajectory(**common, trajectory_id=f"poison-{n}", model_line=model_line, segments=[segment],
                                 turn_rewards=[1.0], total_reward=1.0, reward_components={"rogue": 1.0},
                                 reward_spec_version="chaos-poison", prompt_key="poison", turn_advantages=[1.0])
    return event.model_dump(mode="json")


def _free_field(topic: str, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Where a number goes: a free-form object of the event and a key in it (a scored trajectory has
    no free-form field: a typed one)."""
    if topic == "generations":
        return data["request"], "seed"
    if topic == "feedback":
        return data["data"], "n"
    if topic == "trajectories":
        return data["feedback"][0]["data"], "n"
    return data, "total_reward"


def _with_literal(topic: str, data: dict[str, Any], literal: str) -> bytes:
    """``data`` with ``literal`` (JSON text Python cannot hold as a value) in its free-form field."""
    where, key = _free_field(topic, data)
    where[key] = _MARK
    return json.dumps(data).replace(json.dumps(_MARK), literal, 1).encode()


def bus_poison(topic: str, kind: str, round_no: int, model_line: str, version: int,
               rng: random.Random) -> BusPoison:
    """The poison record of ``kind`` for ``topic`` in round ``round_no`` (variants change by round)."""
    n = f"r{round_no}-{topic}-{kind}-{rng.getrandbits(32):08x}"
    session = uuid.UUID(int=rng.getrandbits(128)).hex
    data = _template(topic, n, session, model_line, version)
    if kind == "not_json":
        value = (b"\x00\xff\xfe not json \xc3\x28", b'{"event_id": "poison-cut', b"")[round_no % 3]
    elif kind == "wrong_shape":
        other = _template("feedback" if topic != "feedback" else "generations", n, session, model_line, version)
        value = (b"[1, 2, 3]", json.dumps(other).encode(), b"null")[round_no % 3]
    elif kind == "big_int":
        where, key = _free_field(topic, data)
        where[key] = BIG_INT
        value = json.dumps(data).encode()
    elif kind == "float_overflow":
        value = _with_literal(topic, data, "1e400")
    elif kind == "non_finite":
        value = _with_literal(topic, data, ("NaN", "Infinity", "-Infinity")[round_no % 3])
    elif kind == "lone_surrogate":
        if topic == "generations":
            data["request"]["messages"][0]["content"] = "sort \ud800 1 2"
        elif topic == "feedback":
            data["comment"] = "rogue \ud800"
        else:
            data["prompt_key"] = "rogue \ud800"
        value = json.dumps(data).encode()  # ensure_ascii: written as the escape \ud800
    elif kind == "duplicate_key":
        value = (json.dumps({"session_id": uuid.UUID(int=rng.getrandbits(128)).hex})[:-1] + ", "
                 + json.dumps(data)[1:]).encode()
    elif kind == "huge":
        data["session_id"] = rng.randbytes(HUGE_BYTES // 2).hex()
        value = json.dumps(data).encode()
    elif kind == "unknown_ids":
        value = json.dumps(data).encode()
    else:
        raise ValueError(f"unknown poison kind {kind!r}")
    event_id = data["event_id"] if kind in ("unknown_ids", "duplicate_key") else None
    record = PoisonRecord(n, topic, kind, RULES[(topic, kind)], event_id, session)
    return BusPoison(record, session, value, {HEADER: n})


class RogueProducer:
    """Writes poison onto the consumed topics through the project's bus (``make_bus``, the run's
    settings and topic prefix); large records go through the bus envelope, as the gateway ships them."""

    def __init__(self, settings: Settings, seed: int) -> None:
        from flywheel.bus import make_bus

        self.settings = settings
        self.rng = random.Random(seed)
        self.bus = make_bus(settings)
        self.bus.ensure_topics([settings.topic(t) for t in TOPICS])
        self.producer = self.bus.producer(timeout_s=15.0)

    def round(self, round_no: int, version: int, pause_s: tuple[float, float] = (0.02, 0.15)) -> list[PoisonRecord]:
        """One poison record of every (topic, kind) in :data:`RULES`, in random order, each flushed
        (acknowledged) before the next; returns those the broker acknowledged."""
        from flywheel.bus import BusError
        from flywheel.bus.envelope import encode

        pairs = list(RULES)
        self.rng.shuffle(pairs)
        produced = []
        for topic, kind in pairs:
            poison = bus_poison(topic, kind, round_no, self.settings.model.line, version, self.rng)
            try:
                for value, headers in encode(poison.value, poison.headers, self.settings.gateway.max_record_bytes):
                    self.producer.send(self.settings.topic(topic), poison.key, value, headers)
                self.producer.flush(30.0)
            except BusError:  # its fate unknown: not counted (a dead letter of it is reported apart)
                with contextlib.suppress(BusError):  # a failed producer is replaced, not reused
                    self.producer.close(0)
                self.producer = self.bus.producer(timeout_s=15.0)
                continue
            produced.append(poison.record)
            time.sleep(self.rng.uniform(*pause_s))
        return produced

    def close(self) -> None:
        try:
            self.producer.close(10.0)
        finally:
            self.bus.close()


# --- at the gateway ---------------------------------------------------------------------------------

#: label -> the status a fixed gateway answers (every one of them must be a 4xx).
API_POISON = {
    "feedback data: a 4,000-digit integer": 400,
    "feedback data: a non-finite number": 400,
    "feedback data: 1e400": 400,
    "feedback: a duplicate key": 400,
    "feedback comment: a lone surrogate": 400,
    "chat, an unknown field: a non-finite number": 400,
    "chat, an unknown field: a 4,000-digit integer": 400,
    "chat logit_bias: a non-finite number": 400,
    "chat: a duplicate key": 400,
    "chat message: a lone surrogate": 400,
    "feedback id replayed: another value": 409,
    "feedback id replayed: another kind": 409,
    "feedback id replayed: another target": 409,
}
IDENTICAL_REPLAY = "feedback id replayed: identical"


def _json(data: Any, literal: str | None = None) -> bytes:
    """``data`` as JSON; ``literal`` replaces the one :data:`_MARK` string (text Python cannot hold)."""
    text = json.dumps(data)
    return (text.replace(json.dumps(_MARK), literal, 1) if literal is not None else text).encode()


def _dup(data: dict[str, Any], key: str, first: Any) -> bytes:
    """``data`` as JSON with ``key`` written twice: ``first``, then its value in ``data``."""
    return (json.dumps({key: first})[:-1] + ", " + json.dumps(data)[1:]).encode()


def api_round(users: Users, client: httpx.Client, round_no: int) -> tuple[dict[str, int], bool]:
    """Good traffic, then every request of :data:`API_POISON` and an identical replay, then good
    traffic again; returns the status of each request and whether the good requests after the
    poison were served (200) and accepted (202)."""
    non_finite = ("NaN", "Infinity", "-Infinity")[round_no % 3]
    sessions = [uuid.uuid4().hex, uuid.uuid4().hex]
    with users.log.lock:
        users.log.sessions.update(sessions)
    message = [{"role": "user", "content": "sort 3 1 2"}]
    served = [users.chat(client, sid, message, stream=False) for sid in sessions]
    if served[0] is None or served[1] is None:
        return {}, False
    gid, other_gid = served[0][1], served[1][1]
    accepted = users.feedback(client, sessions[0], [{"generation_id": gid, "kind": "explicit", "signal": "thumbs",
                                                     "value": 1}])
    if not accepted:
        return {}, False
    first = accepted[0]

    def item(**fields: Any) -> dict[str, Any]:
        return {"feedback_id": uuid.uuid4().hex, "session_id": sessions[0], "generation_id": gid, "kind": "custom",
                "signal": "chaos", **fields}

    feedback: dict[str, tuple[dict[str, Any], str | None]] = {  # label -> (the item, a literal for _MARK)
        "feedback data: a 4,000-digit integer": (item(data={"n": BIG_INT}), None),
        "feedback data: a non-finite number": (item(data={"x": _MARK}), non_finite),
        "feedback data: 1e400": (item(data={"x": _MARK}), "1e400"),
        "feedback: a duplicate key": (item(value=1), None),
        "feedback comment: a lone surrogate": (item(comment="rogue \ud800"), None),  # ensure_ascii: the escape
        "feedback id replayed: another value": ({**first, "value": -1}, None),
        "feedback id replayed: another kind": ({**{k: v for k, v in first.items() if k != "value"},
                                                "kind": "implicit", "signal": "retry"}, None),
        "feedback id replayed: another target": ({**first, "session_id": sessions[1], "generation_id": other_gid},
                                                 None),
        IDENTICAL_REPLAY: (first, None),
    }
    chat = {"model": users.model_line, "messages": message, "max_tokens": 4}
    chats: dict[str, bytes] = {
        "chat, an unknown field: a non-finite number": _json({**chat, "vendor_weight": _MARK}, non_finite),
        "chat, an unknown field: a 4,000-digit integer": _json({**chat, "vendor_seed": BIG_INT}),
        "chat logit_bias: a non-finite number": _json({**chat, "logit_bias": {"1": _MARK}}, non_finite),
        "chat: a duplicate key": _dup(chat, "max_tokens", 8),
        "chat message: a lone surrogate": _json({**chat, "messages": [{"role": "user", "content": "sort \ud800"}]}),
    }
    requests: list[tuple[str, str, bytes, dict[str, Any] | None]] = []  # (label, path, body, feedback item)
    for label, (one, literal) in feedback.items():
        body = _json({"feedback": [one]}, literal)
        if label == "feedback: a duplicate key":
            body = body.replace(b'"value": 1', b'"value": 1, "value": -1', 1)
        requests.append((label, "/v1/feedback", body, one))
    requests += [(label, "/v1/chat/completions", body, None) for label, body in chats.items()]
    statuses: dict[str, int] = {}
    for label, path, body, one in requests:
        session = sessions[0] if one is not None else uuid.uuid4().hex
        try:
            r = client.post(path, content=body, headers={"Content-Type": "application/json", SESSION_HEADER: session})
        except httpx.HTTPError:
            statuses[label] = 0
            continue
        statuses[label] = r.status_code
        # A poison request the gateway took anyway is the client's like any other: checked downstream.
        if r.status_code == 200 and GENERATION_HEADER in r.headers:
            with users.log.lock:
                users.log.sessions.add(session)
                users.log.received[r.headers[GENERATION_HEADER]] = Received(
                    session, r.headers[GENERATION_HEADER], int(r.headers[VERSION_HEADER]), False)
        elif r.status_code == 202 and one is not None:
            with users.log.lock:
                users.log.feedback[one["feedback_id"]] = one.get("session_id") or session
    after = users.chat(client, sessions[0], message, stream=round_no % 2 == 1)
    done = after is not None and bool(users.feedback(client, sessions[0], [
        {"kind": "outcome", "signal": "task_solved", "value": 1}]))
    return statuses, done
