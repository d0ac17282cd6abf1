"""Sticky versions on the fleet: which model version a new session gets, and who serves a version.

The policy is pure: :func:`new_session_version` maps a :class:`RoutingTable` (the registry's
stable and canary versions, the canary fraction, admin pins per tenant) and a session to a
version. A pinned tenant gets its pin; otherwise a ``canary`` version gets ``canary_fraction`` of
new sessions, chosen by a hash of tenant and session id (the same session always lands on the same
side, in every gateway process); everything else gets ``stable``; None when nothing is stable.
The caller stores the answer as the session's version for its life (``state.pin_session``), so a
trajectory has one behaviour policy; this module never changes a session's version.

:class:`Router` is the IO around it, built once per gateway: a snapshot of the registry statuses
(``model_versions``, read through SQLAlchemy in a worker thread), the tenant pins (an async
callable, e.g. ``GatewayState.get_pins``) and the node heartbeats (live state, in a worker thread).

Invariants:
- Nothing on the request path waits for IO except the very first :meth:`Router.table`: the
  snapshot is served as it is and refreshed in the background once older than ``cache_s``
  (default 1 s), one refresh at a time. A source that fails keeps its last good value (logged),
  so a registry or Redis blip never changes a routing decision; the registry must have been read
  once, or :meth:`Router.table` answers 503.
- New sessions are only proposed versions a node holds, when nodes heartbeat (:func:`servable`,
  :func:`servable_pins`), so a promotion, a canary or a pin does not answer 409 while the fleet is
  still loading it (a pin no node holds is ignored until one does).
- :meth:`Router.upstream_for` names a heartbeating node of this model line that holds the version
  (round robin across them); with no such node, ``gateway.upstream`` when set, else any node of
  the line, else the local node URL. The caller still sends ``X-Flywheel-Model-Version``: a node
  that does not hold it answers 409 ``version_unavailable`` (the caller may move the session to a
  new version), and the version recorded is always the one the upstream names.
- A node whose heartbeat carries ``model_names`` (a vLLM server in LoRA mode) serves each version
  under its own model name and names no version in its answers. :meth:`Router.target_for` says
  which ``model`` to send it for the version (:class:`Upstream`; such a node counts as holding
  only the versions it names), and :func:`as_line` turns its answer (or each stream chunk) back
  into the line's: ``model`` the line, ``model_version`` the version that name serves, after
  checking that the node answered for the name it was sent. For other nodes both are no-ops.
- :meth:`Router.live_versions` (for ``/v1/models``) shows versions and node ids, never node URLs
  or tenant pins.
- The fleet is *starting* (:meth:`Router.starting`) until an upstream first answers this gateway
  (:meth:`Router.answered`): a node of the fleet (a heartbeating one, or the local node when no
  ``gateway.upstream`` is set) that refuses the connection until then is still coming up, not
  down. An upstream set by hand, or any node after the first answer, that refuses is a failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from flywheel.db.models import ModelVersion
from flywheel.sampling import DEFAULT_KEYS
from flywheel.settings import Settings
from serving.errors import APIError
from serving.gateway.capture import CaptureError, is_number

log = logging.getLogger(__name__)

#: Reads the admin-set per-tenant pins ({tenant: version}).
Pins = Callable[[], Awaitable[Mapping[str, int]]]


@dataclass(frozen=True)
class RoutingTable:
    stable: int | None
    canary: int | None = None
    canary_fraction: float = 0.0
    pins: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    url: str
    live_version: int | None
    versions: tuple[int, ...]  # held, ascending
    status: str = ""
    region: str = ""
    #: (version, model name) for every version held, when the node serves each version under its
    #: own model name (heartbeat ``model_names``); None for a node that names versions itself.
    model_names: tuple[tuple[int, str], ...] | None = None
    #: The sampling defaults the node's engine applies to what a request leaves unset (heartbeat
    #: ``sampling_defaults``: the model's generation_config.json, ``flywheel.sampling``).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()

    def model_for(self, version: int | None) -> str | None:
        """The ``model`` a request for ``version`` names on this node (None: not one it names)."""
        return dict(self.model_names or ()).get(version) if version is not None else None


@dataclass(frozen=True)
class Upstream:
    """Where a request goes, and for a node that serves versions under their own model names
    (``names_versions``), the ``model`` to send and the ``version`` that name serves. ``model`` is
    None on such a node when it holds no name for the version: the node cannot serve it."""

    url: str
    node_id: str = ""
    names_versions: bool = False
    model: str | None = None
    version: int | None = None
    #: What the node applies where a request is silent (:attr:`NodeInfo.sampling_defaults`).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def unavailable(self) -> bool:
        return self.names_versions and self.model is None


def as_line(body: dict[str, Any], upstream: Upstream, line: str) -> dict[str, Any]:
    """An answer (or one stream chunk) of ``upstream`` as the line's: for a node that names versions
    by model, ``model`` becomes ``line`` and ``model_version`` the version served, once the node
    answered for the model it was sent (:class:`CaptureError` otherwise); other answers unchanged."""
    if not upstream.names_versions:
        return body
    model = body.get("model")
    if model is not None and model != upstream.model:
        raise CaptureError(f"upstream answered for model {model!r}, sent {upstream.model!r}")
    return {**body, "model": line, "model_version": upstream.version}


def canary_bucket(tenant: str, session_id: str) -> float:
    """A session's place in [0, 1): uniform over sessions, the same in every process."""
    digest = hashlib.blake2b(f"{tenant}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def new_session_version(routing: RoutingTable, tenant: str, session_id: str) -> int | None:
    """The version a new session starts on (see the module docstring)."""
    pin = routing.pins.get(tenant)
    if pin is not None:
        return pin
    if routing.canary is not None and canary_bucket(tenant, session_id) < routing.canary_fraction:
        return routing.canary
    return routing.stable


def nodes_from_heartbeats(beats: Mapping[str, Mapping[str, Any]], model_line: str) -> list[NodeInfo]:
    """The nodes of ``model_line`` in heartbeat payloads that name a URL, by node id.

    A node that reports no ``versions`` (an older node) holds just its ``live_version``. A node that
    reports ``model_names`` holds only the versions it names.
    """
    nodes = []
    for node_id, beat in sorted(beats.items()):
        url = beat.get("url")
        if beat.get("model_line") != model_line or not isinstance(url, str) or not url:
            continue
        live = beat.get("live_version")
        live = live if isinstance(live, int) else None
        held = beat.get("versions")
        if not isinstance(held, list):
            held = [] if live is None else [live]
        versions = tuple(sorted({v for v in held if isinstance(v, int)}))
        names = beat.get("model_names")
        model_names = None
        if isinstance(names, dict):
            named = {int(v): m for v, m in names.items() if isinstance(v, str) and v.isdigit()
                     and isinstance(m, str) and m}
            versions = tuple(v for v in versions if v in named)
            model_names = tuple((v, named[v]) for v in versions)
        defaults = beat.get("sampling_defaults")
        defaults = tuple(sorted((k, v) for k, v in defaults.items() if k in DEFAULT_KEYS and is_number(v))) \
            if isinstance(defaults, dict) else ()
        nodes.append(NodeInfo(node_id, url.rstrip("/"), live, versions, str(beat.get("status", "")),
                              str(beat.get("region", "")), model_names, defaults))
    return nodes


def servable(statuses: tuple[int | None, int | None], nodes: list[NodeInfo]) -> tuple[int | None, int | None]:
    """The registry's (stable, canary) as the fleet can serve them now: while no node holds the
    stable version yet (a promotion reaches nodes within their poll interval), the newest version
    nodes serve live; a canary no node holds yet is no canary. Without heartbeating nodes (an
    external upstream, or an embedded node whose live state this process cannot see), unchanged."""
    stable, canary = statuses
    if not nodes:
        return stable, canary
    held = {v for n in nodes for v in n.versions}
    if stable not in held:
        stable = max((n.live_version for n in nodes if n.live_version is not None), default=stable)
    return stable, canary if canary in held else None


def servable_pins(pins: Mapping[str, int], nodes: list[NodeInfo]) -> dict[str, int]:
    """The tenant pins a node can serve now (all of them without heartbeating nodes): a pin to a
    version no node holds is ignored (the tenant follows the rollout) rather than answered 409."""
    if not nodes:
        return dict(pins)
    held = {v for n in nodes for v in n.versions}
    return {tenant: version for tenant, version in pins.items() if version in held}


class Router:
    """Routing snapshot for one gateway; use from its event loop."""

    def __init__(
        self, settings: Settings, session_factory: Any, live: Any, pins: Pins | None = None, *, cache_s: float = 1.0
    ) -> None:
        self.settings = settings
        self.model_line = settings.model.line
        self.cache_s = cache_s
        self.fallback = (
            settings.gateway.upstream or settings.node.url or f"http://{settings.node.host}:{settings.node.port}"
        ).rstrip("/")
        self._sessions = session_factory
        self._live = live
        self._pins = pins
        self._statuses: tuple[int | None, int | None] | None = None  # (stable, canary) once read
        self._pin_map: Mapping[str, int] = {}
        self._nodes: list[NodeInfo] = []
        self._loaded_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None
        self._turn = itertools.count()
        self._failing: set[str] = set()
        self._answered = False  # an upstream answered this gateway once: the fleet has started

    # Reading the snapshot ----------------------------------------------------------------------

    async def table(self) -> RoutingTable:
        """The routing table; waits only while the registry was never read (then at most one
        attempt per ``cache_s``; 503 while it fails)."""
        if self._statuses is None:
            if self._refreshing is not None and not self._refreshing.done():
                await asyncio.shield(self._refreshing)
            elif time.monotonic() - self._loaded_at >= self.cache_s:
                await self.refresh()
        else:
            self._refresh_if_stale()
        if self._statuses is None:
            raise APIError(503, "the model registry cannot be read yet; retry shortly", code="routing_unavailable")
        stable, canary = servable(self._statuses, self._nodes)
        return RoutingTable(stable, canary, self.settings.rollout.canary_fraction, servable_pins(self._pin_map, self._nodes))

    def upstream_for(self, version: int | None) -> str:
        """Base URL of an upstream for ``version`` (None: any node of the line)."""
        return self.target_for(version).url

    def target_for(self, version: int | None) -> Upstream:
        """An upstream for ``version`` (None: any node of the line, at its live version), with the
        model name to send when the node serves versions under their own names."""
        self._refresh_if_stale()
        nodes = [n for n in self._nodes if version is None or version in n.versions]
        if not nodes and not self.settings.gateway.upstream:
            nodes = self._nodes  # held nowhere: a node of the line answers 409 version_unavailable
        if not nodes:
            return Upstream(self.fallback)
        node = nodes[next(self._turn) % len(nodes)]
        if node.model_names is None:
            return Upstream(node.url, node.node_id, sampling_defaults=node.sampling_defaults)
        served = node.live_version if version is None else version
        return Upstream(node.url, node.node_id, names_versions=True, model=node.model_for(served), version=served,
                        sampling_defaults=node.sampling_defaults)

    def answered(self) -> None:
        """An upstream answered a request (any status): the fleet is no longer starting."""
        self._answered = True

    def starting(self, target: Upstream) -> bool:
        """Whether ``target`` refusing the connection means the fleet is still starting (module
        docstring): no upstream has answered yet, and ``target`` is a node of the fleet."""
        return not self._answered and (bool(target.node_id) or not self.settings.gateway.upstream)

    def live_versions(self) -> dict[str, Any]:
        """The line, its stable and canary versions, and the versions live on nodes with their ids."""
        self._refresh_if_stale()
        stable, canary = self._statuses or (None, None)
        on_nodes: dict[int, list[str]] = {}
        for node in self._nodes:
            for version in node.versions:
                on_nodes.setdefault(version, []).append(node.node_id)
        return {
            "model_line": self.model_line,
            "stable": stable,
            "canary": canary,
            "canary_fraction": self.settings.rollout.canary_fraction,
            "versions": [{"version": v, "nodes": ids} for v, ids in sorted(on_nodes.items())],
            "nodes": [
                {"node_id": n.node_id, "region": n.region, "live_version": n.live_version,
                 "versions": list(n.versions), "status": n.status}
                for n in self._nodes
            ],
        }

    # Refreshing --------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Reload every source with a read that starts after this call (so a pin or status written
        before it is seen): a refresh already under way is waited for, then one more runs."""
        if self._refreshing is not None and not self._refreshing.done():
            await asyncio.shield(self._refreshing)
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._reload())
        await asyncio.shield(self._refreshing)

    async def close(self) -> None:
        """Wait for a refresh under way (call before the event loop ends)."""
        if self._refreshing is not None:
            await asyncio.gather(self._refreshing, return_exceptions=True)

    def _refresh_if_stale(self) -> None:
        if time.monotonic() - self._loaded_at < self.cache_s:
            return
        if self._refreshing is not None and not self._refreshing.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop: serve the snapshot as it is
            return
        self._refreshing = loop.create_task(self._reload())

    async def _reload(self) -> None:
        self._loaded_at = time.monotonic()
        statuses = await self._read("registry", asyncio.to_thread(self._read_statuses))
        if statuses is not None:
            self._statuses = statuses
        nodes = await self._read("heartbeats", self._read_nodes())
        if nodes is not None:
            self._nodes = nodes
        if self._pins is not None:
            pins = await self._read("pins", self._read_pins(self._pins))
            if pins is not None:
                self._pin_map = pins

    async def _read_nodes(self) -> list[NodeInfo]:
        return nodes_from_heartbeats(await asyncio.to_thread(self._live.heartbeats), self.model_line)

    @staticmethod
    async def _read_pins(pins: Pins) -> dict[str, int]:
        return {tenant: int(version) for tenant, version in (await pins()).items()}

    async def _read(self, source: str, pending: Awaitable[Any]) -> Any:
        try:
            value = await pending
        except Exception as exc:  # keep the last good value; retried on the next refresh
            if source not in self._failing:
                log.error("routing: cannot read %s, keeping the last snapshot: %s: %s", source, type(exc).__name__, exc)
            self._failing.add(source)
            return None
        if source in self._failing:
            log.info("routing: reading %s again", source)
            self._failing.discard(source)
        return value

    async def registered(self, version: int) -> bool:
        """Whether ``version`` of this line is in the registry (any status)."""

        def read() -> bool:
            query = select(ModelVersion.version).where(
                ModelVersion.model_line == self.model_line, ModelVersion.version == version)
            with self._sessions() as session:
                return session.execute(query).first() is not None

        return await asyncio.to_thread(read)

    def _read_statuses(self) -> tuple[int | None, int | None]:
        query = select(ModelVersion.version, ModelVersion.status).where(
            ModelVersion.model_line == self.model_line, ModelVersion.status.in_(("stable", "canary"))
        )
        with self._sessions() as session:
            rows = session.execute(query).all()
        stable = max((v for v, s in rows if s == "stable"), default=None)
        canary = max((v for v, s in rows if s == "canary"), default=None)
        return stable, canary
