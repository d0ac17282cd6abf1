"""Capture that never loses an event it accepted: the write-ahead spool plus the threads that make
it durable and ship it to the bus. The gateway talks to one :class:`Capture`.

Path of an event: :meth:`Capture.submit` (on the event loop) appends it to the spool
(``serving/gateway/spool.py``) with one ``write`` and returns per ``gateway.capture_ack``:
``written`` at once (survives a killed gateway), ``fsynced`` after the next group ``fsync``
(every ``spool_fsync_interval_ms``; survives a machine crash), ``bus`` after the bus acknowledged
it. Only then does the gateway release the response, so every response a client received has its
event in the spool, and the spool reaches the bus.

Shipping (one thread): records go to the bus in spool order, ``ship_batch`` at a time, each large
one compressed or split by ``flywheel.bus.envelope`` (never truncated), then one ``flush`` waits
up to ``ship_timeout_s`` for every acknowledgement; only then the spool cursor moves past them.
A failed or slow bus (a raising factory, ``send`` or ``flush``) marks ``flywheel_bus_up`` 0, drops
the producer (a new one is made for the next try), keeps every record, waits (0.1 s doubling to
5 s) and retries from the cursor, so order is kept. After a crash the spool replays from its
cursor. Delivery to the bus is therefore at-least-once: a record may be sent twice (a crash
between the acknowledgement and the cursor write, a flush that timed out after the broker had
the records); consumers dedup by ``event_id``, which is the bus contract. A record the bus
refuses for itself (e.g. a broker limit below ``max_record_bytes``) blocks the spool behind it,
loudly (bus down, errors logged, the spool fills), never silently skipped.

Spool full (unshipped bytes >= ``spool_max_bytes``) or unwritable (ENOSPC, EIO, ...):
``spool_full = "drop"``: the event is not spooled, ``submit`` returns False, the drop is counted
in ``flywheel_capture_dropped_total{reason}`` and logged at ERROR (at most every
``LOG_EVERY_S``, with counts, never the payload); ``"reject"``: :meth:`admit` raises
:class:`CaptureFull` (the gateway answers 503 before calling the upstream), and so does a
``submit`` that cannot be written. After a write error, ``admit`` refuses for
``BROKEN_RETRY_S`` before the next write is tried.

Shutdown (:meth:`close`): new submits are refused; the shipper gets until the spool is empty,
``timeout_s`` passes or a ship attempt fails (whichever comes first: no waiting on a bus that is
down), then everything is ``fsync``'d and the cursor saved; what is left is shipped at the next
start. Waiters still pending then are released as accepted: their events are durable in the spool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flywheel.bus import Producer, envelope
from flywheel.settings import Settings
from serving.gateway.spool import SEGMENT_BYTES, TOPIC_HEADER, Spool, SpoolClosed, Spooled

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
BROKEN_RETRY_S = 1.0
LOG_EVERY_S = 10.0
#: Bytes of spooled records one bus batch holds at most (at least one record).
BATCH_BYTES = 64 * 1024 * 1024
_RESERVED = envelope.RESERVED | {TOPIC_HEADER}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)

#: (topic, key, value, headers)
Item = tuple[str, str, bytes, dict[str, str]]


class CaptureFull(Exception):
    """Capture cannot accept events now (spool full or unwritable under ``reject``, or closed)."""


def bus_producer_factory(settings: Settings) -> Callable[[], Producer]:
    """Producers for the shipper, on the bus ``settings`` name. Each new one waits on an unreachable
    bus at most ``gateway.ship_timeout_s``, and makes sure the capture topics exist (after the
    producer connected, so the topic check meets a live broker)."""
    topics = [settings.topic("generations"), settings.topic("feedback")]

    def make() -> Producer:
        from flywheel.bus import make_bus

        bus = make_bus(settings)
        try:
            producer = bus.producer(timeout_s=settings.gateway.ship_timeout_s)
            try:
                bus.ensure_topics(topics)
            except BaseException:
                _abandon(producer)
                raise
            return producer
        finally:
            bus.close()

    return make


def spool_dir(settings: Settings) -> Path:
    gateway = settings.gateway
    return Path(gateway.spool_dir) if gateway.spool_dir else settings.data_path / "spool" / gateway.gateway_id


class _Metrics:
    def __init__(self, registry: CollectorRegistry, spool: Spool) -> None:
        self.spooled = Counter("flywheel_capture_spooled", "Events appended to the spool", ["topic"], registry=registry)
        self.shipped = Counter("flywheel_capture_shipped", "Events acknowledged by the bus", ["topic"],
                               registry=registry)
        self.replayed = Counter(
            "flywheel_capture_replayed", "Events shipped after a restart or a bus outage", registry=registry
        )
        self.dropped = Counter(
            "flywheel_capture_dropped", "Events not captured (spool_full=drop)", ["reason"], registry=registry
        )
        self.rejected = Counter(
            "flywheel_capture_rejected", "Events refused with CaptureFull (spool_full=reject)", ["reason"],
            registry=registry,
        )
        self.events = Gauge("flywheel_spool_events", "Events in the spool not yet acknowledged by the bus",
                            registry=registry)
        self.events.set_function(lambda: spool.events)
        self.bytes = Gauge("flywheel_spool_bytes", "Bytes in the spool not yet acknowledged by the bus",
                           registry=registry)
        self.bytes.set_function(lambda: spool.unshipped_bytes)
        self.bus_up = Gauge("flywheel_bus_up", "1 while the bus takes the spool's records (0 after a failed attempt)",
                            registry=registry)
        self.latency = Histogram(
            "flywheel_capture_ship_latency_seconds", "From spooled to acknowledged by the bus",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )


class _ErrorLog:
    """ERROR lines about refused events, at most one per ``LOG_EVERY_S``, with counts."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last = 0.0
        self.what = self.detail = ""

    def add(self, what: str, reason: str, n: int, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        self.what, self.detail = what, detail
        if time.monotonic() - self.last >= LOG_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.counts:
            summary = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
            log.error("capture %s events since the last report (%s); latest: %s", self.what, summary, self.detail)
        self.counts, self.last = {}, time.monotonic()


class Capture:
    """See the module docstring."""

    def __init__(
        self, settings: Settings, producer_factory: Callable[[], Producer], registry: CollectorRegistry
    ) -> None:
        gateway = settings.gateway
        self.settings = settings
        self.policy = gateway.spool_full
        self.ack_mode = gateway.capture_ack
        self.max_bytes = gateway.spool_max_bytes
        self._factory = producer_factory
        segment = max(64 * 1024, min(SEGMENT_BYTES, gateway.spool_max_bytes // 8))
        self.spool = Spool(spool_dir(settings), segment_bytes=segment)
        self.metrics = _Metrics(registry, self.spool)
        self._topic_counters: dict[str, Any] = {}
        self._errors = _ErrorLog()
        self._broken_until = 0.0
        self._closing = False
        self._started = False
        self.dropped = 0
        self.rejected = 0
        self.shipped = 0
        self.replayed = 0
        self.bus_up = False
        # Waiters: (end offset, loop, future), appended in offset order.
        self._waiters_lock = threading.Lock()
        self._fsync_waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[bool]]] = deque()
        self._bus_waiters: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[bool]]] = deque()
        self._ship_wake = threading.Event()
        self._sync_wake = threading.Event()
        self._stop_shipping = threading.Event()
        self._stop_syncing = threading.Event()
        self._failures = 0  # failed ship attempts, ever
        self._last_failed = False  # the latest ship attempt failed (the bus is down now)
        self._replay_until = 0
        self._shipper = threading.Thread(target=self._ship_loop, name="capture-shipper", daemon=True)
        self._syncer = threading.Thread(target=self._sync_loop, name="capture-fsync", daemon=True)

    # Lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the spool (replaying what a previous process left) and start shipping and syncing."""
        self.spool.open()
        self._replay_until = self.spool.next_offset
        if self.spool.events:
            log.info("spool %s: %d event(s) (%d bytes) left to ship from before", self.spool.dir,
                     self.spool.events, self.spool.unshipped_bytes)
        if self.spool.lost:
            self.metrics.dropped.labels(reason="lost").inc(self.spool.lost)
            self.dropped += self.spool.lost
        self._started = True
        self._shipper.start()
        self._syncer.start()

    def close(self, timeout_s: float) -> None:
        """Ship what the bus takes within ``timeout_s``, ``fsync`` the rest, stop the threads."""
        if not self._started or self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while self.spool.events > 0 and not self._last_failed and time.monotonic() < deadline:
            self._ship_wake.set()
            time.sleep(0.02)
        self._stop_shipping.set()
        self._ship_wake.set()
        self._shipper.join(max(0.1, deadline - time.monotonic()))
        if self._shipper.is_alive():
            log.warning("the capture shipper did not stop within the drain timeout; "
                        "its batch is shipped again at the next start")
        self._stop_syncing.set()
        self._sync_wake.set()
        self._syncer.join(5.0)
        try:
            self.spool.close()
        finally:
            self._errors.flush()
            self._release(self._fsync_waiters, None)
            self._release(self._bus_waiters, None)
            if self.spool.events:
                log.info("spool %s: %d event(s) left for the next start", self.spool.dir, self.spool.events)

    # The gateway's calls ------------------------------------------------------------------------

    def admit(self) -> None:
        """Raise :class:`CaptureFull` if a new request's event could not be accepted (``reject``)."""
        if self.policy != "reject":
            return
        if self._closing:
            raise CaptureFull("the gateway is shutting down")
        if self.spool.unshipped_bytes >= self.max_bytes:
            raise CaptureFull(f"the capture spool is full ({self.spool.unshipped_bytes} unshipped bytes)")
        if time.monotonic() < self._broken_until:
            raise CaptureFull("the capture spool cannot be written")

    async def submit(self, items: Sequence[Item]) -> bool:
        """Spool ``items`` in order; True once accepted per ``capture_ack``, False if dropped."""
        if self._closing or not self._started:
            raise CaptureFull("capture is not running (the gateway is starting or shutting down)")
        for item in items:
            if not _RESERVED.isdisjoint(item[3]):
                raise ValueError(f"headers {sorted(_RESERVED & set(item[3]))} are reserved for capture")
        if self.spool.unshipped_bytes >= self.max_bytes:
            return self._refuse("full", len(items), f"{self.spool.unshipped_bytes} unshipped bytes")
        try:
            end = self.spool.append(items)
        except OSError as exc:
            self._broken_until = time.monotonic() + BROKEN_RETRY_S
            return self._refuse("write_error", len(items), f"{type(exc).__name__}: {exc.strerror or exc}")
        except ValueError as exc:  # a frame over the spool's record limit
            return self._refuse("too_large", len(items), str(exc))
        except SpoolClosed:
            raise CaptureFull("capture is shutting down") from None
        self._broken_until = 0.0
        for topic, *_ in items:
            self._counter(topic).inc()
        # Wake the shipper and the syncer once this step of the event loop is done (the response
        # is written by then): their Python work would otherwise hold the GIL the request needs.
        loop = asyncio.get_running_loop()
        loop.call_soon(self._wake)
        if self.ack_mode == "written":
            return True
        future: asyncio.Future[bool] = loop.create_future()
        with self._waiters_lock:
            durable = self.spool.synced if self.ack_mode == "fsynced" else self.spool.cursor
            if durable >= end:
                return True
            (self._fsync_waiters if self.ack_mode == "fsynced" else self._bus_waiters).append((end, loop, future))
        return await future

    def _wake(self) -> None:
        self._ship_wake.set()
        self._sync_wake.set()

    def depth(self) -> dict[str, Any]:
        oldest = self.spool.oldest_ms
        events = self.spool.events
        return {
            "events": events,
            "bytes": self.spool.unshipped_bytes,
            "oldest_age_s": max(0.0, time.time() - oldest / 1000.0) if events and oldest is not None else 0.0,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "shipped": self.shipped,
            "replayed": self.replayed,
            "bus_up": self.bus_up,
            "max_bytes": self.max_bytes,
            "policy": self.policy,
        }

    # Internals ----------------------------------------------------------------------------------

    def _counter(self, topic: str) -> Any:
        counter = self._topic_counters.get(topic)
        if counter is None:
            counter = self._topic_counters[topic] = self.metrics.spooled.labels(topic=topic)
        return counter

    def _refuse(self, reason: str, n: int, detail: str) -> bool:
        if self.policy == "reject":
            self.rejected += n
            self.metrics.rejected.labels(reason=reason).inc(n)
            self._errors.add("rejected", reason, n, detail)
            raise CaptureFull(f"capture refused the event ({reason}: {detail})")
        self.dropped += n
        self.metrics.dropped.labels(reason=reason).inc(n)
        self._errors.add("DROPPED", reason, n, detail)
        return False

    def _release(self, waiters: deque, upto: int | None, error: Exception | None = None) -> None:
        """Resolve the waiters whose events end at or before ``upto`` (all of them if None)."""
        with self._waiters_lock:
            ready = []
            while waiters and (upto is None or waiters[0][0] <= upto):
                ready.append(waiters.popleft())
        for _, loop, future in ready:
            try:
                loop.call_soon_threadsafe(_settle, future, error)
            except RuntimeError:
                pass  # its loop is closed: nobody is waiting any more

    def _sync_loop(self) -> None:
        interval = self.settings.gateway.spool_fsync_interval_ms / 1000.0
        last = 0.0
        while not self._stop_syncing.is_set():
            self._sync_wake.wait()
            self._sync_wake.clear()
            pause = last + interval - time.monotonic()
            if pause > 0 and self._stop_syncing.wait(pause):
                break
            last = time.monotonic()
            try:
                durable = self.spool.sync()
            except OSError as exc:
                self._broken_until = time.monotonic() + BROKEN_RETRY_S
                log.error("spool %s: fsync failed (%s); events written since the last fsync may not survive "
                          "a machine crash", self.spool.dir, exc)
                self._release(self._fsync_waiters, None, CaptureFull(f"the capture spool could not be fsync'd: {exc}"))
                continue
            self._release(self._fsync_waiters, durable)

    def _ship_loop(self) -> None:
        gateway = self.settings.gateway
        producer: Producer | None = None
        backoff = BACKOFF_MIN_S
        try:
            while not self._stop_shipping.is_set():
                self._ship_wake.clear()
                try:
                    batch = self.spool.read(gateway.ship_batch, BATCH_BYTES)
                except SpoolClosed:
                    return
                try:
                    if producer is None:
                        producer = self._factory()
                        if not batch:  # idle: the bus answered, nothing to ship
                            self._last_failed = False
                            self._set_up(True)
                    if batch:
                        self._send(producer, batch)
                        producer.flush(timeout_s=gateway.ship_timeout_s)
                except Exception as exc:  # any failure of the bus: keep everything, back off, retry
                    self._failures += 1
                    self._last_failed = True
                    self._replay_until = self.spool.next_offset
                    self._set_up(False)
                    log.warning("bus unavailable (%s: %s); %d event(s) spooled, retrying in %.1fs",
                                type(exc).__name__, exc, self.spool.events, backoff)
                    if producer is not None:
                        _abandon(producer)
                        producer = None
                    self.spool.rewind()
                    self._stop_shipping.wait(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
                backoff = BACKOFF_MIN_S
                if not batch:
                    self._ship_wake.wait(0.5)
                    continue
                self._last_failed = False
                self._acked(batch)
        finally:
            self.spool.close_reader()
            if producer is not None:
                try:
                    producer.close(timeout_s=gateway.ship_timeout_s)
                except Exception as exc:
                    log.warning("closing the bus producer failed: %s", exc)

    def _send(self, producer: Producer, batch: Sequence[Spooled]) -> None:
        limit = self.settings.gateway.max_record_bytes
        for record in batch:
            for value, headers in envelope.encode(record.value, record.headers, limit):
                producer.send(record.topic, record.key, value, headers)  # type: ignore[arg-type]

    def _set_up(self, up: bool) -> None:
        if up and not self.bus_up and self._failures:
            log.info("bus is back; shipping the spool (%d event(s) left)", self.spool.events)
        self.bus_up = up
        self.metrics.bus_up.set(1 if up else 0)

    def _acked(self, batch: Sequence[Spooled]) -> None:
        self.spool.ack(batch)
        if not self.bus_up:
            self._set_up(True)
        now_ms = time.time() * 1000.0
        replayed = 0
        for record in batch:
            self.metrics.shipped.labels(topic=record.topic).inc()
            self.metrics.latency.observe(max(0.0, now_ms - record.timestamp_ms) / 1000.0)
            if record.offset < self._replay_until:
                replayed += 1
        self.shipped += len(batch)
        if replayed:
            self.replayed += replayed
            self.metrics.replayed.inc(replayed)
        self._release(self._bus_waiters, self.spool.cursor)


def _settle(future: asyncio.Future[bool], error: Exception | None) -> None:
    if future.done():
        return  # the request was cancelled (client gone); its event is spooled all the same
    if error is None:
        future.set_result(True)
    else:
        future.set_exception(error)


def _abandon(producer: Producer) -> None:
    """Close a producer whose send or flush failed, without waiting for what it still holds."""
    try:
        producer.close(timeout_s=0)
    except Exception as exc:  # it failed already; its records stay in the spool
        log.debug("abandoned producer: %s", exc)
