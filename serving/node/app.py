"""The built-in node's HTTP surface: OpenAI-compatible chat completions plus an admin API.

``create_app(engine, updater=None, settings)``.

Response contract (OpenAI ChatCompletion plus vLLM-style extras):
- ``choices[0].message.content`` and ``finish_reason`` ("stop" | "length");
- ``choices[0].logprobs.content[j] = {token, logprob, bytes, top_logprobs: []}`` when ``logprobs``;
- ``choices[0].token_ids`` and top-level ``prompt_token_ids`` when ``return_token_ids``;
- ``model_version`` always, and the headers ``X-Flywheel-Model-Version`` and ``X-Flywheel-Node``.

Invariants: the version reported is the one whose weights sampled the tokens (taken from the
engine's completion, not read separately); unsupported options (``n > 1``, ``top_logprobs > 0``,
streaming) are a 400, never silently ignored. ``stop`` is accepted and ignored (generation stops at
eos or the token budget).

Admin surface: ``POST /admin/update_weights`` only answers loopback clients — settings have no
admin credential yet; a later issue replaces this check with one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic, install_error_handlers
from serving.node.engine import Engine, EngineNotReady, GenerationRequest
from serving.protocol import MODEL_VERSION_HEADER, NODE_HEADER, ChatCompletionRequest, parse_chat_request, read_json_body


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


def completion_body(
    engine: Engine, chat: ChatCompletionRequest, model_name: str, prompt_ids: list[int], completion: Any
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": engine.text(completion.token_ids)},
        "finish_reason": completion.finish_reason,
        "logprobs": None,
    }
    if chat.logprobs:
        content = []
        for token_id, logprob in zip(completion.token_ids, completion.logprobs, strict=True):
            token = engine.token_text(token_id)
            content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []})
        choice["logprobs"] = {"content": content}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(completion.token_ids),
            "total_tokens": len(prompt_ids) + len(completion.token_ids),
        },
        "model_version": completion.version,
    }
    if chat.return_token_ids:
        choice["token_ids"] = list(completion.token_ids)
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def create_app(engine: Engine, updater: Any = None, settings: Settings | None = None) -> FastAPI:
    settings = settings or engine.settings
    model_name = settings.model.line
    node_id = settings.node.node_id
    max_body_bytes = settings.node.max_body_bytes
    app = FastAPI(title=f"flywheel node {node_id}", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.updater = updater
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        chat = parse_chat_request(await read_json_body(request, max_body_bytes))
        if chat.model is not None and chat.model != model_name:
            raise APIError(404, f"the model `{chat.model}` does not exist; this node serves `{model_name}`",
                           param="model", code="model_not_found")
        if chat.top_logprobs:
            raise APIError(400, "top_logprobs > 0 is not supported yet; use 0 or omit it", param="top_logprobs")

        try:
            prompt_ids = engine.prompt_ids(chat.plain_messages())
        except TemplateError as exc:
            raise APIError(400, f"the model's chat template rejects these messages: {exc}", param="messages") from None
        if not prompt_ids:
            raise APIError(400, "the messages encode to an empty prompt", param="messages")
        max_new = chat.max_new_tokens(settings.node.max_new_tokens)
        if engine.max_context is not None and len(prompt_ids) + max_new > engine.max_context:
            raise APIError(
                400,
                f"the prompt is {len(prompt_ids)} tokens and max_tokens is {max_new}: together they exceed the "
                f"model's context of {engine.max_context} tokens; shorten the conversation or lower max_tokens",
                param="messages" if len(prompt_ids) >= engine.max_context else "max_tokens",
                code="context_length_exceeded",
            )
        gen = GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            temperature=1.0 if chat.temperature is None else chat.temperature,
            top_p=1.0 if chat.top_p is None else chat.top_p,
            seed=chat.seed,
        )
        try:
            completion = await asyncio.wrap_future(engine.submit(gen))
        except EngineNotReady as exc:
            raise APIError(503, str(exc), code="not_ready") from None
        body_out = completion_body(engine, chat, model_name, prompt_ids, completion)
        headers = {MODEL_VERSION_HEADER: str(completion.version), NODE_HEADER: node_id}
        return JSONResponse(body_out, headers=headers)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        version, _ = engine.current()
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "flywheel", "model_version": version}],
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
        raw = await request.body()
        try:
            req = UpdateWeightsRequest.model_validate_json(raw or b"{}")
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
