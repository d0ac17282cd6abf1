"""The event bus: one interface (``base``), two backends, chosen by ``settings.bus.kind``.

``local`` is the embedded durable log under ``settings.bus_log_path`` (no set-up, shared by the
processes of one machine); ``kafka`` is any Kafka-protocol cluster at
``settings.bus.bootstrap_servers``. The backend modules are imported only when chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flywheel.bus.base import (
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    DLQ_REASON,
    Bus,
    BusError,
    Consumer,
    Producer,
    Record,
    dlq_topic,
    partition_for_key,
)

if TYPE_CHECKING:
    from flywheel.settings import Settings

__all__ = [
    "Bus",
    "BusError",
    "Consumer",
    "DLQ_ORIGIN_OFFSET",
    "DLQ_ORIGIN_PARTITION",
    "DLQ_ORIGIN_TOPIC",
    "DLQ_REASON",
    "Producer",
    "Record",
    "dlq_topic",
    "make_bus",
    "partition_for_key",
]


def make_bus(settings: Settings) -> Bus:
    """The bus ``settings`` asks for (``settings.bus.kind``)."""
    bus = settings.bus
    if bus.kind == "local":
        from flywheel.bus.locallog import LocalLogBus

        return LocalLogBus(settings.bus_log_path, bus.partitions, retention_s=bus.retention_hours * 3600)
    if bus.kind == "kafka":
        from flywheel.bus.kafka import KafkaBus

        return KafkaBus(
            bootstrap_servers=bus.bootstrap_servers,
            partitions=bus.partitions,
            session_timeout_ms=bus.session_timeout_ms,
            heartbeat_interval_ms=bus.heartbeat_interval_ms,
            max_poll_interval_ms=bus.max_poll_interval_ms,
            fetch_max_wait_ms=bus.fetch_max_wait_ms,
            compression=bus.compression,
            retention_ms=int(bus.retention_hours * 3_600_000),
        )
    raise ValueError(f"unknown bus kind {bus.kind!r}")
