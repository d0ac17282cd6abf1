"""What the gateway records: upstream responses and feedback turned into wire events (pure). The
events are handed to the capture spool (``serving/gateway/shipper.py``), which ships them to the bus.

Invariants:
- A GenerationEvent carries the token ids and per-token logprobs exactly as the upstream engine
  returned them and the version the upstream names; a response without them cannot be captured
  and is an upstream error (:class:`CaptureError`), never a silently partial event.
- The response the client sees loses only what the gateway itself asked for (logprobs, token ids,
  prompt token ids, the usage chunk of a stream, the reasoning of a client that sent
  ``include_reasoning: false``) and the client did not. The gateway adds nothing that shapes
  sampling; the event records what the engine applied (``flywheel.sampling.applied``).
- A stream is captured whole or not at all: :class:`StreamAssembler` folds the upstream's chunks
  into the body a non-streaming call would have returned, and only a stream that reached its end
  yields its :class:`Served`; the events then have the same shape as a non-streaming call's.
- The raw end-user id (``user``, ``flywheel.identity``) is in no event and never reaches the
  upstream: the recorded request drops the field (:func:`recorded_request`), the event carries its
  keyed hash in ``user_hash``, and the upstream is sent the hash as ``user``.
- A request for ``n`` choices gets exactly ``n`` from the upstream (indexes ``0..n-1``, one prompt,
  one version) or is an upstream error; each choice becomes its own event (:func:`generation_events`,
  ids from :func:`generation_ids`), the request's choices one group.

Kinds: ``"chat"`` (``/v1/chat/completions``: logprobs in ``choices[i].logprobs.content``,
``prompt_token_ids`` top-level) and ``"text"`` (``/v1/completions``: logprobs in
``choices[i].logprobs.token_logprobs``, ``prompt_token_ids`` on each choice, as vLLM puts them);
either place is accepted for the prompt ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from flywheel import sampling
from flywheel.events import (
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    TrainUse,
    feedback_event_id,
    utcnow,
)
from serving.protocol import (
    MODEL_VERSION_HEADER,
    NODE_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackItem,
)

Kind = Literal["chat", "text"]
Request = ChatCompletionRequest | CompletionRequest


class CaptureError(Exception):
    """The upstream response lacks something a GenerationEvent needs."""


@dataclass(frozen=True)
class Served:
    """What the upstream engine says it did for one choice, extracted from its response."""

    model_version: int
    node_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    index: int = 0


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return value
    return None


def _model_version(value: Any) -> int:
    try:
        version = int(value)
    except (TypeError, ValueError):
        raise CaptureError(
            f"upstream response names no model version (field model_version or header {MODEL_VERSION_HEADER})"
        ) from None
    if version < 0:
        raise CaptureError(f"upstream model version {version} is negative")
    return version


def _choice_index(choice: Any, n: int) -> int:
    index = choice.get("index", 0) if isinstance(choice, dict) else None
    if type(index) is not int or not 0 <= index < n:
        raise CaptureError(f"upstream choice index {index!r} is not one of the {n} choices asked for (0..{n - 1})")
    return index


def extract_served(body: dict[str, Any], headers: Mapping[str, str], kind: Kind = "chat", n: int = 1) -> list[Served]:
    """Token ids, logprobs, version and node of each of the ``n`` choices of an upstream (chat or
    text) completion, in index order; exactly the indexes ``0..n-1``, each once, sharing one prompt."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise CaptureError(f"upstream response must have exactly {n} choice{'s' if n > 1 else ''}")
    by_index = {_choice_index(c, n): c for c in choices}
    if len(by_index) != n:
        raise CaptureError("upstream response repeats a choice index")

    version: Any = body.get("model_version")
    model_version = _model_version(_header(headers, MODEL_VERSION_HEADER) if version is None else version)
    node_id = _header(headers, NODE_HEADER) or "upstream"
    out = []
    for index in range(n):
        choice = by_index[index]
        prompt_ids = body.get("prompt_token_ids")
        if prompt_ids is None:
            prompt_ids = choice.get("prompt_token_ids")
        completion_ids = choice.get("token_ids")
        if not _is_int_list(prompt_ids) or not _is_int_list(completion_ids):
            raise CaptureError(f"upstream response lacks prompt_token_ids / choices[{index}].token_ids (return_token_ids)")
        if out and prompt_ids != out[0].prompt_token_ids:
            raise CaptureError(f"upstream choices 0 and {index} name different prompt_token_ids")
        logprobs = _logprobs(choice.get("logprobs"), kind, index)
        if len(logprobs) != len(completion_ids):
            raise CaptureError(f"upstream returned {len(logprobs)} logprobs for {len(completion_ids)} completion "
                               f"tokens of choice {index}")
        out.append(Served(
            model_version=model_version,
            node_id=node_id,
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(completion_ids),
            completion_logprobs=logprobs,
            finish_reason=choice.get("finish_reason"),
            index=index,
        ))
    return out


