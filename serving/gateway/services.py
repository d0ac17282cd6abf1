"""What the gateway opens at start-up and closes at shutdown, and the serving objects built on it.

:func:`open_services` opens, in order, the capture (write-ahead spool and its shipper to the bus),
the database (API keys, ownership, the registry), the live state (sessions, rate limits, pins),
the live heartbeats behind the version router, and the upstream connection pool, and reads the
user-id secret (``flywheel.identity.load_secret``: made on first start); then builds each serving
class once with those clients injected (and starts the data-rights erasure worker). It closes
them in reverse order, also when start-up fails half-way. The routers reach the result through :func:`services`.

Invariants:
- The capture opens first and closes last: a response is never released without its event in the
  spool, so everything the clients were answered is shipped or kept for the next start.
- A bus that is down does not stop the gateway serving: the capture's shipper makes its producers
  itself (``producer_factory`` replaces them; tests inject a broken one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from sqlalchemy.orm import Session, sessionmaker

from flywheel.db.session import make_session_factory, open_database
from flywheel.identity import load_secret
from flywheel.live import make_live
from flywheel.settings import Settings
from serving.gateway.auth import Access, KeyStore, Ownership
from serving.gateway.completions import CompletionServing
from serving.gateway.data import DataServing
from serving.gateway.feedback import FeedbackServing
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.routing import Router
from serving.gateway.shipper import Capture, bus_producer_factory
from serving.gateway.state import GatewayState, make_state
from serving.gateway.upstream import Pool


@dataclass(frozen=True)
class Services:
    """The gateway's clients and serving classes, built once per app (see the module docstring)."""

    settings: Settings
    metrics: GatewayMetrics
    capture: Capture
    state: GatewayState
    sessions: sessionmaker[Session]  # the database's
    router: Router
    access: Access
    completions: CompletionServing
    feedback: FeedbackServing
    data: DataServing


def services(request: Request) -> Services:
    """The :class:`Services` of the app serving ``request`` (set by its lifespan)."""
    return request.app.state.services


@contextlib.asynccontextmanager
async def open_services(settings: Settings, metrics: GatewayMetrics,
                        producer_factory: Callable[[], Any] | None = None) -> AsyncIterator[Services]:
    async with contextlib.AsyncExitStack() as stack:
        capture = Capture(settings, producer_factory or bus_producer_factory(settings), metrics.registry)
        capture.start()
        stack.callback(capture.close, settings.gateway.drain_timeout_s)

        db = await asyncio.to_thread(open_database, settings.database_url, settings.db.wait_s)
        stack.callback(db.dispose)
        sessions = make_session_factory(db)
        state = make_state(settings)
        stack.push_async_callback(state.close)
        keys = KeyStore(sessions, settings.gateway.key_cache_s) if settings.gateway.auth == "on" else None
        ownership = Ownership(state, sessions, settings.gateway.ownership_ttl_s)
        live = make_live(settings)
        stack.callback(live.close)
        router = Router(settings, sessions, live, state.get_pins)
        stack.push_async_callback(router.close)
        http = Pool(settings.gateway.upstream_timeout_s)
        stack.callback(http.close)

        user_secret = await asyncio.to_thread(load_secret, settings.gateway.user_id_secret, settings.data_path)
        completions = CompletionServing(settings, metrics, capture, state, router, http, user_secret)
        feedback = FeedbackServing(settings, state, ownership, completions.submit, metrics)
        data = DataServing(settings, sessions, user_secret)
        data.start()
        stack.callback(data.close)
        yield Services(settings, metrics, capture, state, sessions, router, Access(settings.gateway, keys, state),
                       completions, feedback, data)
