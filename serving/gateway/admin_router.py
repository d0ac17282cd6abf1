"""The gateway's admin HTTP routes: capture depth, tenant pins, and the line's versions.

``GET /admin/capture``; ``GET /admin/pins`` and ``PUT /admin/pins/{tenant}`` (``{"version": N}``
pins a tenant, ``{"version": null}`` clears it); ``GET /admin/versions``; ``POST
/admin/versions/{v}/promote``, ``.../rollback``, ``.../pin`` and ``.../clear``, and ``POST
/admin/unpin``, the same as ``flywheel rollout status|promote|rollback|pin|clear|unpin``
(:mod:`serving.rollout` and :mod:`serving.rollout_actions`, which only this gateway module imports),
with an optional JSON body ``{"reason": ..., "force": ...}``, where ``force`` only applies to
promote, rollback and clear.

Invariants:
- Every route needs an admin key (auth on) or a loopback caller (auth off)
  (:meth:`~serving.gateway.auth.Access.admin`); the audit log names the admin key id.
- A refused rollout action is a 409 whose code says why (``line_pinned``, ``not_pinned``,
  ``rollout_conflict``, ``verification_failed`` for a clear whose weights do not rebuild to their
  hash); a version not in the registry is a 404 ``version_not_found``.
- A version change stands even when the bus cannot announce it (nodes follow the registry); the
  gateway's own routing table is refreshed before the answer.

A route function's docstring becomes its ``description`` in the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from flywheel.keys import check_tenant
from flywheel.settings import Settings
from serving.errors import APIError, from_pydantic
from serving.gateway.openapi import body_schema, optional_body_schema
from serving.gateway.services import services
from serving.protocol import read_json_body

if TYPE_CHECKING:
    from flywheel.weights.registry import Registry

#: The most an admin request body may hold.
MAX_BODY_BYTES = 4096

Body = TypeVar("Body", bound=BaseModel)


class PinRequest(BaseModel):
    """``{"version": N}`` pins a tenant; clearing it takes an explicit ``{"version": null}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: int | None = Field(ge=0, le=2**31 - 1)


class RolloutActionRequest(BaseModel):
    """The optional body of ``POST /admin/versions/{v}/promote|rollback|clear``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    #: Added to the audited reason.
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")
    #: On a pinned line: act anyway (else 409 ``line_pinned``); after a promote or rollback the pin
    #: follows the new stable version, a clear leaves it.
    force: bool = False


class LinePinRequest(BaseModel):
    """The optional body of ``POST /admin/versions/{v}/pin`` and ``POST /admin/unpin``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")


router = APIRouter()


@router.get("/admin/capture")
async def admin_capture(request: Request) -> dict[str, Any]:
    gateway = services(request)
    await gateway.access.admin(request)
    return gateway.capture.depth()


@router.get("/admin/pins")
async def admin_pins(request: Request) -> dict[str, Any]:
    gateway = services(request)
    await gateway.access.admin(request)
    return {"pins": await gateway.state.get_pins()}


@router.get("/admin/versions")
async def admin_versions(request: Request) -> dict[str, Any]:
    gateway = services(request)
    await gateway.access.admin(request)
    registry = line_registry(gateway.settings, gateway.sessions)
    return await asyncio.to_thread(lambda: json.loads(json.dumps(
        rollout().status_report(registry, gateway.sessions, gateway.settings.rollout,
                                metrics=gateway.settings.product_metrics()), default=str)))