def _logprobs(value: Any, kind: Kind, index: int) -> list[float]:
    if kind == "chat":
        content = value.get("content") if isinstance(value, dict) else None
        if not isinstance(content, list) or not all(isinstance(e, dict) and is_number(e.get("logprob")) for e in content):
            raise CaptureError(f"upstream response lacks choices[{index}].logprobs.content")
        return [float(e["logprob"]) for e in content]
    values = value.get("token_logprobs") if isinstance(value, dict) else None
    if not isinstance(values, list) or not all(is_number(v) for v in values):
        raise CaptureError(f"upstream response lacks choices[{index}].logprobs.token_logprobs")
    return [float(v) for v in values]


def is_number(value: Any) -> bool:
    """A JSON number (int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return type(value) is list and all(type(v) is int for v in value)  # not bool, not a subclass


def sampling_params(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> SamplingParams:
    """The sampling parameters the engine applied to the client's ``body``: the client's values,
    else the engine's ``defaults`` (its heartbeat's: the model's generation_config.json), else
    OpenAI's; plus the knobs that reshape the distribution beyond what the trainer recomputes."""
    return SamplingParams(**sampling.applied(body, defaults), unsupported=sampling.unsupported_knobs(body))


def generation_ids(request_id: str, n: int) -> list[str]:
    """The generation id of each of a request's ``n`` choices, in index order: the request's own
    id for ``n = 1``, else ``<request id>-<index>`` (the request's id is then the group's)."""
    return [request_id] if n == 1 else [f"{request_id}-{index}" for index in range(n)]


def generation_events(
    *,
    request_id: str,
    tenant: str,
    session_id: str,
    model_line: str,
    request_body: dict[str, Any],
    response_body: dict[str, Any],
    served: list[Served],
    latency_ms: float,
    sampling_defaults: Mapping[str, Any],
    user_hash: str | None = None,
    data_use: TrainUse = "train",
) -> list[GenerationEvent]:
    """One event per choice (``served`` in index order). For ``n > 1`` the events share the
    request's id as ``group_id``, the prompt and one timestamp, and each carries the response with
    its own choice only (``usage`` stays the request's). The request is recorded without its raw
    ``user`` (:func:`recorded_request`); ``user_hash`` is the end user's keyed hash, if one was named;
    ``data_use`` what the tenant and the request allow (``flywheel.consent``; ``none`` is never recorded)."""
    request_body = recorded_request(request_body)
    ids = generation_ids(request_id, len(served))
    grouped = len(served) > 1
    choices = {c.get("index", 0): c for c in response_body["choices"]} if grouped else {}
    sampling = sampling_params(request_body, sampling_defaults)
    ts = utcnow()
    events = []
    for one, generation_id in zip(served, ids, strict=True):
        response = {**response_body, "choices": [choices[one.index]]} if grouped else response_body
        events.append(GenerationEvent(
            ts=ts,
            tenant=tenant,
            session_id=session_id,
            generation_id=generation_id,
            model_line=model_line,
            model_version=one.model_version,
            node_id=one.node_id,
            request=request_body,
            response=response,
            prompt_token_ids=one.prompt_token_ids,
            completion_token_ids=one.completion_token_ids,
            completion_logprobs=one.completion_logprobs,
            sampling=sampling,
            finish_reason=one.finish_reason,
            latency_ms=max(0.0, latency_ms),
            group_id=request_id if grouped else None,
            choice_index=one.index,
            user_hash=user_hash,
            data_use=data_use,
        ))
    return events


