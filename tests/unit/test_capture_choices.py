"""Capturing ``n > 1``: every choice of an upstream answer, whole or streamed (interleaved, as vLLM
sends them), becomes its own generation event of one group; an answer with other choices than
asked for is an upstream error, never a partial capture."""

from __future__ import annotations

import pytest

from flywheel.events import GenerationEvent
from serving.gateway import capture

HEADERS = {"X-Flywheel-Node": "node-7"}
PROMPT = [5, 6, 7]
CHOICES = {0: [10, 11], 1: [20], 2: [30, 31, 32]}


def _chat_choice(index: int, ids: list[int]) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": f"c{index}"}, "finish_reason": "stop",
            "token_ids": ids, "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.1 * t} for t in ids]}}


def _chat_body(choices: dict[int, list[int]]) -> dict:
    return {"id": "x", "object": "chat.completion", "model_version": 4, "prompt_token_ids": PROMPT,
            "choices": [_chat_choice(i, ids) for i, ids in choices.items()]}


def test_every_choice_is_served_in_index_order() -> None:
    body = _chat_body({2: CHOICES[2], 0: CHOICES[0], 1: CHOICES[1]})  # any order on the wire
    served = capture.extract_served(body, HEADERS, "chat", n=3)
    assert [(s.index, s.completion_token_ids, s.prompt_token_ids) for s in served] == [
        (0, [10, 11], PROMPT), (1, [20], PROMPT), (2, [30, 31, 32], PROMPT)]
    assert served[2].completion_logprobs == pytest.approx([-3.0, -3.1, -3.2])
    assert {(s.model_version, s.node_id) for s in served} == {(4, "node-7")}


@pytest.mark.parametrize(("choices", "problem"), [
    ({0: [1], 1: [2]}, "exactly 3 choices"),  # fewer than asked
    ({0: [1], 1: [2], 2: [3], 3: [4]}, "exactly 3 choices"),  # more
    ({0: [1], 1: [2], 5: [3]}, "not one of the 3 choices"),  # an index outside 0..n-1
])
def test_an_answer_with_other_choices_than_asked_is_an_upstream_error(choices, problem) -> None:
    with pytest.raises(capture.CaptureError, match=problem):
        capture.extract_served(_chat_body(choices), HEADERS, "chat", n=3)


def test_repeated_indexes_and_different_prompts_are_upstream_errors() -> None:
    body = _chat_body(CHOICES)
    body["choices"][2]["index"] = 1
    with pytest.raises(capture.CaptureError, match="repeats a choice index"):
        capture.extract_served(body, HEADERS, "chat", n=3)
    text = {"model_version": 1, "choices": [
        {"index": i, "text": "", "token_ids": [1], "prompt_token_ids": [9, i], "logprobs": {"token_logprobs": [-1.0]}}
        for i in range(2)]}
    with pytest.raises(capture.CaptureError, match="different prompt_token_ids"):
        capture.extract_served(text, HEADERS, "text", n=2)


def test_each_choice_is_its_own_event_of_one_group() -> None:
    body = _chat_body(CHOICES)
    request = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "temperature": 0.7}
    events = capture.generation_events(
        request_id="req1", tenant="t", session_id="s", model_line="m", request_body=request, response_body=body,
        served=capture.extract_served(body, HEADERS, "chat", n=3), latency_ms=5.0, sampling_defaults={})
    assert [e.generation_id for e in events] == capture.generation_ids("req1", 3) == ["req1-0", "req1-1", "req1-2"]
    assert {(e.group_id, e.ts, tuple(e.prompt_token_ids)) for e in events} == {("req1", events[0].ts, tuple(PROMPT))}
    assert [e.choice_index for e in events] == [0, 1, 2]
    assert [e.completion_token_ids for e in events] == [CHOICES[0], CHOICES[1], CHOICES[2]]
    # Each event keeps the response with its own choice only, so a reader of choices[0] reads it.
    assert [e.response["choices"] for e in events] == [[c] for c in body["choices"]]
    assert {e.sampling.n for e in events} == {3} and events[0].sampling.temperature == 0.7
    assert GenerationEvent.from_bytes(events[1].to_bytes()) == events[1]  # survives the bus
    # n = 1: the request's id is the generation's, and there is no group.
    (one,) = capture.generation_events(
        request_id="req2", tenant="t", session_id="s", model_line="m", request_body={}, response_body=_chat_body(
            {0: [1]}), served=capture.extract_served(_chat_body({0: [1]}), HEADERS, "chat"), latency_ms=1.0,
        sampling_defaults={})
    assert (one.generation_id, one.group_id, one.choice_index) == ("req2", None, 0)