@router.post("/admin/versions/{version}/{action}", openapi_extra=optional_body_schema(RolloutActionRequest))
async def admin_version_action(version: int, action: str, request: Request) -> dict[str, Any]:
    """``promote``, ``rollback``, ``pin`` or ``clear`` a version, exactly as ``flywheel rollout
    promote|rollback|pin|clear``."""
    gateway = services(request)
    settings = gateway.settings
    who = await gateway.access.admin(request)
    if action not in ("promote", "rollback", "pin", "clear"):  # rollout_actions.VERSION_ACTIONS (not loaded yet)
        raise APIError(404, f"unknown version action {action!r}; promote, rollback, pin or clear", code="not_found")
    body = await read_optional_body(request, LinePinRequest if action == "pin" else RolloutActionRequest,
                                    settings.gateway.body_read_timeout_s)
    if not 0 <= version < 2**31:
        raise APIError(404, f"version {version} of {settings.model.line} is not in the registry",
                       param="version", code="version_not_found")
    registry = line_registry(settings, gateway.sessions)
    from flywheel.weights.registry import VersionNotFound  # loaded by line_registry

    try:
        result = await asyncio.to_thread(actions().operate, settings, registry, action, version, who, body.reason,
                                         getattr(body, "force", False))
    except VersionNotFound:
        raise APIError(404, f"version {version} of {settings.model.line} is not in the registry",
                       param="version", code="version_not_found") from None
    except actions().RolloutError as exc:
        raise APIError(409, str(exc), code=exc.code) from None
    await gateway.router.refresh()
    return result


@router.post("/admin/unpin", openapi_extra=optional_body_schema(LinePinRequest))
async def admin_unpin(request: Request) -> dict[str, Any]:
    """Lift the line's rollout pin, exactly as ``flywheel rollout unpin``."""
    gateway = services(request)
    who = await gateway.access.admin(request)
    body = await read_optional_body(request, LinePinRequest, gateway.settings.gateway.body_read_timeout_s)
    registry = line_registry(gateway.settings, gateway.sessions)
    try:
        lifted = await asyncio.to_thread(actions().manual_unpin, registry, who, body.reason)
    except actions().RolloutError as exc:
        raise APIError(409, str(exc), code="not_pinned") from None
    return {"unpinned": actions().pin_figures(lifted)}


@router.put("/admin/pins/{tenant}", openapi_extra=body_schema(PinRequest))
async def admin_set_pin(tenant: str, request: Request) -> dict[str, Any]:
    gateway = services(request)
    await gateway.access.admin(request)
    try:
        check_tenant(tenant)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tenant", code="invalid_value") from None
    body = await read_json_body(request, MAX_BODY_BYTES, gateway.settings.gateway.body_read_timeout_s)
    try:
        pin = PinRequest.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    if pin.version is not None and not await gateway.router.registered(pin.version):
        raise APIError(404, f"version {pin.version} of {gateway.settings.model.line} is not in the registry",
                       param="version", code="version_not_found")
    await gateway.state.set_pin(tenant, pin.version)
    await gateway.router.refresh()
    held = pin.version is None or any(pin.version in n["versions"] for n in gateway.router.live_versions()["nodes"])
    return {"tenant": tenant, "version": pin.version, "served": held}


def rollout() -> ModuleType:
    """:mod:`serving.rollout` (the controller's status report), imported by the first version route
    rather than at start-up: it brings the weight registry and with it torch (about 250 MB and
    1.7 s), which a gateway that never serves an admin version call should not pay."""
    import serving.rollout

    return serving.rollout


def actions() -> ModuleType:
    """:mod:`serving.rollout_actions` (promote, roll back, pin, unpin, announce), imported like
    :func:`rollout` at the first version route."""
    import serving.rollout_actions

    return serving.rollout_actions


def line_registry(settings: Settings, sessions: sessionmaker[Session]) -> Registry:
    """The line's registry for the version routes (status changes only: no weights move)."""
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    return Registry(sessions, make_store(settings), settings.model.line, announce=actions().node_waker(settings))


async def read_optional_body(request: Request, model: type[Body], timeout_s: float) -> Body:
    """The request body as ``model``; no body at all gives ``model()`` (its defaults)."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return model()
    try:
        return model.model_validate(await read_json_body(request, MAX_BODY_BYTES, timeout_s))
    except ValidationError as exc:
        raise from_pydantic(exc) from None
