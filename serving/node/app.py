"""The built-in node's HTTP surface: OpenAI-compatible chat and text completions plus an admin API.

``create_app(engine, updater=None, settings)``.

Response contract (OpenAI plus vLLM-style extras), with ``n`` choices (``index`` 0..n-1, at most
``node.max_n``, independent samples by one version; usage counts the prompt once):
- ``/v1/chat/completions``: ``choices[i].message.content`` and ``finish_reason`` ("stop" |
  "length"); ``choices[i].logprobs.content[j] = {token, logprob, bytes, top_logprobs: []}`` when
  ``logprobs``; ``choices[i].token_ids`` and top-level ``prompt_token_ids`` when ``return_token_ids``.
- ``/v1/completions`` (one prompt, text or token ids; text is tokenised with the model's
  tokenizer, special tokens added as vLLM does): ``choices[i].text``; ``choices[i].logprobs =
  {tokens, token_logprobs, top_logprobs: null, text_offset}`` when ``logprobs`` is 0;
  ``choices[i].token_ids`` and ``choices[i].prompt_token_ids`` when ``return_token_ids``.
- ``model_version`` always (every streamed chunk too), and the headers ``X-Flywheel-Model-Version``
  and ``X-Flywheel-Node``.
- Versions (sticky sessions): the node holds its last ``node.keep_versions`` versions. A request
  with the header ``X-Flywheel-Model-Version: N`` is served by version N, or answered 409
  ``version_unavailable`` naming the versions held; without it, by the live version.
  ``/health`` and ``/v1/models`` list the versions held.
- ``stream: true``: Server-Sent Events (:mod:`serving.protocol`), each chunk one choice. Chat: a
  first chunk per choice with ``delta.role`` (and top-level ``prompt_token_ids``), as vLLM sends
  them, then for each choice one chunk per token with its text delta and, as asked, its logprob
  entry and ``token_ids: [id]``, and a last chunk with an empty delta and ``finish_reason``; text:
  for each choice one chunk per token (its first with ``prompt_token_ids`` on the choice), then one
  with ``finish_reason``. The choices' chunks interleave, one per choice per token step. With
  ``stream_options.include_usage`` every chunk has ``usage: null`` and a final chunk with
  ``choices: []`` carries the usage. Then ``data: [DONE]``.
  The engine is batch-based: a stream is the finished completion replayed token by token, so its
  first byte comes when generation ends (true token streaming needs an incremental engine).
  Text deltas are cut so that they concatenate to exactly the non-streaming text (a token that
  ends inside a multi-byte character or a merge carries "" and a later one the rest).

Invariants: the version reported is the one whose weights sampled the tokens (taken from the
engine's completion, not read separately), and the one the request named, if it named one;
unsupported options (``n`` above ``node.max_n``, ``top_logprobs > 0``, legacy ``logprobs > 0``, ``echo``,
``suffix``, and any knob that would reshape the distribution beyond what ``flywheel.sampling``
computes: structured output, banned or required tokens, ``min_tokens``...) are a 400, never
silently ignored; the knobs it does honour (temperature, top-p, top-k, min-p, the repetition,
presence and frequency penalties, logit bias) shape the distribution exactly as vLLM's sampler
does, the model's generation_config.json filling what a request leaves unset
(``node.generation_config``), and the logprobs returned are those of that processed
distribution; every error a request can meet (bad input, context overflow, engine not ready,
version not held) is answered before a stream starts. ``stop`` is
accepted and ignored (generation stops at eos or the token budget).

Admin surface: ``POST /admin/update_weights`` only answers loopback clients (the peer address of
the TCP connection, not a header: uvicorn takes ``X-Forwarded-For`` only from a loopback proxy), so
only someone with a shell on the node's host reaches it; the gateway forwards nothing but the two
completion routes. Settings have no admin credential for nodes yet; docs/security.md. Every request
body must arrive whole within ``node.body_read_timeout_s`` (else 408); request heads are bounded by
serving/server.py.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, ValidationError

from flywheel import sampling
from flywheel.sampling import Processing
from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic, install_error_handlers
from serving.node.engine import Completion, Engine, EngineNotReady, GenerationRequest, VersionUnavailable
from serving.protocol import (
    MODEL_VERSION_HEADER,
    NODE_HEADER,
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    read_json_body,
    sse_event,
)


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    #: The version to load; omitted means "the registry's stable version".
    version: int | None = None


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def text_deltas(decode: Callable[[list[int]], str], token_ids: list[int]) -> list[str]:
    """One text piece per token such that ``"".join(pieces) == decode(token_ids)``.

    Each token gets what its prefix adds to the decoded text; a prefix that ends in a partial
    character (U+FFFD) or is not a prefix of the whole text holds its piece back for a later token.
    Quadratic in the completion length (each prefix is decoded), fine for the built-in engine.
    """
    full = decode(token_ids)
    pieces: list[str] = []
    sent = 0
    for i in range(1, len(token_ids) + 1):
        prefix = full if i == len(token_ids) else decode(token_ids[:i])
        if len(prefix) < sent or prefix.endswith("\ufffd") or not full.startswith(prefix):
            pieces.append("")
            continue
        pieces.append(prefix[sent:])
        sent = len(prefix)
    return pieces


def _usage(prompt_ids: list[int], choices: list[Completion]) -> dict[str, int]:
    """Usage as vLLM counts it for ``n`` choices: the prompt once, every choice's tokens."""
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _chat_logprob(engine: Engine, token_id: int, logprob: float) -> dict[str, Any]:
    token = engine.token_text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}


