"""The ingest benchmark's workload, pure and seeded: agent sessions built by the gateway's own
capture code (:mod:`serving.gateway.capture`) from vLLM-shaped responses.

A session has 1-4 turns (first prompt 64-160 tokens; each later prompt extends the previous one by
its completion and a 16-token user message), 32 completion tokens with logprobs per turn, a thumbs
on a fifth of the turns, then an outcome. :func:`workload` interleaves sessions as concurrent
users would, each session's own events in order, its outcome last.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from flywheel.events import FeedbackEvent, GenerationEvent

TENANT = "bench"
MODEL_LINE = "bench-model"
VOCAB = 32_000
COMPLETION_TOKENS = 32
USER_TURN_TOKENS = 16
TASKS = 500

Event = GenerationEvent | FeedbackEvent


def _words(rng: random.Random, n_tokens: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(max(1, n_tokens * 3 // 4)))


def session(rng: random.Random) -> list[Event]:
    """One session's events in served order, built the way the gateway builds them."""
    from serving.gateway import capture
    from serving.protocol import FeedbackItem

    session_id = f"s-{uuid.UUID(int=rng.getrandbits(128)).hex}"
    task = rng.randrange(TASKS)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools, then answer."},
        {"role": "user", "content": f"task {task}: {_words(random.Random(task), 80)}"},
    ]
    prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(64, 160))]
    events: list[Event] = []
    for _turn in range(rng.randint(1, 4)):
        completion = [rng.randrange(4, VOCAB) for _ in range(COMPLETION_TOKENS)]
        logprobs = [-round(rng.expovariate(3.0), 6) for _ in completion]
        text = " ".join(f"w{t}" for t in completion)
        body = {"model": "bench", "messages": messages, "max_tokens": COMPLETION_TOKENS, "temperature": 1.0}
        response = {
            "id": f"chatcmpl-{rng.getrandbits(64):x}", "object": "chat.completion", "created": 0, "model": "bench",
            "model_version": 1, "prompt_token_ids": prompt,
            "choices": [{
                "index": 0, "finish_reason": "length", "token_ids": completion,
                "message": {"role": "assistant", "content": text},
                "logprobs": {"content": [{"token": f"w{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                         for t, lp in zip(completion, logprobs)]},
            }],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                      "total_tokens": len(prompt) + len(completion)},
        }
        served = capture.extract_served(response, {"X-Flywheel-Node": "bench-node"})
        (generation,) = capture.generation_events(
            request_id=uuid.UUID(int=rng.getrandbits(128)).hex, tenant=TENANT, session_id=session_id,
            model_line=MODEL_LINE, request_body=body, response_body=response, served=served,
            latency_ms=rng.uniform(200, 900), sampling_defaults={},
        )
        events.append(generation)
        if rng.random() < 0.2:
            item = FeedbackItem(feedback_id=uuid.UUID(int=rng.getrandbits(128)).hex, kind="explicit",
                                signal="thumbs", value=rng.choice([1.0, -1.0]), generation_id=generation.generation_id)
            events.append(capture.feedback_event(item, tenant=TENANT, session_id=session_id))
        user = [rng.randrange(4, VOCAB) for _ in range(USER_TURN_TOKENS)]
        messages = [*messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": _words(rng, USER_TURN_TOKENS)}]
        prompt = prompt + completion + user
    outcome = FeedbackItem(feedback_id=uuid.UUID(int=rng.getrandbits(128)).hex, kind="outcome",
                           signal=rng.choice(["task_solved", "tests_passed"]), value=float(rng.random() < 0.6))
    events.append(capture.feedback_event(outcome, tenant=TENANT, session_id=session_id))
    return events


def workload(n_events: int, concurrency: int, seed: int) -> list[Event]:
    """At least ``n_events`` events of whole sessions, ``concurrency`` sessions interleaved at a time
    (each session's own events stay in order); the last event of every session is its outcome."""
    rng = random.Random(seed)
    pending: list[list[Event]] = []
    built = 0
    while built < n_events:
        pending.append(session(rng))
        built += len(pending[-1])
    pending.reverse()
    active: list[list[Event]] = []
    out: list[Event] = []
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(pending.pop())
        i = rng.randrange(len(active))
        out.append(active[i].pop(0))
        if not active[i]:
            active[i] = active[-1]
            active.pop()
    return out


def is_outcome(event: Event) -> bool:
    return isinstance(event, FeedbackEvent) and event.kind == "outcome"
