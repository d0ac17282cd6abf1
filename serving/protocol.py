"""OpenAI-compatible request models shared by the gateway and the built-in node.

Invariants:
- Types are strict (``"0.5"`` is not a temperature, ``1`` is not a boolean): a client bug surfaces
  as a 400 naming the field instead of being silently coerced.
- Unknown top-level fields are kept (``extra="allow"``) so the gateway forwards vendor extensions
  to an upstream such as vLLM untouched; unknown fields inside a message are kept as well.
- ``messages`` is never empty and every role is one the chat template knows.
- ``stream_options`` only comes with ``stream: true``; ``n`` (choices per request) is at most the
  server's configured maximum (``max_n``), a 400 naming ``n`` above it.

Server-Sent Events, as both apps write and the gateway reads them: each event is one
``data: <JSON>`` line and a blank line; a stream ends with ``data: [DONE]``; an error inside a
stream is ``data: {"error": {...}}`` (the envelope of :mod:`serving.errors`) and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from flywheel import consent, jsonpolicy
from flywheel.events import Ident
from serving.errors import APIError, from_pydantic

_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")

Role = Literal["system", "developer", "user", "assistant", "tool"]

#: Token ids, logprobs and prompt ids the upstream attaches; the gateway strips them unless asked.
MODEL_VERSION_HEADER = "X-Flywheel-Model-Version"
NODE_HEADER = "X-Flywheel-Node"
SESSION_HEADER = "X-Flywheel-Session"
#: The generation id of each choice of a served answer, comma-separated in index order (one id for n = 1).
GENERATION_HEADER = "X-Flywheel-Generation"
#: For n > 1: the id of the group the choices form (the request's id; not itself a feedback target).
GENERATION_GROUP_HEADER = "X-Flywheel-Generation-Group"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined); the tiny engine is text-only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Options chat and text completions share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # vLLM's sampling extensions, with vLLM's ranges (SamplingParams._verify_args, vllm/sampling_params.py).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    #: Token id (a JSON key) -> bias in [-100, 100], as OpenAI documents it.
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int | None = Field(1, ge=1, le=128)  # at most the server's max_n (_check_common)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool | None = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        """How many choices the request asks for (``n``, 1 when null)."""
        return self.n or 1


class ChatCompletionRequest(_SamplingFields):
    """The subset of OpenAI's chat completion request flywheel understands, plus vLLM's
    ``return_token_ids``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_SamplingFields):
    """A legacy text completion (``/v1/completions``): one prompt, as text or as token ids.

    ``logprobs`` is the legacy integer (how many alternatives per token; 0 = only the sampled
    token's logprob); ``echo``, ``suffix`` and ``best_of`` are accepted by the schema so that a
    request using them gets a clear 400 rather than a silent difference.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens or default


class FeedbackItem(BaseModel):
    """One feedback submission about one metric (``flywheel.metrics``), named in ``metric`` or, as
    before metrics were declared, in ``kind`` + ``signal``; ``feedback_id`` is the client's
    idempotency key. Whether the metric exists and the value fits it is checked by the gateway
    against the declared metrics (a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    feedback_id: Ident = Field(max_length=128)
    session_id: Ident | None = Field(None, max_length=256)
    generation_id: Ident | None = Field(None, max_length=128)
    metric: Ident | None = Field(None, max_length=64)
    kind: Literal["explicit", "implicit", "outcome", "custom"] | None = None
    signal: Ident | None = Field(None, max_length=64)
    #: A number; ``true``/``false`` only for a boolean metric.
    value: float | bool | None = Field(None, allow_inf_nan=False)
    comment: str | None = Field(None, max_length=10_000)
    data: dict[str, Any] | None = None


class FeedbackBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    feedback: list[FeedbackItem] = Field(min_length=1, max_length=1000)


_Request = TypeVar("_Request", bound=BaseModel)


def _validate(model: type[_Request], body: Any, max_n: int) -> _Request:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    _check_common(request, max_n)
    return request


def parse_chat_request(body: Any, *, max_n: int = 1) -> ChatCompletionRequest:
    """Validate a parsed JSON body as a chat completion this server supports (at most ``max_n``
    choices), or raise a 400."""
    return _validate(ChatCompletionRequest, body, max_n)


def parse_completion_request(body: Any, *, max_n: int = 1) -> CompletionRequest:
    """Validate a parsed JSON body as a text completion this server supports (at most ``max_n``
    choices), or raise a 400."""
    req = _validate(CompletionRequest, body, max_n)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported; send a string or one list of token ids",
                           param="prompt")
        req.prompt = prompt = prompt[0]
    if not prompt:
        raise APIError(400, "prompt is empty; send some text or token ids", param="prompt")
    if req.echo:
        raise APIError(400, "echo is not supported; send echo=false", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", param="best_of")
    return req


def _check_common(req: _SamplingFields, max_n: int) -> None:
    if req.n is not None and req.n > max_n:
        raise APIError(400, f"n is {req.n}; this server returns at most {max_n} choices per request",
                       param="n", code="invalid_value")
    for token, bias in (req.logit_bias or {}).items():
        if not token.isdigit() or len(token) > 10:
            raise APIError(400, f"logit_bias keys are token ids; {token[:40]!r} is not one", param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias for token {token} is {bias}; biases lie in [-100, 100]",
                           param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


# Server-Sent Events --------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each event in a stream of SSE lines (multi-line data joined by newlines;
    comments, ``event:``, ``id:`` and ``retry:`` fields ignored)."""
    buffer: list[str] = []
    async for line in lines:
        if line == "":
            if buffer:
                yield "\n".join(buffer)
                buffer = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\n".join(buffer)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The raw request body, or an OpenAI-style 4xx: over ``limit`` bytes (413), or not whole
    within ``timeout_s`` of starting to read it (408, and the connection is closed: a client
    trickling its body cannot hold the server)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s (received {size} bytes)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise APIError(400, "the client disconnected before sending the whole body", code="client_disconnected",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


async def read_json_body(request: Request, limit: int, timeout_s: float | None = None) -> Any:
    """The request body parsed as JSON, or an OpenAI-style 4xx: :func:`read_body`'s, empty, or
    outside the system's JSON policy (``flywheel.jsonpolicy``: malformed, NaN/Infinity, numbers out
    of range, lone UTF-16 surrogates, repeated keys, nested deeper than 64 levels): 400 naming the
    field in ``param``."""
    raw = await read_body(request, limit, timeout_s)
    if not raw.strip():
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        return jsonpolicy.loads(raw)
    except jsonpolicy.JSONPolicyError as exc:
        where = f"{exc.path}: " if exc.path else ""
        raise APIError(400, f"request body breaks the JSON policy: {where}{exc.problem}", param=exc.path or None,
                       code="invalid_json") from None


def check_session_id(value: str) -> str:
    """A client-chosen session id, or a 400 if it is too long or not printable."""
    if len(value) > 256:
        raise APIError(400, "session id is longer than 256 characters", param="session_id")
    if not _PRINTABLE.match(value):
        raise APIError(400, "session id must be printable (no control characters)", param="session_id")
    return value


def check_data_use(policy: consent.TenantPolicy, header: str | None) -> consent.DataUse:
    """The tightest of the tenant's ``policy`` and the request's ``X-Flywheel-Data`` header (a
    looser header is not applied), or a 400 naming the header for a value it does not know."""
    try:
        return consent.request_use(policy, header)
    except ValueError as exc:
        raise APIError(400, str(exc), param=consent.HEADER, code="invalid_data_use") from None
