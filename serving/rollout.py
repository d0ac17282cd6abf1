"""The rollout controller: on a schedule, decide which version becomes stable, and apply it.

:func:`decide` is the pure policy: the newest ``candidate`` newer than the current stable version
(or any candidate when nothing is stable yet). Gates (held-out metrics, canary results) plug in
later as predicates a candidate must pass before :func:`decide` may pick it — see ``gates``.
:func:`run` is the IO loop: every ``rollout.interval_s`` read the registry, decide, and promote via
``Registry.set_status(v, "stable", ...)`` (the registry retires the previous stable and audits it),
then announce it as a :class:`~flywheel.events.VersionEvent` on the ``versions`` topic.

Invariants: a decision never moves stable backwards (rollbacks are explicit and come with
canaries); one promotion per tick; the registry is the only state.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

from flywheel.events import VersionEvent
from flywheel.settings import Settings

log = logging.getLogger(__name__)

#: A gate says whether a candidate may be promoted (True) given all versions; none exist yet.
Gate = Callable[[Any, Sequence[Any]], bool]


def decide(versions: Sequence[Any], gates: Sequence[Gate] = ()) -> int | None:
    """The version to promote to stable now, or None.

    ``versions`` are ``VersionInfo``-like objects with ``version`` and ``status``.
    """
    stable = [v.version for v in versions if v.status == "stable"]
    floor = max(stable) if stable else -1
    candidates = sorted(
        (v for v in versions if v.status == "candidate" and v.version > floor),
        key=lambda v: v.version,
        reverse=True,
    )
    for candidate in candidates:
        if all(gate(candidate, versions) for gate in gates):
            return candidate.version
    return None


def version_event(info: Any) -> VersionEvent:
    """The wire notice of a version's new status (``session_id`` is the model line: its bus key)."""
    return VersionEvent(
        tenant="_system", session_id=info.model_line, model_line=info.model_line, version=info.version,
        kind=info.kind, parent=info.parent, sha256=info.sha256, status=info.status, bytes=info.bytes,
        full_bytes=info.full_bytes,
    )


def tick(registry: Any, notify: Callable[[VersionEvent], None] | None = None) -> int | None:
    """One rollout decision applied to ``registry``; returns the promoted version, if any.

    ``notify`` receives a :class:`VersionEvent` for the promotion (``run`` sends it to the bus).
    """
    version = decide(registry.versions())
    if version is not None:
        registry.set_status(version, "stable", reason="rollout: newest candidate")
        log.info("rollout: version %d is now stable", version)
        if notify is not None:
            notify(version_event(registry.get(version)))
    return version


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Promote on schedule until ``stop`` is set."""
    from flywheel.bus import make_bus
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    db = open_database(settings.database_url, settings.db.wait_s)
    registry = Registry(make_session_factory(db), make_store(settings), settings.model.line)
    bus = make_bus(settings)
    topic = settings.topic(VersionEvent.topic)
    bus.ensure_topics([topic])
    producer = bus.producer()

    def notify(event: VersionEvent) -> None:
        producer.send(topic, event.session_id, event.to_bytes())
        producer.flush()

    stop = stop or threading.Event()
    try:
        while not stop.is_set():
            tick(registry, notify)
            stop.wait(settings.rollout.interval_s)
    finally:
        producer.close()
        bus.close()
        db.dispose()