def _text_logprobs(engine: Engine, token_ids: list[int], logprobs: list[float], offsets: list[int]) -> dict[str, Any]:
    return {
        "tokens": [engine.token_text(t) for t in token_ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": None,
        "text_offset": list(offsets),
    }


def completion_body(
    engine: Engine, chat: ChatCompletionRequest, model_name: str, prompt_ids: list[int], choices: list[Completion]
) -> dict[str, Any]:
    out = []
    for index, completion in enumerate(choices):
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": engine.text(completion.token_ids)},
            "finish_reason": completion.finish_reason,
            "logprobs": None,
        }
        if chat.logprobs:
            content = [_chat_logprob(engine, t, lp)
                       for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]
            choice["logprobs"] = {"content": content}
        if chat.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
        out.append(choice)
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": out,
        "usage": _usage(prompt_ids, choices),
        "model_version": choices[0].version,
    }
    if chat.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def text_completion_body(
    engine: Engine, req: CompletionRequest, model_name: str, prompt_ids: list[int], choices: list[Completion]
) -> dict[str, Any]:
    out = []
    for index, completion in enumerate(choices):
        pieces = text_deltas(engine.text, completion.token_ids)
        choice: dict[str, Any] = {
            "index": index,
            "text": "".join(pieces),
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        if req.logprobs is not None:
            choice["logprobs"] = _text_logprobs(engine, completion.token_ids, completion.logprobs, _offsets(pieces))
        if req.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
            choice["prompt_token_ids"] = list(prompt_ids)
        out.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": out,
        "usage": _usage(prompt_ids, choices),
        "model_version": choices[0].version,
    }


def _offsets(pieces: list[str]) -> list[int]:
    out, at = [], 0
    for piece in pieces:
        out.append(at)
        at += len(piece)
    return out


