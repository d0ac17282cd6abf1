"""What the gateway records: upstream responses and feedback turned into wire events (pure), and
the one adapter that appends them to the bus.

Invariants:
- A GenerationEvent carries the token ids and per-token logprobs exactly as the upstream engine
  returned them and the version the upstream names; a response without them cannot be captured
  and is an upstream error (:class:`CaptureError`), never a silently partial event.
- The response the client sees loses only what the gateway itself asked for (logprobs, token ids,
  prompt token ids) and the client did not.
- :meth:`Recorder.send` returns only once the bus has the record durably; it raises otherwise.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from flywheel.events import FEEDBACK_SIGNALS, FeedbackEvent, GenerationEvent, SamplingParams, feedback_event_id
from serving.protocol import MODEL_VERSION_HEADER, NODE_HEADER, ChatCompletionRequest, FeedbackItem


class CaptureError(Exception):
    """The upstream response lacks something a GenerationEvent needs."""


@dataclass(frozen=True)
class Served:
    """What the upstream engine says it did, extracted from its response."""

    model_version: int
    node_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return value
    return None


def extract_served(body: dict[str, Any], headers: Mapping[str, str]) -> Served:
    """Pull token ids, logprobs, version and node out of an upstream chat completion."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise CaptureError("upstream response must have exactly one choice")
    choice = choices[0]

    version: Any = body.get("model_version")
    if version is None:
        version = _header(headers, MODEL_VERSION_HEADER)
    try:
        model_version = int(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CaptureError(
            f"upstream response names no model version (field model_version or header {MODEL_VERSION_HEADER})"
        ) from None
    if model_version < 0:
        raise CaptureError(f"upstream model version {model_version} is negative")

    prompt_ids = body.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    if not _is_int_list(prompt_ids) or not _is_int_list(completion_ids):
        raise CaptureError("upstream response lacks prompt_token_ids / choices[0].token_ids (return_token_ids)")

    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not all(isinstance(e, dict) and "logprob" in e for e in content):
        raise CaptureError("upstream response lacks choices[0].logprobs.content")
    logprobs = [float(e["logprob"]) for e in content]
    if len(logprobs) != len(completion_ids):
        raise CaptureError(
            f"upstream returned {len(logprobs)} logprobs for {len(completion_ids)} completion tokens"
        )
    return Served(
        model_version=model_version,
        node_id=_header(headers, NODE_HEADER) or "upstream",
        prompt_token_ids=list(prompt_ids),
        completion_token_ids=list(completion_ids),
        completion_logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
    )


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """The sampling parameters as the engine applied them (OpenAI defaults where the client sent none)."""
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        seed=request.seed,
    )


def generation_event(
    *,
    generation_id: str,
    tenant: str,
    session_id: str,
    model_line: str,
    request_body: dict[str, Any],
    request: ChatCompletionRequest,
    response_body: dict[str, Any],
    served: Served,
    latency_ms: float,
) -> GenerationEvent:
    return GenerationEvent(
        tenant=tenant,
        session_id=session_id,
        generation_id=generation_id,
        model_line=model_line,
        model_version=served.model_version,
        node_id=served.node_id,
        request=request_body,
        response=response_body,
        prompt_token_ids=served.prompt_token_ids,
        completion_token_ids=served.completion_token_ids,
        completion_logprobs=served.completion_logprobs,
        sampling=sampling_params(request),
        finish_reason=served.finish_reason,
        latency_ms=max(0.0, latency_ms),
    )


def upstream_request(body: dict[str, Any], default_model: str) -> dict[str, Any]:
    """The client's body with everything capture needs forced on."""
    out = dict(body)
    out.setdefault("model", default_model)
    if out.get("model") is None:
        out["model"] = default_model
    out["logprobs"] = True
    out["return_token_ids"] = True
    return out


def client_response(body: dict[str, Any], request: ChatCompletionRequest) -> dict[str, Any]:
    """The upstream response minus what only capture asked for."""
    out = copy.deepcopy(body)
    if not request.return_token_ids:
        out.pop("prompt_token_ids", None)
    for choice in out.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if not request.logprobs:
            choice["logprobs"] = None
        if not request.return_token_ids:
            choice.pop("token_ids", None)
    return out


def feedback_problem(item: FeedbackItem) -> str | None:
    """Why a feedback item's signal does not fit its kind, or None."""
    allowed = FEEDBACK_SIGNALS[item.kind]
    if allowed and item.signal not in allowed:
        return f"signal {item.signal!r} is not one of the {item.kind} signals; allowed: {', '.join(allowed)}"
    return None


def feedback_event(item: FeedbackItem, *, tenant: str, session_id: str) -> FeedbackEvent:
    return FeedbackEvent(
        event_id=feedback_event_id(tenant, item.feedback_id),
        tenant=tenant,
        session_id=session_id,
        feedback_id=item.feedback_id,
        generation_id=item.generation_id,
        kind=item.kind,
        signal=item.signal,
        value=item.value,
        comment=item.comment,
        data=item.data,
    )


class Recorder:
    """Appends events to their bus topics, keyed by session id, durably.

    A lock serialises sends: a producer is not assumed to be thread-safe, and sends are called
    from the server's worker threads.
    """

    def __init__(self, producer: Any, generations_topic: str, feedback_topic: str) -> None:
        self._producer = producer
        self._topics = {"generations": generations_topic, "feedback": feedback_topic}
        self._lock = threading.Lock()

    def send(self, events: list[GenerationEvent] | list[FeedbackEvent]) -> None:
        with self._lock:
            for event in events:
                topic = self._topics[type(event).topic]
                self._producer.send(
                    topic,
                    event.session_id,
                    event.to_bytes(),
                    {"event_type": type(event).__name__, "event_id": event.event_id},
                )
            self._producer.flush()
