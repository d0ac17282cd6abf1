"""``n > 1`` through the gateway and the built-in node, over real HTTP: every choice, whole or
streamed, chat or text, is its own generation event of one group, the client learns each choice's
generation id, feedback can name any of them, and after ingest and the rewards stage the choices
are each other's baseline.

One node + gateway pair per module (test_streaming's stack: real entry points in threads, a
local-log bus, SQLite); every test finds its events by generation id.
"""

from __future__ import annotations

import math
import threading

import httpx
import pytest

from flywheel import lm
from tests.fixtures.roles import MESSAGES
from tests.integration.test_streaming import stream

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def _ids(response: httpx.Response, n: int) -> list[str]:
    ids = [g.strip() for g in response.headers["X-Flywheel-Generation"].split(",")]
    group = response.headers["X-Flywheel-Generation-Group"]
    assert ids == [f"{group}-{i}" for i in range(n)]
    return ids


def test_each_choice_of_a_chat_completion_is_its_own_generation(served, tokenizer) -> None:
    eos = str(tokenizer.eos_token_id)  # biased away: the choices are ten tokens long, so they differ
    body = {"messages": MESSAGES, "max_tokens": 10, "n": 4, "temperature": 1.3, "logprobs": True,
            "return_token_ids": True, "logit_bias": {eos: -100}}
    with httpx.Client(timeout=60) as client:
        r = client.post(f"{served.gateway}{CHAT}", json=body, headers={"X-Flywheel-Session": "ch-1"})
        assert r.status_code == 200, r.text
        ids = _ids(r, 4)
        answer = r.json()
        # Feedback can name any choice; the group's own id is not a generation.
        for i, generation in enumerate(ids):
            fb = client.post(f"{served.gateway}/v1/feedback", json={
                "feedback_id": f"fb-ch-{i}", "generation_id": generation, "kind": "explicit", "signal": "thumbs",
                "value": 1 if i == 2 else -1})
            assert fb.status_code == 202, fb.text
        group = client.post(f"{served.gateway}/v1/feedback", json={
            "feedback_id": "fb-ch-group", "generation_id": r.headers["X-Flywheel-Generation-Group"],
            "kind": "explicit", "signal": "thumbs", "value": 1})
        assert group.status_code == 404 and group.json()["error"]["code"] == "generation_not_found"

    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # independent samples
    assert answer["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    found = served.events(ids)
    assert all(len(found[g]) == 1 for g in ids), {g: len(e) for g, e in found.items()}
    events = [found[g][0] for g in ids]
    assert {(e.group_id, e.session_id, e.model_version, e.ts) for e in events} == {
        (r.headers["X-Flywheel-Generation-Group"], "ch-1", 0, events[0].ts)}
    for i, (event, choice) in enumerate(zip(events, choices, strict=True)):
        assert event.choice_index == i and event.sampling.n == 4 and event.sampling.temperature == 1.3
        assert event.prompt_token_ids == answer["prompt_token_ids"] == lm.chat_prompt_ids(tokenizer, MESSAGES)
        assert event.completion_token_ids == choice["token_ids"]
        assert event.completion_logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
        assert event.response["choices"] == [choice] and event.request == body


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_stream_of_n_choices_is_relayed_and_each_choice_captured(served, kind) -> None:
    body = {"max_tokens": 8, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        body |= {"messages": MESSAGES, "logprobs": True}
        path = CHAT
    else:
        body |= {"prompt": "add 2 and 3", "logprobs": 0}
        path = "/v1/completions"
    with httpx.Client(timeout=60) as client:
        r, events = stream(client, f"{served.gateway}{path}", body)
    assert r.status_code == 200
    ids = _ids(r, 3)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(len(c["choices"]) == 1 for c in chunks) and usage["choices"] == []
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    logprobs: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert "token_ids" not in choice  # the client did not ask for them
        texts[choice["index"]] += choice["delta"].get("content") or "" if kind == "chat" else choice["text"]
        if kind == "chat":
            logprobs[choice["index"]] += [e["logprob"] for e in (choice["logprobs"] or {}).get("content") or []]
        else:
            logprobs[choice["index"]] += (choice["logprobs"] or {}).get("token_logprobs") or []
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]  # the choices interleave
    found = served.events(ids)
    captured = [found[g][0] for g in ids]
    assert usage["usage"]["completion_tokens"] == sum(len(e.completion_token_ids) for e in captured)
    for i, event in enumerate(captured):
        assert event.choice_index == i and event.group_id == r.headers["X-Flywheel-Generation-Group"]
        assert event.completion_logprobs == logprobs[i]
        (choice,) = event.response["choices"]
        assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == texts[i]


def test_n_above_the_maximum_is_refused_and_nothing_is_captured(served) -> None:
    with httpx.Client(timeout=60) as client:
        r = client.post(f"{served.gateway}{CHAT}", json={"messages": MESSAGES, "n": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "X-Flywheel-Generation" not in r.headers
        r = client.post(f"{served.node}{CHAT}", json={"messages": MESSAGES, "n": 9})  # node.max_n
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_the_choices_are_each_others_baseline_after_ingest_and_rewards(served) -> None:
    """Through ingest and the rewards stage: four choices, the user likes choice 2 and not the
    others, then the session is solved. Turn rewards (default spec): the thumbs, plus a quarter of
    the outcome on each choice; leave-one-out baselines leave only the thumbs' difference."""
    from flywheel.events import ScoredTrajectory
    from ingest.worker import run as run_ingest
    from rewards import guards
    from rewards.worker import run as run_rewards
    from tests.fixtures.roles import RoleThread, wait_until

    session = next(f"grp-{i}" for i in range(100) if not guards.is_held_out("local", f"grp-{i}", 0.05))
    stop = threading.Event()
    roles = [RoleThread("ingest", run_ingest, served.settings, stop),
             RoleThread("rewards", run_rewards, served.settings, stop)]
    for role in roles:
        role.start()
    consumer = served.bus.consumer(f"scored-{session}", [served.settings.topic("scored")])
    try:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{served.gateway}{CHAT}", json={"messages": MESSAGES, "max_tokens": 6, "n": 4},
                            headers={"X-Flywheel-Session": session})
            assert r.status_code == 200, r.text
            ids = _ids(r, 4)
            feedback = [{"feedback_id": f"{session}-{i}", "generation_id": g, "kind": "explicit", "signal": "thumbs",
                         "value": 1 if i == 2 else -1} for i, g in enumerate(ids)]
            feedback.append({"feedback_id": f"{session}-solved", "session_id": session, "kind": "outcome",
                             "signal": "task_solved", "value": 1})
            assert client.post(f"{served.gateway}/v1/feedback", json={"feedback": feedback}).status_code == 202
        scored: list[ScoredTrajectory] = []

        def arrived() -> bool:
            assert all(role.error is None for role in roles), [role.error for role in roles]
            scored.extend(s for s in (ScoredTrajectory.from_bytes(rec.value) for rec in consumer.poll(timeout_s=0.2))
                          if s.session_id == session)
            return bool(scored)

        wait_until("the session to be scored", arrived, timeout_s=60)
    finally:
        consumer.close()
        stop.set()
        for role in roles:
            role.join(timeout=30)
    (sample,) = scored
    turns = [t for s in sample.segments for t in s.turns]
    assert [(t.generation_id, t.choice_index) for t in turns] == [(g, i) for i, g in enumerate(ids)]
    assert sample.turn_rewards == pytest.approx([-0.75, -0.75, 1.25, -0.75])
    assert sample.total_reward == pytest.approx(-1.0)  # thumbs -2, outcome +1, as from one turn
    std = math.sqrt(0.75)  # of [-1, -1, 1, -1]; leave-one-out means: -1/12 for the others, -0.75 for choice 2
    assert sample.turn_advantages == pytest.approx([(-0.75 + 1 / 12) / std] * 2 + [2.0 / std, (-0.75 + 1 / 12) / std])