def _interleaved(per_choice: list[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """Each choice's chunks, the choices' k-th chunks one after another: the order an engine that
    decodes the ``n`` choices side by side sends them in (vLLM: one chunk per choice per step)."""
    for step in itertools.zip_longest(*per_choice):
        yield from (c for c in step if c is not None)


def chat_chunks(
    engine: Engine, chat: ChatCompletionRequest, model_name: str, prompt_ids: list[int], choices: list[Completion]
) -> Iterator[dict[str, Any]]:
    """The chat completion as ``chat.completion.chunk`` objects (see the module docstring)."""
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    usage = chat.include_usage

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [choice] if choice is not None else [], "model_version": choices[0].version,
        }
        if usage:
            out["usage"] = None
        out.update(extra)
        return out

    for index in range(len(choices)):  # vLLM: a role chunk per choice, each with the prompt's ids
        first = chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
        if chat.return_token_ids:
            first["prompt_token_ids"] = list(prompt_ids)
        yield first

    def tokens(index: int, completion: Completion) -> list[dict[str, Any]]:
        out = []
        pieces = text_deltas(engine.text, completion.token_ids)
        for token_id, logprob, piece in zip(completion.token_ids, completion.logprobs, pieces, strict=True):
            choice: dict[str, Any] = {"index": index, "delta": {"content": piece}, "logprobs": None,
                                      "finish_reason": None}
            if chat.logprobs:
                choice["logprobs"] = {"content": [_chat_logprob(engine, token_id, logprob)]}
            if chat.return_token_ids:
                choice["token_ids"] = [token_id]
            out.append(chunk(choice))
        out.append(chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": completion.finish_reason}))
        return out

    yield from _interleaved([tokens(i, c) for i, c in enumerate(choices)])
    if usage:
        yield chunk(None, usage=_usage(prompt_ids, choices))


def text_completion_chunks(
    engine: Engine, req: CompletionRequest, model_name: str, prompt_ids: list[int], choices: list[Completion]
) -> Iterator[dict[str, Any]]:
    """The text completion as streamed ``text_completion`` objects (see the module docstring)."""
    chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    usage = req.include_usage

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": chunk_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": [choice] if choice is not None else [], "model_version": choices[0].version,
        }
        if usage:
            out["usage"] = None
        out.update(extra)
        return out

    def tokens(index: int, completion: Completion) -> list[dict[str, Any]]:
        out = []
        pieces = text_deltas(engine.text, completion.token_ids)
        offsets = _offsets(pieces)
        for i, (token_id, logprob, piece) in enumerate(zip(completion.token_ids, completion.logprobs, pieces,
                                                           strict=True)):
            choice: dict[str, Any] = {"index": index, "text": piece, "logprobs": None, "finish_reason": None}
            if req.logprobs is not None:
                choice["logprobs"] = _text_logprobs(engine, [token_id], [logprob], [offsets[i]])
            if req.return_token_ids:
                choice["token_ids"] = [token_id]
                if i == 0:
                    choice["prompt_token_ids"] = list(prompt_ids)
            out.append(chunk(choice))
        out.append(chunk({"index": index, "text": "", "logprobs": None, "finish_reason": completion.finish_reason}))
        return out

    yield from _interleaved([tokens(i, c) for i, c in enumerate(choices)])
    if usage:
        yield chunk(None, usage=_usage(prompt_ids, choices))


def stream_response(chunks: Iterator[dict[str, Any]], headers: dict[str, str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield sse_event(chunk)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})


def requested_version(request: Request) -> int | None:
    """The version a request names in ``X-Flywheel-Model-Version``, or None."""
    raw = request.headers.get(MODEL_VERSION_HEADER)
    if raw is None or not raw.strip():
        return None
    try:
        version = int(raw.strip())
    except ValueError:
        version = -1
    if version < 0:
        raise APIError(400, f"header {MODEL_VERSION_HEADER} must be a model version (an integer >= 0), "
                       f"got {raw[:40]!r}", param=MODEL_VERSION_HEADER, code="invalid_value")
    return version


def create_app(engine: Engine, updater: Any = None, settings: Settings | None = None) -> FastAPI:
    settings = settings or engine.settings
    model_name = settings.model.line
    node_id = settings.node.node_id
    max_body_bytes = settings.node.max_body_bytes
    body_timeout_s = settings.node.body_read_timeout_s
    # No trailing-slash redirects: their Location is built from the Host header (docs/security.md).
    app = FastAPI(title=f"flywheel node {node_id}", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.engine = engine
    app.state.updater = updater
    install_error_handlers(app)

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"the model `{model}` does not exist; this node serves `{model_name}`",
                           param="model", code="model_not_found")

    def processing_for(body: dict[str, Any]) -> tuple[Processing, int | None]:
        """The distribution to sample from (the request's knobs, else the model's defaults) and the
        default token budget; a 400 for a knob the engine cannot honour exactly."""
        unsupported = sampling.unsupported_knobs(body)
        if unsupported:
            raise APIError(400, f"`{unsupported[0]}` is not supported by the built-in engine (it would sample "
                           "from another distribution than asked); leave it out or serve with vLLM",
                           param=unsupported[0])
        applied = sampling.applied(body, engine.sampling_defaults)
        bias = applied["logit_bias"] or {}
        vocab = len(engine.tokenizer) if bias else 0
        bad = next((t for t in bias if int(t) >= vocab), None)
        if bad is not None:
            raise APIError(400, f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")
        return Processing.of(applied), applied["max_tokens"]

    async def generate(
        request: Request, req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any], prompt_ids: list[int],
        prompt_param: str,
    ) -> list[Completion]:
        """The request's ``n`` choices, sampled by one version."""
        processing, default_max = processing_for(body)
        if not prompt_ids:
            raise APIError(400, f"the {prompt_param} encode to an empty prompt", param=prompt_param)
        max_new = req.max_new_tokens(default_max or settings.node.max_new_tokens)
        if engine.max_context is not None and len(prompt_ids) + max_new > engine.max_context:
            raise APIError(
                400,
                f"the prompt is {len(prompt_ids)} tokens and max_tokens is {max_new}: together they exceed the "
                f"model's context of {engine.max_context} tokens; shorten the {prompt_param} or lower max_tokens",
                param=prompt_param if len(prompt_ids) >= engine.max_context else "max_tokens",
                code="context_length_exceeded",
            )
        gen = GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            processing=processing,
            seed=req.seed,
            version=requested_version(request),
            n=req.choices,
        )
        try:
            choices = await asyncio.wrap_future(engine.submit(gen))
        except EngineNotReady as exc:
            raise APIError(503, str(exc), code="not_ready") from None
        except VersionUnavailable as exc:
            raise APIError(409, f"{exc}; start a new session or ask for one of those",
                           param=MODEL_VERSION_HEADER, code="version_unavailable") from None
        if settings.node.simulated_latency_s:
            await asyncio.sleep(settings.node.simulated_latency_s)
        return choices

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json_body(request, max_body_bytes, body_timeout_s)
        chat = parse_chat_request(body, max_n=settings.node.max_n)
        check_model(chat.model)
        if chat.top_logprobs:
            raise APIError(400, "top_logprobs > 0 is not supported yet; use 0 or omit it", param="top_logprobs")
        try:
            prompt_ids = engine.prompt_ids(chat.plain_messages())
        except TemplateError as exc:
            raise APIError(400, f"the model's chat template rejects these messages: {exc}", param="messages") from None
        choices = await generate(request, chat, body, prompt_ids, "messages")
        headers = {MODEL_VERSION_HEADER: str(choices[0].version), NODE_HEADER: node_id}
        if chat.stream:
            return stream_response(chat_chunks(engine, chat, model_name, prompt_ids, choices), headers)
        return JSONResponse(completion_body(engine, chat, model_name, prompt_ids, choices), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json_body(request, max_body_bytes, body_timeout_s)
        req = parse_completion_request(body, max_n=settings.node.max_n)
        check_model(req.model)
        if req.logprobs:
            raise APIError(400, "logprobs > 0 (alternatives per token) is not supported yet; use 0 or omit it",
                           param="logprobs")
        if isinstance(req.prompt, str):
            prompt_ids = list(engine.tokenizer.encode(req.prompt))
        else:
            vocab = len(engine.tokenizer)
            bad = next((t for t in req.prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            prompt_ids = list(req.prompt)  # type: ignore[arg-type]
        choices = await generate(request, req, body, prompt_ids, "prompt")
        headers = {MODEL_VERSION_HEADER: str(choices[0].version), NODE_HEADER: node_id}
        if req.stream:
            return stream_response(text_completion_chunks(engine, req, model_name, prompt_ids, choices), headers)
        return JSONResponse(text_completion_body(engine, req, model_name, prompt_ids, choices), headers=headers)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        version, _ = engine.current()
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "flywheel",
                      "model_version": version, "versions": engine.versions()}],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        version, sha = engine.current()
        body: dict[str, Any] = {
            "status": "ok" if version is not None else "starting",
            "node_id": node_id,
            "model_line": model_name,
            "version": version,
            "sha256": sha,
            "versions": engine.versions(),
            "engine": {"requests": engine.requests, "batches": engine.batches},
        }
        if updater is not None:
            body["update_status"] = updater.status
            body["update_detail"] = updater.detail
        return JSONResponse(body, status_code=200 if version is not None else 503)

    @app.post("/admin/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        if not is_loopback(request):
            raise APIError(403, "the admin API only answers loopback clients", code="forbidden")
        if updater is None:
            raise APIError(409, "this node has no updater (no registry configured)", code="no_updater")
        empty = request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers
        try:
            req = UpdateWeightsRequest.model_validate(
                {} if empty else await read_json_body(request, 4096, body_timeout_s))
        except ValidationError as exc:
            raise from_pydantic(exc) from None
        outcome = await run_in_threadpool(updater.update_to if req.version is not None else updater.check_once,
                                          *([req.version] if req.version is not None else []))
        version, sha = engine.current()
        result = {"version": version, "sha256": sha, "status": updater.status, "detail": updater.detail}
        if not outcome.ok:
            raise APIError(409, f"update failed, still serving version {version}: {outcome.detail}", code="update_failed")
        return result

    return app
