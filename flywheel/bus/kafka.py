"""The production bus: Apache Kafka (or any Kafka-protocol broker) through kafka-python 3.x.

Semantics, matching ``flywheel.bus.base``:

- Producer: idempotent (``enable_idempotence=True``), ``acks="all"``, compression from settings.
  ``send`` only enqueues (it returns before the broker has the record); ``flush`` blocks until every
  record sent so far is acknowledged by all in-sync replicas and raises :class:`BusError` if any of
  them failed. A record is durable when ``flush`` returns without raising. A failure that is
  already known when ``send`` is called is raised by that ``send`` too, so errors are never lost
  by a caller that forgets to flush. Keys are UTF-8 bytes, so Kafka's default partitioner (murmur2)
  places a key on the same partition number as the local log does.
- A dead or unreachable broker never makes a producer hang: ``producer(timeout_s=T)`` bounds
  creating it (bootstrap), a ``send`` waiting for topic metadata, and each request by ``T``;
  ``flush(timeout_s)`` raises :class:`BusError` when ``timeout_s`` passes. A producer whose flush
  failed is closed (``close(0)`` abandons what is unacknowledged) and replaced by a new one, so a
  broker that comes back is met by fresh connections, not by a client deep in reconnect backoff.
- Consumer: ``enable_auto_commit=False``, ``auto_offset_reset="earliest"``; ``commit`` commits
  ``last offset + 1`` per partition synchronously. Partitions this consumer no longer owns after
  a rebalance are skipped with a warning, and a commit the group coordinator rejects because a
  rebalance is under way is logged the same way: those records are redelivered to the new owner
  (at-least-once), never lost.
- ``rewind`` seeks every assigned partition to its committed offset (``committed``, read from the
  group coordinator), or to the beginning where none was committed (``auto_offset_reset``
  "earliest", as a restart would); records already fetched past it are dropped by the client.
  The consumer stays in its group: no LeaveGroup, no rebalance.
- ``dead_letter`` produces the raw record to ``<topic>.dlq`` (created on first use) and waits
  for the acknowledgement before returning.
- ``ensure_topics`` creates missing topics with the bus's partition count and, when the bus has a
  retention (``bus.retention_hours``), the topic configs ``retention.ms`` (the broker deletes a
  segment once its newest record is that old) and ``segment.ms`` (a quarter of it, at most a day:
  a segment rolls within that time, so no record outlives the retention by more than one
  segment's age); existing topics are left as they are (``kafka-configs --alter`` changes them).
- ``lag`` reads offsets and joins no group: through the bus's admin client, the topics' partitions
  (metadata), the group's committed offsets (OffsetFetch at the group coordinator), each
  partition's earliest and latest offsets (ListOffsets); then the log end offset (high watermark)
  from one fetch at that latest offset by a consumer without a group (manual assignment, nothing
  committed). The fetch is there because some Kafka-protocol brokers answer ListOffsets "latest"
  with less than the high watermark (Tansu 0.6, the test broker, gives the last batch's base offset
  + 1); on Apache Kafka it only confirms. Both clients are created on first use, kept by the bus and
  closed by ``close`` (the consumer is replaced after a failure). A committed offset below the
  earliest one (records deleted by retention) counts from the earliest, where the group's consumer
  resumes. Each request, the clients' first connection and the wait for the fetch are bounded by
  ``admin_timeout_ms`` (``ADMIN_REQUEST_TIMEOUT_MS`` by default); a Kafka error becomes
  :class:`BusError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, OffsetSpec, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import (
    CommitFailedError,
    KafkaError,
    KafkaTimeoutError,
    RebalanceInProgressError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)
from kafka.future import Future
from kafka.structs import OffsetAndMetadata

from flywheel.bus.base import BusError, Record, dead_letter_headers, dlq_topic

log = logging.getLogger(__name__)

#: The longest ``rewind`` waits for the group coordinator to answer one committed-offset fetch.
COMMITTED_TIMEOUT_MS = 30_000
#: The longest the admin client (``ensure_topics``, ``lag``) waits for one broker request, and for
#: its first connection to the cluster, unless the bus is given ``admin_timeout_ms``.
ADMIN_REQUEST_TIMEOUT_MS = 30_000
#: The longest ``segment.ms`` a topic is created with (a day).
SEGMENT_MS_MAX = 24 * 3600 * 1000


def _decode(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("utf-8", errors="replace")


class KafkaBus:
    def __init__(
        self,
        bootstrap_servers: str,
        partitions: int = 4,
        *,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 1_000,
        max_poll_interval_ms: int = 300_000,
        fetch_max_wait_ms: int = 100,
        compression: str = "lz4",
        replication_factor: int = 1,
        client_id: str = "flywheel",
        admin_timeout_ms: int = ADMIN_REQUEST_TIMEOUT_MS,
        retention_ms: int | None = None,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.partitions = partitions
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.max_poll_interval_ms = max_poll_interval_ms
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.compression = None if compression == "none" else compression
        self.replication_factor = replication_factor
        self.client_id = client_id
        self.admin_timeout_ms = admin_timeout_ms
        self.retention_ms = retention_ms
        self._admin: KafkaAdminClient | None = None
        self._ends: KafkaConsumer | None = None  # group-less, reads high watermarks for ``lag``
        self._ends_lock = threading.Lock()
        self._known_topics: set[str] = set()

    def _admin_client(self) -> KafkaAdminClient:
        if self._admin is None:
            self._admin = KafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                client_id=f"{self.client_id}-admin",
                request_timeout_ms=self.admin_timeout_ms,
                bootstrap_timeout_ms=self.admin_timeout_ms,
            )
        return self._admin

    def ensure_topics(self, topics: Sequence[str]) -> None:
        admin = self._admin_client()
        for topic in topics:
            if topic in self._known_topics:
                continue
            try:
                admin.create_topics([NewTopic(topic, self.partitions, self.replication_factor,
                                              topic_configs=self.topic_configs())])
            except TopicAlreadyExistsError:
                pass  # the goal state: it exists (with whatever count it was created with)
            self._known_topics.add(topic)

    def topic_configs(self) -> dict[str, str]:
        """The configs a new topic is created with (module docstring): its retention, if any."""
        if self.retention_ms is None:
            return {}
        segment_ms = max(1, min(self.retention_ms // 4, SEGMENT_MS_MAX))
        return {"retention.ms": str(self.retention_ms), "segment.ms": str(segment_ms)}

    def producer(self, *, timeout_s: float | None = None) -> KafkaBusProducer:
        """An idempotent, acks=all producer; see the module docstring for ``timeout_s``."""
        bounds: dict[str, int] = {}
        if timeout_s is not None:
            ms = max(1, int(timeout_s * 1000))
            request_ms = min(30_000, max(1_000, ms))
            bounds = {
                "bootstrap_timeout_ms": ms,
                "max_block_ms": ms,
                "request_timeout_ms": request_ms,
                "delivery_timeout_ms": max(120_000, request_ms),
                "reconnect_backoff_max_ms": 1_000,
            }
        try:
            producer = KafkaProducer(
                bootstrap_servers=self.bootstrap_servers,
                client_id=f"{self.client_id}-producer",
                enable_idempotence=True,
                acks="all",
                compression_type=self.compression,
                **bounds,
            )
        except KafkaError as exc:
            raise BusError(f"cannot create a producer for {self.bootstrap_servers}: {exc}") from exc
        return KafkaBusProducer(producer)

    def consumer(self, group: str, topics: Sequence[str], client_id: str | None = None) -> KafkaBusConsumer:
        if not topics:
            raise ValueError("subscribe to at least one topic")
        consumer = KafkaConsumer(
            *topics,
            bootstrap_servers=self.bootstrap_servers,
            client_id=client_id or f"{self.client_id}-{group}",
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            max_poll_interval_ms=self.max_poll_interval_ms,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
        )
        return KafkaBusConsumer(self, consumer)

    def lag(self, group: str, topics: Sequence[str]) -> dict[str, int]:
        """Per topic, the records ``group`` has not committed (see the module docstring)."""
        names = list(dict.fromkeys(topics))
        try:
            admin = self._admin_client()
            partitions = self._partitions(admin, names)
            if not partitions:
                return dict.fromkeys(names, 0)
            fetched = admin.list_group_offsets({group: partitions}).get(group, {})
            committed = {tp: meta.offset for tp, meta in fetched.items() if meta.offset >= 0}
            earliest = admin.list_partition_offsets(dict.fromkeys(partitions, OffsetSpec.EARLIEST))
            latest = admin.list_partition_offsets(dict.fromkeys(partitions, OffsetSpec.LATEST))
            ends = self._high_watermarks({tp: latest[tp].offset for tp in partitions})
        except KafkaError as exc:
            raise BusError(f"cannot read the lag of group {group!r} on {names}: {exc}") from exc
        out = dict.fromkeys(names, 0)
        for tp in partitions:
            start = max(committed.get(tp, 0), earliest[tp].offset)
            out[tp.topic] += max(0, ends[tp] - start)
        return out

    def _high_watermarks(self, latest: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Each partition's high watermark, from one fetch at ``latest`` (at most one batch comes back)."""
        with self._ends_lock:
            if self._ends is None:
                self._ends = KafkaConsumer(
                    bootstrap_servers=self.bootstrap_servers,
                    client_id=f"{self.client_id}-lag",
                    group_id=None,
                    enable_auto_commit=False,
                    fetch_max_wait_ms=10,  # answer soon where no record waits (with 0, no fetch completes on Tansu 0.6)
                    max_partition_fetch_bytes=64 * 1024,
                    request_timeout_ms=self.admin_timeout_ms,
                    bootstrap_timeout_ms=self.admin_timeout_ms,
                )
            consumer = self._ends
            try:
                consumer.assign(list(latest))  # a fresh state per partition: no high watermark yet
                for tp, offset in latest.items():
                    consumer.seek(tp, offset)
                deadline = time.monotonic() + self.admin_timeout_ms / 1000
                while any(consumer.highwater(tp) is None for tp in latest):
                    if time.monotonic() >= deadline:
                        raise KafkaTimeoutError(f"no fetch answered within {self.admin_timeout_ms} ms")
                    consumer.poll(timeout_ms=100, max_records=1)
                return {tp: max(offset, consumer.highwater(tp)) for tp, offset in latest.items()}
            except BaseException:
                self._ends = None
                consumer.close(autocommit=False)
                raise
            finally:
                if self._ends is not None:
                    consumer.assign([])  # holds no partition between calls: nothing fetched, nothing buffered

    @staticmethod
    def _partitions(admin: KafkaAdminClient, topics: list[str]) -> list[TopicPartition]:
        """Every partition of ``topics`` (none for a topic the cluster does not know)."""
        if not topics:
            return []
        out = []
        for meta in admin.describe_topics(topics):
            if meta["error_code"] == UnknownTopicOrPartitionError.errno:
                continue
            if meta["error_code"]:
                raise BusError(f"cannot describe topic {meta['name']!r}: error code {meta['error_code']}")
            out.extend(TopicPartition(meta["name"], p["partition_index"]) for p in meta["partitions"])
        return sorted(out, key=lambda tp: (tp.topic, tp.partition))

    def close(self) -> None:
        with self._ends_lock:
            if self._ends is not None:
                self._ends.close(autocommit=False)
                self._ends = None
        if self._admin is not None:
            self._admin.close()
            self._admin = None


