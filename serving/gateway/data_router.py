"""The data-rights routes: erase or export an end user's (or a session's) data, for an admin or for
a tenant's own key.

Admin (an admin key, or a loopback caller while ``gateway.auth`` is off), any tenant:

- ``POST /admin/data/forget`` ``{"tenant": T, "user": U}`` or ``{"tenant": T, "session": S}``: 202
  with the erasure (its ``id``, ``state`` ``pending``, the ``trained_into`` versions) and its
  ``Location``; the rows are deleted in the background (``flywheel data forget``, flywheel/erasure.py).
- ``GET /admin/data/erasures/{id}``: its ``state`` (``pending`` | ``done``), ``counts`` per kind,
  ``trained_into``, ``requested_by``, ``requested_at``, ``completed_at``.
- ``POST /admin/data/export`` with the same body: the rows as JSON Lines
  (``application/x-ndjson``), as ``flywheel data export`` writes them. A POST, not a GET with a
  query: the raw user id stays out of URLs, which proxies and access logs keep.

A tenant's key, its own tenant only: ``POST /v1/data/forget``, ``GET /v1/data/erasures/{id}`` and
``POST /v1/data/export``, the same bodies and answers with ``tenant`` left out (or naming the key's
own tenant). A product forwards its end users' requests (GDPR's access and erasure), so it acts
for its users as the operator does, within its tenant.

Invariants:
- A tenant key never reaches another tenant's data: a body or query naming another tenant is a
  403 ``tenant_mismatch``, another tenant's erasure the same 404 ``erasure_not_found`` as one that
  does not exist. The tenant is the key's (``serving.gateway.auth``); no header or body widens it.
- With ``gateway.auth`` off the tenant routes answer loopback callers only, like the admin routes:
  without keys anyone could name the default tenant's users.
- The audit's ``requested_by`` names the key by its id (or the loopback caller), never the key; a
  tenant reading an erasure an operator asked for sees ``the operator``, not the admin key's id.

Each route only translates HTTP; :class:`~serving.gateway.data.DataServing` does the work. A route
function's docstring becomes its ``description`` in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from serving.errors import APIError, from_pydantic
from serving.gateway.data import NDJSON, TENANT_CALLER, SubjectRequest
from serving.gateway.openapi import body_schema
from serving.gateway.services import Services, services
from serving.protocol import read_json_body

#: The most a data request's body may hold (a user id of MAX_USER_CHARS, escaped).
MAX_BODY_BYTES = 16 * 1024

router = APIRouter()


# Admin ---------------------------------------------------------------------------------------


@router.post("/admin/data/forget", status_code=202, openapi_extra=body_schema(SubjectRequest))
async def admin_forget(request: Request) -> JSONResponse:
    """Erase a tenant's end user (``user``, the id as the client sends it) or session: 202 with the
    erasure, whose rows are deleted in the background; ``trained_into`` names the versions trained
    on them (weights are not unlearned)."""
    gateway = services(request)
    who = await gateway.access.admin(request)
    body = await subject_body(request, gateway)
    answer = await gateway.data.forget(gateway.data.subject(body, required_tenant(body)), who, operator=True)
    return accepted(answer, "/admin")


@router.get("/admin/data/erasures/{erasure_id}")
async def admin_erasure(erasure_id: int, request: Request) -> dict[str, Any]:
    """An erasure's state, rows deleted per kind, the versions trained on them, and its audit."""
    gateway = services(request)
    await gateway.access.admin(request)
    return found(await gateway.data.erasure(erasure_id, None, operator=True), erasure_id)


@router.post("/admin/data/export", openapi_extra=body_schema(SubjectRequest))
async def admin_export(request: Request) -> StreamingResponse:
    """A tenant's end user's (``user``) or session's rows as JSON Lines."""
    gateway = services(request)
    who = await gateway.access.admin(request)
    body = await subject_body(request, gateway)
    return streamed(await gateway.data.export(gateway.data.subject(body, required_tenant(body)), who))


# A tenant's own --------------------------------------------------------------------------------


@router.post("/v1/data/forget", status_code=202, openapi_extra=body_schema(SubjectRequest))
async def forget(request: Request) -> JSONResponse:
    """Erase one of this key's tenant's end users (``user``) or sessions: 202 with the erasure."""
    gateway = services(request)
    tenant, who = await tenant_caller(request, gateway)
    body = scoped(await subject_body(request, gateway), tenant)
    return accepted(await gateway.data.forget(gateway.data.subject(body, tenant), who), "/v1")


@router.get("/v1/data/erasures/{erasure_id}")
async def erasure(erasure_id: int, request: Request) -> dict[str, Any]:
    """One of this key's tenant's erasures: state, counts, versions trained on the data, audit."""
    gateway = services(request)
    tenant, _ = await tenant_caller(request, gateway)
    return found(await gateway.data.erasure(erasure_id, tenant), erasure_id)


@router.post("/v1/data/export", openapi_extra=body_schema(SubjectRequest))
async def export(request: Request) -> StreamingResponse:
    """One of this key's tenant's end users' (``user``) or sessions' rows as JSON Lines."""
    gateway = services(request)
    own, who = await tenant_caller(request, gateway)
    body = scoped(await subject_body(request, gateway), own)
    return streamed(await gateway.data.export(gateway.data.subject(body, own), who))


# Translation -----------------------------------------------------------------------------------


async def tenant_caller(request: Request, gateway: Services) -> tuple[str, str]:
    """The calling key's tenant, and who it is for the audit (module invariants)."""
    principal = await gateway.access.caller(request)
    if gateway.access.keys is None:
        return principal.tenant, await gateway.access.admin(request)
    return principal.tenant, f"{TENANT_CALLER}{principal.key_id}"


def scoped(subject: SubjectRequest, tenant: str) -> SubjectRequest:
    if subject.tenant is not None and subject.tenant != tenant:
        raise APIError(403, f"this API key acts for tenant {tenant!r} only: another tenant's data is not "
                       "reachable with it", param="tenant", code="tenant_mismatch")
    return subject


def required_tenant(subject: SubjectRequest) -> str:
    if subject.tenant is None:
        raise APIError(400, "name the tenant the user or session belongs to", param="tenant",
                       code="missing_required_parameter")
    return subject.tenant


async def subject_body(request: Request, gateway: Services) -> SubjectRequest:
    body = await read_json_body(request, MAX_BODY_BYTES, gateway.settings.gateway.body_read_timeout_s)
    try:
        return SubjectRequest.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def accepted(answer: dict[str, Any], prefix: str) -> JSONResponse:
    return JSONResponse(answer, status_code=202, headers={"Location": f"{prefix}/data/erasures/{answer['id']}"})


def found(answer: dict[str, Any] | None, erasure_id: int) -> dict[str, Any]:
    if answer is None:
        raise APIError(404, f"erasure {erasure_id} not found for this API key", param="erasure_id",
                       code="erasure_not_found")
    return answer


class ExportResponse(StreamingResponse):
    """An export's stream that stops its reading thread when the response ends, however it ends
    (sent whole, the client gone, the server stopping): a generator left suspended is closed only
    when it is garbage-collected."""

    def __init__(self, chunks: Iterator[bytes], close: Callable[[], None]) -> None:
        super().__init__(chunks, media_type=NDJSON, headers={
            "Cache-Control": "no-store", "Content-Disposition": 'attachment; filename="flywheel-export.jsonl"'})
        self.close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


def streamed(export: tuple[Iterator[bytes], Callable[[], None]]) -> ExportResponse:
    return ExportResponse(*export)
