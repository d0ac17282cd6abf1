"""Entry point of the gateway role: build the bus producer and HTTP client, serve until stopped.

Invariant: the producer is flushed and closed however serving ends (the app closes its HTTP client).
"""

from __future__ import annotations

import logging
import threading

import httpx

from flywheel.settings import Settings
from serving.server import serve

log = logging.getLogger(__name__)


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Serve the gateway on ``settings.gateway.host:port`` until ``stop`` is set (or SIGINT/SIGTERM)."""
    from flywheel.bus import make_bus
    from serving.gateway.app import create_app

    bus = make_bus(settings)
    bus.ensure_topics([settings.topic("generations"), settings.topic("feedback")])
    producer = bus.producer()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    http_client = httpx.AsyncClient(limits=limits, timeout=settings.gateway.upstream_timeout_s)
    try:
        app = create_app(settings, producer, http_client)  # closes http_client at shutdown
        log.info("gateway on %s:%d -> %s", settings.gateway.host, settings.gateway.port, app.state.gateway.upstream)
        serve(app, host=settings.gateway.host, port=settings.gateway.port, stop=stop, log_level=settings.log_level)
    finally:
        producer.flush()
        producer.close()
        bus.close()