class KafkaBusProducer:
    """``send`` enqueues; ``flush`` waits for every acknowledgement (see the module docstring)."""

    def __init__(self, producer: KafkaProducer) -> None:
        self._producer = producer
        self._pending: list[Future] = []

    def send(self, topic: str, key: str | None, value: bytes, headers: dict[str, str] | None = None) -> None:
        self._raise_failures(done_only=True)
        try:
            future = self._producer.send(
                topic,
                key=None if key is None else key.encode("utf-8"),
                value=bytes(value),
                headers=[(k, v.encode("utf-8")) for k, v in (headers or {}).items()],
            )
        except KafkaError as exc:
            raise BusError(f"cannot send to {topic}: {exc}") from exc
        self._pending.append(future)

    def flush(self, timeout_s: float | None = None) -> None:
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise BusError(f"flush did not complete: {exc}") from exc
        self._raise_failures(done_only=False)

    def _raise_failures(self, *, done_only: bool) -> None:
        failures = []
        still = []
        for future in self._pending:
            if not future.is_done:
                still.append(future)
            elif future.failed():
                failures.append(future.exception)
        if not done_only and still:
            failures.append(BusError(f"{len(still)} record(s) not acknowledged"))
            still = []
        self._pending = still
        if failures:
            raise BusError(f"{len(failures)} record(s) failed: {failures[0]!r}") from failures[0]

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (raising :class:`BusError` if records failed or ``timeout_s`` passed), then close.

        Records still unacknowledged after a failed flush are abandoned: the sender is
        force-closed rather than left retrying in the background.
        """
        flushed = False
        try:
            self.flush(timeout_s)
            flushed = True
        finally:
            if flushed:
                self._producer.close()
            else:
                self._abandon()

    def _abandon(self) -> None:
        log.warning("closing a Kafka producer after a failed flush; unacknowledged records are abandoned")
        self._pending = []
        try:
            self._producer.close(timeout=0)
        except KafkaTimeoutError:
            # kafka-python's close(0) flushes first and raises while records are pending, before
            # it force-closes the sender thread; finish its job so the thread does not linger.
            self._producer._sender.force_close()


class KafkaBusConsumer:
    def __init__(self, bus: KafkaBus, consumer: KafkaConsumer) -> None:
        self._bus = bus
        self._consumer = consumer
        self._dlq: KafkaBusProducer | None = None

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def caught_up(self, topic: str, partition: int) -> bool:
        # kafka-python's public position() may block on a committed-offset fetch; the subscription
        # state holds the same position (next record poll returns) and the latest high watermark.
        state = self._consumer._subscription.assignment.get(TopicPartition(topic, partition))
        if state is None or state.highwater is None or state.position is None:
            return False
        return state.position.offset >= state.highwater

    def rewind(self) -> None:
        owned = sorted(self._consumer.assignment(), key=lambda t: (t.topic, t.partition))
        try:
            for tp in owned:
                offset = self._consumer.committed(tp, timeout_ms=COMMITTED_TIMEOUT_MS)
                if offset is None:
                    self._consumer.seek_to_beginning(tp)
                else:
                    self._consumer.seek(tp, offset)
        except KafkaError as exc:
            raise BusError(f"cannot rewind to the committed offsets: {exc}") from exc

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out = []
        for tp in sorted(batches, key=lambda t: (t.topic, t.partition)):
            for msg in batches[tp]:
                headers = {k: _decode(v) or "" for k, v in (msg.headers or [])}
                out.append(Record(msg.topic, msg.partition, msg.offset, _decode(msg.key), msg.value, headers))
        return out

    def commit(self, records: Sequence[Record]) -> None:
        last: dict[TopicPartition, int] = {}
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            last[tp] = max(last.get(tp, -1), record.offset)
        if not last:
            return
        owned = self._consumer.assignment()
        offsets = {}
        for tp, offset in last.items():
            if tp in owned:
                offsets[tp] = OffsetAndMetadata(offset + 1, "", -1)
            else:
                log.warning("not committing %s offset %d: partition no longer owned (redelivered)", tp, offset)
        if not offsets:
            return
        try:
            self._consumer.commit(offsets)
        except (CommitFailedError, RebalanceInProgressError) as exc:
            log.warning("commit rejected by the group (%s); these records will be redelivered", exc)

    def dead_letter(self, record: Record, reason: str) -> None:
        topic = dlq_topic(record.topic)
        self._bus.ensure_topics([topic])
        if self._dlq is None:
            self._dlq = self._bus.producer()
        self._dlq.send(topic, record.key, record.value, dead_letter_headers(record, reason))
        self._dlq.flush()

    def close(self) -> None:
        try:
            if self._dlq is not None:
                self._dlq.close()
        finally:
            self._consumer.close(autocommit=False)
