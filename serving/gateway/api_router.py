"""The gateway's public HTTP routes: the OpenAI API (``/v1/chat/completions``, ``/v1/completions``,
``/v1/feedback``, ``/v1/models``), ``/health`` and ``/metrics``. The same API answers under
``/sessions/{id}/v1/...`` with the session taken from the path: the app's middleware turns such a
request into this one with the session header set (``serving/gateway/app.py``), so routes here
read the session one way only.

Each route only translates HTTP: it names the caller (:class:`~serving.gateway.auth.Access`:
authenticated, within its rate limit) and hands the request to the serving class that does the
work (:mod:`serving.gateway.completions`, :mod:`serving.gateway.feedback`). Auth and rate-limit
refusals therefore never reach the upstream or the bus.

A route function's docstring becomes its ``description`` in the OpenAPI document: comments here.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.gateway.openapi import body_schema
from serving.gateway.services import services
from serving.protocol import ChatCompletionRequest, CompletionRequest, FeedbackItem

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    started = time.perf_counter()
    gateway = services(request)
    return await gateway.completions(request, await gateway.access.caller(request), "chat", started=started)


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request) -> Response:
    started = time.perf_counter()
    gateway = services(request)
    return await gateway.completions(request, await gateway.access.caller(request), "text", started=started)


@router.post("/v1/feedback", status_code=202, openapi_extra=body_schema(FeedbackItem))
async def feedback(request: Request) -> JSONResponse:
    gateway = services(request)
    principal = await gateway.access.caller(request)
    return await gateway.feedback(request, principal.tenant)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    # The line, with what the live nodes hold under `flywheel` (a docstring would enter the OpenAPI document).
    gateway = services(request)
    await gateway.access.caller(request)
    await gateway.router.table()
    live = gateway.router.live_versions()
    line = gateway.settings.model.line
    return JSONResponse({"object": "list", "data": [
        {"id": line, "object": "model", "created": 0, "owned_by": "flywheel", "flywheel": live},
    ]})


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    gateway = services(request)
    return {"status": "ok", "model_line": gateway.settings.model.line, "capture": gateway.capture.depth()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
