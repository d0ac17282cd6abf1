"""The bus interface every backend implements (Kafka, embedded local log).

Semantics both backends guarantee, checked by one conformance suite (tests/integration/test_bus.py):
- ``Producer.send`` appends to a partition chosen by hashing the key, so one key's records keep
  their order; when ``send`` (or ``flush``) returns, the record is durable.
- A consumer group reads each partition in order and resumes from its last *committed* offset after
  a restart; records polled but not committed are delivered again (at-least-once).
- ``commit`` is called by the application only after a record is durably processed.
- ``dead_letter`` writes the raw record to ``<topic>.dlq`` with the reason and its origin, so a bad
  record never blocks its good neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes
    headers: dict[str, str] = field(default_factory=dict)


class Producer(Protocol):
    def send(self, topic: str, key: str, value: bytes, headers: dict[str, str] | None = None) -> None:
        """Append one record; durable when this returns (or at the latest when ``flush`` returns)."""

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


class Consumer(Protocol):
    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Record]:
        """Return up to ``max_records`` new records (possibly none after ``timeout_s``)."""

    def commit(self, records: Sequence[Record]) -> None:
        """Mark ``records`` (and everything before them on their partitions) processed."""

    def dead_letter(self, record: Record, reason: str) -> None:
        """Route an unprocessable record to ``<topic>.dlq`` with ``reason``; the caller still commits it."""

    def close(self) -> None: ...


class Bus(Protocol):
    def ensure_topics(self, topics: Sequence[str]) -> None: ...

    def producer(self) -> Producer: ...

    def consumer(self, group: str, topics: Sequence[str], client_id: str | None = None) -> Consumer: ...

    def close(self) -> None: ...


def dlq_topic(topic: str) -> str:
    return f"{topic}.dlq"