def _chat_stream() -> list[dict]:
    """vLLM's order: a role chunk per choice (each with the prompt ids), then the choices' tokens
    interleaved, each choice's last token with its finish reason, then the usage."""
    chunks = [{"id": "x", "model_version": 4, "prompt_token_ids": PROMPT,
               "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]} for i in range(3)]
    for step in range(3):
        for i, ids in CHOICES.items():
            if step < len(ids):
                last = step == len(ids) - 1
                chunks.append({"id": "x", "choices": [{
                    "index": i, "delta": {"content": f"<{ids[step]}>"}, "token_ids": [ids[step]],
                    "logprobs": {"content": [{"token": f"t{ids[step]}", "logprob": -0.1 * ids[step]}]},
                    "finish_reason": "stop" if last else None}]})
    chunks.append({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}})
    return chunks


def test_an_interleaved_stream_assembles_every_choice() -> None:
    assembler = capture.StreamAssembler("chat", HEADERS, n=3)
    for chunk in _chat_stream():
        assembler.feed(chunk)
    body, served = assembler.finish()
    assert [c["message"]["content"] for c in body["choices"]] == ["<10><11>", "<20>", "<30><31><32>"]
    assert [s.completion_token_ids for s in served] == [CHOICES[0], CHOICES[1], CHOICES[2]]
    assert served[0].completion_logprobs == pytest.approx([-1.0, -1.1])
    assert body["usage"]["completion_tokens"] == 6 and body["prompt_token_ids"] == PROMPT


def test_a_stream_missing_a_choices_end_or_naming_another_choice_is_not_captured() -> None:
    assembler = capture.StreamAssembler("chat", HEADERS, n=3)
    for chunk in _chat_stream():
        if chunk["choices"] and chunk["choices"][0]["index"] == 1 and chunk["choices"][0].get("finish_reason"):
            chunk["choices"][0]["finish_reason"] = None  # choice 1 never ends
        assembler.feed(chunk)
    with pytest.raises(capture.CaptureError, match="without a finish_reason for choice 1"):
        assembler.finish()
    with pytest.raises(capture.CaptureError, match="not one of the 2 choices"):
        capture.StreamAssembler("chat", HEADERS, n=2).feed(_chat_stream()[2])  # index 2 of n = 2


def test_a_text_stream_of_two_choices() -> None:
    assembler = capture.StreamAssembler("text", HEADERS, n=2)
    for step in range(2):
        for i in range(2):
            choice = {"index": i, "text": f"w{i}{step} ", "token_ids": [10 * i + step],
                      "logprobs": {"tokens": [f"w{i}{step}"], "token_logprobs": [-0.5]},
                      "finish_reason": "length" if step == 1 else None}
            if step == 0:
                choice["prompt_token_ids"] = PROMPT  # each choice's first chunk, as vLLM sends it
            assembler.feed({"model_version": 2, "choices": [choice]})
    body, served = assembler.finish()
    assert [c["text"] for c in body["choices"]] == ["w00 w01 ", "w10 w11 "]
    assert [(s.index, s.prompt_token_ids, s.completion_token_ids) for s in served] == [
        (0, PROMPT, [0, 1]), (1, PROMPT, [10, 11])]
