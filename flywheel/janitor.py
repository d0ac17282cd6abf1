"""The ``janitor`` role: periodic housekeeping of stored data, every ``retention.interval_s``.

Each turn runs :func:`tasks` in order, then waits, beating (``flywheel health janitor``):

1. ``erasure_resume``: completes the erasures still pending :data:`flywheel.erasure.STALE_AFTER`
   after their request (the gateway or CLI that took them died; flywheel/erasure.py, step 3);
   also every :data:`ERASURES_EVERY_S` while the janitor waits, so an erasure left pending by a
   crash is done minutes after it went stale, not at the next turn;
2. ``erasure_sweep``: deletes what a stage stored of an erased subject after its erasure was done
   (:func:`flywheel.erasure.sweep`);
3. ``retention``: the database's retention job (flywheel/retention.py), each tenant's policy;
4. ``bus_retention``: on the embedded bus, the expired segments of the local log are sealed and
   erased (:meth:`flywheel.bus.locallog.LocalLogBus.expire`; a Kafka broker expires its own
   segments by the topics' ``retention.ms``).

Erasures go first: a person's request does not wait for, or fail with, the retention job.

More periodic tasks join :func:`tasks` (one ``(name, callable)`` pair each). Errors
propagate: the process ends and its supervisor restarts it, as for every other worker; a task that
a crash interrupted starts over, since each is idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flywheel.health import Beat

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from flywheel.bus import Bus
    from flywheel.settings import Settings

log = logging.getLogger(__name__)

#: The longest wait between two beats while the janitor sleeps.
BEAT_EVERY_S = 5.0
#: Seconds between two looks for stale pending erasures while the janitor waits for its next turn.
ERASURES_EVERY_S = 60.0


def tasks(settings: Settings, sessions: sessionmaker[Session], bus: Bus | None,
          beat: Callable[[], object] | None = None) -> list[tuple[str, Callable[[], Any]]]:
    """The janitor's periodic tasks, in the order each turn runs them (module docstring); ``beat``
    is called while a long one works."""
    from flywheel import erasure, retention

    out: list[tuple[str, Callable[[], Any]]] = [
        ("erasure_resume", lambda: [o.erasure_id for o in erasure.resume(sessions, erasure.STALE_AFTER)]),
        ("erasure_sweep", lambda: erasure.sweep(sessions)),
        ("retention", lambda: retention.run_once(settings.tenants, sessions, batch=settings.retention.batch,
                                                 rest=settings.retention.rest, progress=beat)),
    ]
    expire = getattr(bus, "expire", None)
    if expire is not None:
        out.append(("bus_retention", lambda: expire(settings.bus.retention_hours * 3600)))
    return out


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Run :func:`tasks` every ``retention.interval_s`` until ``stop`` is set."""
    from flywheel.bus import make_bus
    from flywheel.db.session import make_session_factory, open_database

    stop = stop or threading.Event()
    engine = open_database(settings.database_url, settings.db.wait_s)
    bus = make_bus(settings)
    heartbeat = Beat(settings, "janitor")
    try:
        sessions = make_session_factory(engine)
        turns = tasks(settings, sessions, bus, heartbeat.beat)
        resume = dict(turns)["erasure_resume"]
        while not stop.is_set():
            for name, task in turns:
                heartbeat.beat()
                started = time.monotonic()
                result = task()
                log.info("janitor: %s done in %.1f s: %s", name, time.monotonic() - started,
                         getattr(result, "as_json", lambda r=result: r)())
            due = time.monotonic() + settings.retention.interval_s
            look = time.monotonic() + ERASURES_EVERY_S
            while not stop.wait(max(0.0, min(BEAT_EVERY_S, due - time.monotonic()))) and time.monotonic() < due:
                heartbeat.beat()
                if time.monotonic() >= look:
                    look = time.monotonic() + ERASURES_EVERY_S
                    if done := resume():
                        log.info("janitor: completed stale erasures %s", done)
    finally:
        heartbeat.close()
        bus.close()
        engine.dispose()
