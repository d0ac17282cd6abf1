"""The bus interface every backend implements (Kafka, embedded local log).

Semantics both backends guarantee, checked by one conformance suite (tests/integration/test_bus.py):
- ``Producer.send`` appends to a partition chosen by hashing the key, so one key's records keep
  their order; every record sent is durable when a later ``flush`` returns without raising (a
  backend may make it durable sooner). ``flush(timeout_s)`` raises :class:`BusError` rather than
  wait past ``timeout_s``; a producer whose flush failed is closed and replaced, not reused.
- A consumer group reads each partition in order and resumes from its last *committed* offset after
  a restart; records polled but not committed are delivered again (at-least-once).
- ``commit`` is called by the application only after a record is durably processed.
- ``dead_letter`` writes the raw record to ``<topic>.dlq`` with the reason and its origin, so a bad
  record never blocks its good neighbours.
- The partition of a key is ``murmur2(utf-8 key) & 0x7fffffff % partitions``, Kafka's default
  partitioner, so one key lands on the same partition number on either backend.
- Within a group a partition is owned by at most one live consumer; ownership moves only inside
  ``poll`` (the application has committed what it processed by then). A ``commit`` for a partition
  this consumer no longer owns is skipped with a warning: those records are redelivered to the new
  owner, which is the at-least-once contract, never a loss.
- ``rewind`` puts every owned partition back at its last committed offset without leaving the
  group: the next ``poll`` returns what a restart would read (the uncommitted records again, in
  order). A worker that dropped its in-memory state (a database outage) resumes crash-equivalently
  while keeping its partitions, with no rebalance.
- ``lag(group, topics)`` counts, per topic, the records the group has not committed: the sum over
  partitions of the log end offset minus the committed offset (or minus the partition's earliest
  offset where the group committed nothing, where its consumer would start). It only reads
  offsets: it joins no group, moves no partition and commits nothing, so the group's members go on
  as if it had not been called. It reads the committed offsets before the ends, so a commit racing
  it never makes a lag negative. :func:`stage_lags` asks it for every consuming stage.
- A ``Consumer`` belongs to one thread; a ``Producer`` too.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from flywheel.settings import STAGE_TOPICS

if TYPE_CHECKING:
    from flywheel.settings import Settings


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
        """Append one record; durable at the latest when the next ``flush`` returns."""

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every record sent so far is durable; raise :class:`BusError` if one failed
        or ``timeout_s`` passed first."""

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (within ``timeout_s``), then release the producer; raises like ``flush``."""


class Consumer(Protocol):
    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Record]:
        """Return up to ``max_records`` new records (possibly none after ``timeout_s``)."""

    def commit(self, records: Sequence[Record]) -> None:
        """Mark ``records`` (and everything before them on their partitions) processed."""

    def dead_letter(self, record: Record, reason: str) -> None:
        """Route an unprocessable record to ``<topic>.dlq`` with ``reason``; the caller still commits it.

        Durable when this returns (the caller commits the record right after)."""

    def assignment(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs this consumer owns right now (changes only in ``poll``)."""

    def rewind(self) -> None:
        """The next ``poll`` returns records from each owned partition's last committed offset again
        (what a restart would read, from the start where nothing was committed); membership and
        ownership are kept (no rebalance). Raises :class:`BusError` if the committed offsets cannot
        be read."""

    def caught_up(self, topic: str, partition: int) -> bool:
        """True when ``poll`` has returned every record the partition held, as last known (Kafka:
        the high watermark of the latest fetch); False when records wait, or when not known yet
        (no fetch so far, or the partition is not owned)."""

    def close(self) -> None: ...