def recorded_request(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as it is recorded: everything but the raw end-user id (``user``),
    which only its hash (``GenerationEvent.user_hash``) stands for."""
    return {key: value for key, value in body.items() if key != "user"}


def upstream_request(body: dict[str, Any], default_model: str, kind: Kind = "chat",
                     user_hash: str | None = None) -> dict[str, Any]:
    """The client's body with what capture needs forced on: the sampled tokens' logprobs, prompt
    and completion token ids, token ids and logprobs even when reasoning is hidden from the client,
    and for a stream the final usage chunk. Nothing that shapes sampling is added: the engine
    applies the client's knobs, else the model's defaults, and the event records which. The end
    user is named by ``user_hash`` (OpenAI's ``user`` asks for a stable id, not a person's name):
    the raw ``user`` never leaves the gateway."""
    out = recorded_request(body)
    if user_hash is not None:
        out["user"] = user_hash
    if out.get("model") is None:
        out["model"] = default_model
    if kind == "chat":
        out["logprobs"] = True
    elif not isinstance(out.get("logprobs"), int):
        out["logprobs"] = 0
    out["return_token_ids"] = True
    # vLLM drops token ids and logprobs with include_reasoning false; the reasoning is cut from what
    # the client gets instead (client_response, client_chunk).
    out.pop("include_reasoning", None)
    if out.get("stream") is True:
        options = out.get("stream_options")
        out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return out


#: Where vLLM puts a reasoning model's thinking: the message (or stream delta) fields
#: ``reasoning_content`` (0.18) and ``reasoning`` (0.33).
REASONING_FIELDS = ("reasoning_content", "reasoning")


def _hides_reasoning(request: Request) -> bool:
    return (request.model_extra or {}).get("include_reasoning") is False


def _strip_choice(choice: Any, request: Request) -> Any:
    if not isinstance(choice, dict):
        return choice
    choice = dict(choice)
    if _hides_reasoning(request):
        for part in ("message", "delta"):
            if isinstance(choice.get(part), dict) and any(f in choice[part] for f in REASONING_FIELDS):
                choice[part] = {k: v for k, v in choice[part].items() if k not in REASONING_FIELDS}
    if not request.wants_logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    if not request.return_token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    return choice


def client_response(body: dict[str, Any], request: Request) -> dict[str, Any]:
    """The upstream response minus what only capture asked for."""
    out = dict(body)  # shallow: only top-level keys and choices are replaced, never mutated in place
    if not request.return_token_ids:
        out.pop("prompt_token_ids", None)
    if isinstance(out.get("choices"), list):
        out["choices"] = [_strip_choice(c, request) for c in out["choices"]]
    return out


def client_chunk(chunk: dict[str, Any], request: Request) -> dict[str, Any] | None:
    """One upstream stream chunk as the client should see it, or None when the client did not ask
    for it at all (the usage chunk the gateway forced on)."""
    out = dict(chunk)
    if not request.return_token_ids:
        out.pop("prompt_token_ids", None)
    if not request.include_usage and "usage" in out:
        del out["usage"]
        if not out.get("choices"):
            return None
    if isinstance(out.get("choices"), list):
        out["choices"] = [_strip_choice(c, request) for c in out["choices"]]
    return out


class _Parts:
    """What one choice's stream chunks carried so far."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[Any] = []  # chat: content entries; text: token logprobs
        self.tokens: list[Any] = []  # text: the tokens of logprobs.tokens
        self.text: list[str] = []
        self.role = "assistant"
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None


class StreamAssembler:
    """Folds an upstream stream's chunks into the body the same call would have returned without
    ``stream`` (chat: ``message`` with content and merged tool calls; text: ``text``), with the
    token ids, logprobs, prompt ids, usage and version every chunk contributed, for each of the
    ``n`` choices the request asked for (chunks of different choices may interleave, as vLLM sends them).

    :meth:`feed` raises :class:`CaptureError` for a chunk that breaks the contract (not an object,
    a choice index outside ``0..n-1``, conflicting prompt ids or versions); :meth:`finish` raises it
    for a stream that cannot be captured (a choice without a finish reason, ids and logprobs not
    aligned, no version).
    """

    def __init__(self, kind: Kind, headers: Mapping[str, str], n: int = 1) -> None:
        self.kind = kind
        self.headers = headers
        self.n = n
        self.meta: dict[str, Any] = {}
        self.version: int | None = None
        self.prompt_token_ids: list[int] | None = None
        self.choices = [_Parts() for _ in range(n)]
        self.usage: Any = None
        header = _header(headers, MODEL_VERSION_HEADER)
        if header is not None:
            self.version = _model_version(header)

    def feed(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise CaptureError("upstream stream event is not a JSON object")
        for key in ("id", "created", "model"):
            if key not in self.meta and chunk.get(key) is not None:
                self.meta[key] = chunk[key]
        if chunk.get("model_version") is not None:
            version = _model_version(chunk["model_version"])
            if self.version is not None and version != self.version:
                raise CaptureError(f"upstream stream names model versions {self.version} and {version}")
            self.version = version
        self._prompt(chunk.get("prompt_token_ids"))
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise CaptureError("upstream stream chunk has a choices field that is not a list")
        for choice in choices:
            self._choice(self.choices[_choice_index(choice, self.n)], choice)

    def _prompt(self, ids: Any) -> None:
        if ids is None:
            return
        if not _is_int_list(ids):
            raise CaptureError("upstream prompt_token_ids is not a list of token ids")
        if self.prompt_token_ids is not None and ids != self.prompt_token_ids:
            raise CaptureError("upstream stream sent two different prompt_token_ids")
        self.prompt_token_ids = list(ids)

    def _choice(self, parts: _Parts, choice: dict[str, Any]) -> None:
        self._prompt(choice.get("prompt_token_ids"))
        ids = choice.get("token_ids")
        if ids is not None:
            if not _is_int_list(ids):
                raise CaptureError("upstream choice token_ids is not a list of token ids")
            parts.token_ids.extend(ids)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            if not isinstance(logprobs, dict):
                raise CaptureError("upstream choice logprobs is not an object")
            if self.kind == "chat":
                parts.logprobs.extend(logprobs.get("content") or [])
            else:
                parts.logprobs.extend(logprobs.get("token_logprobs") or [])
                parts.tokens.extend(logprobs.get("tokens") or [])
        if self.kind == "chat":
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise CaptureError("upstream choice delta is not an object")
            parts.role = delta.get("role") or parts.role
            if isinstance(delta.get("content"), str):
                parts.text.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                _tool_call(parts.tool_calls, call)
        elif isinstance(choice.get("text"), str):
            parts.text.append(choice["text"])
        if choice.get("finish_reason") is not None:
            parts.finish_reason = choice["finish_reason"]

    def finish(self) -> tuple[dict[str, Any], list[Served]]:
        """The assembled response body and what it says was served, choice by choice."""
        choices = []
        for index, parts in enumerate(self.choices):
            if parts.finish_reason is None:
                raise CaptureError(f"upstream stream ended without a finish_reason for choice {index}")
            choice: dict[str, Any] = {"index": index, "finish_reason": parts.finish_reason, "token_ids": parts.token_ids}
            if self.kind == "chat":
                message: dict[str, Any] = {"role": parts.role, "content": "".join(parts.text)}
                if parts.tool_calls:
                    message["tool_calls"] = [parts.tool_calls[i] for i in sorted(parts.tool_calls)]
                choice.update(message=message, logprobs={"content": parts.logprobs})
            else:
                choice.update(text="".join(parts.text),
                              logprobs={"tokens": parts.tokens, "token_logprobs": parts.logprobs},
                              prompt_token_ids=self.prompt_token_ids)  # where a whole text completion has them
            choices.append(choice)
        body: dict[str, Any] = {
            **self.meta,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "choices": choices,
            "usage": self.usage,
            "model_version": self.version,
        }
        if self.kind == "chat":  # where a whole chat completion has them (see the module docstring)
            body["prompt_token_ids"] = self.prompt_token_ids
        return body, extract_served(body, self.headers, self.kind, self.n)


def _tool_call(merged_calls: dict[int, dict[str, Any]], call: Any) -> None:
    """Fold one streamed tool-call delta into the calls merged so far (by the call's ``index``)."""
    if not isinstance(call, dict):
        raise CaptureError("upstream tool call delta is not an object")
    merged = merged_calls.setdefault(int(call.get("index", len(merged_calls))), {"function": {}})
    for key in ("id", "type"):
        if call.get(key) is not None:
            merged[key] = call[key]
    function = call.get("function") or {}
    if function.get("name"):
        merged["function"]["name"] = function["name"]
    if function.get("arguments") is not None:
        merged["function"]["arguments"] = merged["function"].get("arguments", "") + function["arguments"]


#: What a client chooses for a feedback id (not the ids the gateway derives, not the time).
_FEEDBACK_CONTENT = {"feedback_id", "session_id", "generation_id", "kind", "signal", "value", "comment", "data"}


def feedback_content(event: FeedbackEvent) -> str:
    """What a client chose for one feedback id, as canonical JSON (sorted keys): two submissions
    of one feedback id are the same signal iff this is equal."""
    return orjson.dumps(event.model_dump(mode="json", include=_FEEDBACK_CONTENT), option=orjson.OPT_SORT_KEYS).decode()


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
