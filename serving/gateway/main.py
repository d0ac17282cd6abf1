"""Entry point of the gateway role: build the app, serve until SIGTERM/SIGINT (or ``stop``), drain.

Shutdown order (SIGTERM): uvicorn stops accepting connections, closes idle keep-alive ones and lets
in-flight requests finish (streams included) for up to ``gateway.drain_timeout_s``; then the app's
lifespan closes the capture, which ships what the bus takes within ``gateway.drain_timeout_s`` and
``fsync``s the rest of the spool for the next start (``serving/gateway/shipper.py``). No response is released without its event in
the spool, so nothing a client received is lost however shutdown goes, kill -9 included.

The bus producer is made by the capture's shipper thread, not here: a bus that is down at start-up
does not stop the gateway from serving (events wait in the spool).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

from flywheel.settings import Settings, redact_url
from serving.server import serve

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
GC_THRESHOLDS = (10_000, 20, 100)


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Serve the gateway on ``settings.gateway.host:port`` until ``stop`` is set (or SIGINT/SIGTERM)."""
    from serving.gateway.app import create_app

    # The spool's shipper and fsync threads share the GIL with the event loop; at the default 5 ms
    # switch interval a request whose syscall released the GIL can wait that long to get it back.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(settings)
    # Requests make short-lived garbage; a full collection that walks every long-lived object
    # (modules, settings, pydantic schemas) stalls the event loop for tens of ms at p99. Freeze
    # what exists now and collect the young generation less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    gateway = settings.gateway
    log.info("gateway %s on %s:%d -> %s", gateway.gateway_id, gateway.host, gateway.port,
             redact_url(gateway.upstream) if gateway.upstream else "the fleet's nodes")
    serve(app, host=gateway.host, port=gateway.port, stop=stop, log_level=settings.log_level,
          graceful_timeout_s=gateway.drain_timeout_s, header_timeout_s=gateway.header_read_timeout_s,
          max_head_bytes=gateway.max_header_bytes)