class Bus(Protocol):
    def ensure_topics(self, topics: Sequence[str]) -> None: ...

    def producer(self, *, timeout_s: float | None = None) -> Producer:
        """A new producer. ``timeout_s`` bounds every wait on an unreachable backend (creating the
        producer, ``send`` waiting for metadata); None keeps the backend's defaults."""

    def consumer(self, group: str, topics: Sequence[str], client_id: str | None = None) -> Consumer: ...

    def lag(self, group: str, topics: Sequence[str]) -> dict[str, int]:
        """Per topic, the records ``group`` has not committed yet: the sum over the topic's partitions
        of (log end offset - committed offset), from the partition's earliest offset where nothing
        was committed. Joins no group and commits nothing. A topic that does not exist counts 0.
        Raises :class:`BusError` when the backend cannot answer (broker unreachable, corrupt log)."""

    def close(self) -> None: ...


class BusError(Exception):
    """A backend failure the caller should not paper over (broker error, corrupt log)."""


#: Errors that mean "this record cannot be decoded or applied" when a consumer processes one record:
#: a worker dead-letters the record and goes on (the database's own refusals, ``DataError`` and
#: ``IntegrityError``, join these in the workers). Outages and backend failures are not among them,
#: nor ``TypeError``: records are validated before they are applied, so one is a bug in the code,
#: which must stop the worker rather than dead-letter every record it meets.
BAD_RECORD: tuple[type[Exception], ...] = (
    ValueError, KeyError, IndexError, ArithmeticError, RecursionError, UnicodeError,
)


def route_to_dlq(consumer: Consumer, record: Record, reason: str, counters: MutableMapping[str, int],
                 log: logging.Logger) -> None:
    """What every worker does with a record it cannot decode or apply: ``dead_letter`` it with
    ``reason`` (at most 1,000 characters), count it in ``counters["dead_lettered"]`` and log it; the
    caller still commits it."""
    reason = reason[:1000]
    consumer.dead_letter(record, reason)
    counters["dead_lettered"] = counters.get("dead_lettered", 0) + 1
    log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason[:200])


def stage_lags(bus: Bus, settings: Settings) -> dict[str, dict[str, int]]:
    """The bus lag of each consuming stage (``ingest``, ``rewards``, ``trainer``): ``Bus.lag`` of its
    group (``Settings.group``) on the topics it reads (``Settings.stage_topics``), keyed by full topic
    name. Raises :class:`BusError` when the bus cannot answer (show the lag as unknown)."""
    return {stage: bus.lag(settings.group(stage), settings.stage_topics(stage)) for stage in STAGE_TOPICS}


def stay_in_group(consumer: Consumer) -> None:
    """Poll once, briefly, so the consumer stays in its group while its application cannot process
    anything (Kafka evicts a member that does not poll within ``max_poll_interval_ms``); the record
    it may return is dropped, so call ``rewind`` before processing resumes."""
    consumer.poll(timeout_s=0.1, max_records=1)


def dlq_topic(topic: str) -> str:
    return f"{topic}.dlq"


#: Headers added by ``dead_letter`` (the record's own headers are kept beside them).
DLQ_REASON = "dlq.reason"
DLQ_ORIGIN_TOPIC = "dlq.origin_topic"
DLQ_ORIGIN_PARTITION = "dlq.origin_partition"
DLQ_ORIGIN_OFFSET = "dlq.origin_offset"


def dead_letter_headers(record: Record, reason: str) -> dict[str, str]:
    """The headers of ``record``'s dead letter: its own headers plus reason and origin."""
    return {
        **record.headers,
        DLQ_REASON: reason,
        DLQ_ORIGIN_TOPIC: record.topic,
        DLQ_ORIGIN_PARTITION: str(record.partition),
        DLQ_ORIGIN_OFFSET: str(record.offset),
    }


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), unsigned 32-bit result."""
    m = 0x5BD1E995
    length = len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = length % 4
    if tail >= 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for_key(key: str, partitions: int) -> int:
    """Kafka's default partitioner for a non-null key: ``murmur2(key) & 0x7fffffff % partitions``."""
    return (murmur2(key.encode("utf-8")) & 0x7FFFFFFF) % partitions
