"""The gateway's write-ahead spool: every captured event is appended here before its response is
released, and shipped to the bus from here, in order (``serving/gateway/shipper.py``).

Layout under the spool folder (one per gateway process)::

    LOCK                 exclusive flock held by the process using the spool (its pid inside)
    NNNNNNNNNNNN.seg     segments of frames (``flywheel.bus.frames``) numbered with consecutive
                         offsets from the segment's name; the topic rides in header ``spool.topic``
    cursor.json          {"offset": N}: the bus acknowledged every record before N

Invariants:

- One process per folder: :meth:`Spool.open` takes ``LOCK`` without waiting and raises
  :class:`SpoolLocked` (naming the holder) if another process has it.
- :meth:`append` writes the frames of one call with one ``write``: when it returns they survive a
  killed process (page cache); :meth:`sync` ``fsync``s them (group commit), after which they
  survive a machine crash. A failed or short write is truncated away, so a call is spooled whole
  or not at all; if even the truncate fails the segment is abandoned and the next append starts a
  new one, whose name continues the offsets.
- Offsets are consecutive from segment to segment. A segment is rotated once it holds
  ``segment_bytes``; a segment is deleted once the cursor has passed every record in it.
- Reading is the shipper's alone (one thread): :meth:`read` returns records in offset order from
  where the last read stopped, :meth:`rewind` goes back to the cursor (after a failed send), and
  :meth:`ack` moves the cursor past records the bus acknowledged. The cursor file is rewritten at
  most every ``CURSOR_INTERVAL_S`` and on close: a cursor that lags after a crash only means
  records are sent again (at-least-once; consumers dedup by ``event_id``).
- Opening replays: reading starts at the cursor (or the first segment, if the cursor is older).
  A torn tail of the last segment (a crash mid-write) is truncated; a torn tail of an earlier
  segment is skipped (its frames end there). A frame that fails its checks with good data after
  it is damage, not a crash: :class:`~flywheel.bus.frames.CorruptLogError` names the file. Missing
  offsets between segments (a machine crash lost an un-fsynced tail) are logged and counted in
  :attr:`lost`.
- Thread use: ``append`` from one thread (the event loop), ``sync`` from one (the fsync thread),
  ``read``/``rewind``/``ack`` from one (the shipper); ``events``/``unshipped_bytes`` are plain
  attributes any thread may read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flywheel.bus.frames import encode_frame, fsync_dir, scan, try_lock, write_atomic

log = logging.getLogger(__name__)

TOPIC_HEADER = "spool.topic"
SEGMENT_BYTES = 64 * 1024 * 1024
CURSOR_INTERVAL_S = 0.2
_SUFFIX = ".seg"

#: (topic, key, value, headers)
Item = tuple[str, str | None, bytes, dict[str, str]]


class SpoolLocked(RuntimeError):
    """Another process holds this spool folder."""


class SpoolClosed(RuntimeError):
    """The spool was closed."""


@dataclass(frozen=True)
class Spooled:
    """One record read back from the spool."""

    offset: int
    topic: str
    key: str | None
    value: bytes
    headers: dict[str, str]
    timestamp_ms: int
    size: int  # bytes of its frame
    segment: int  # base offset of its segment
    end: int  # position after its frame in the segment


def _segment_name(base: int) -> str:
    return f"{base:012d}{_SUFFIX}"


class Spool:
    """See the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        self._closed = True
        self._segments: list[int] = []  # bases, ascending
        # writer (append thread)
        self._fd: int | None = None
        self._base = 0
        self._pos = 0
        self._next = 0
        self._abandon = False
        self._rotated: list[int] = []  # fds of full segments not yet fsync'd (the sync thread closes them)
        self._dir_dirty = False
        # reader (shipper thread)
        self._r_fd: int | None = None
        self._r_seg = 0
        self._r_pos = 0
        self._r_next = 0
        # cursor (shipper thread writes, under the lock)
        self._c_seg = 0
        self._c_pos = 0
        self._c_off = 0
        self._c_saved = -1
        self._c_saved_at = 0.0
        self._c_failing = False
        # shared counters
        self.events = 0
        self.unshipped_bytes = 0
        self.oldest_ms: int | None = None
        self.lost = 0
        self.synced = 0  # every offset below this is fsync'd

    # Opening ------------------------------------------------------------------------------------

    def open(self) -> None:
        """Lock the folder, recover its segments and position the reader at the cursor."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = try_lock(self.dir / "LOCK")
        if fd is None:
            holder = (self.dir / "LOCK").read_text().strip() or "unknown"
            raise SpoolLocked(
                f"spool {self.dir} is in use by another gateway process (pid {holder}); give each gateway "
                "its own gateway.gateway_id or gateway.spool_dir"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        try:
            self._recover()
        except BaseException:
            self._lock_fd = None
            os.close(fd)
            raise
        self._closed = False

    def _recover(self) -> None:
        names = (p.name[: -len(_SUFFIX)] for p in self.dir.glob(f"*{_SUFFIX}"))
        bases = sorted(int(name) for name in names if name.isdigit())
        cursor = self._read_cursor()
        if bases:
            cursor = max(cursor, bases[0])
        # Segments whose successor starts at or before the cursor hold only shipped records.
        while len(bases) > 1 and bases[1] <= cursor:
            (self.dir / _segment_name(bases.pop(0))).unlink()
        self._segments = bases
        self._c_off = cursor
        self._c_seg = bases[0] if bases else cursor
        self._c_pos = 0
        expected = cursor
        for i, base in enumerate(bases):
            path = self.dir / _segment_name(base)
            last = i == len(bases) - 1
            if base > expected and i > 0:
                self._lose(expected, base)
            expected = max(expected, base)
            fd = os.open(path, (os.O_RDWR | os.O_APPEND) if last else os.O_RDONLY)
            try:
                found = scan(fd, 0, base, max_records=None, path=str(path))
                start = 0
                for decoded, end in found.frames:
                    if decoded.offset < cursor:
                        self._c_seg, self._c_pos = base, end
                    else:
                        if self.oldest_ms is None:
                            self.oldest_ms = decoded.timestamp_ms
                        self.events += 1
                        self.unshipped_bytes += end - start
                    start = end
                expected = max(expected, found.next_offset)
                if found.torn:
                    if last:
                        log.warning("spool %s: truncating a torn tail at byte %d", path, found.position)
                        os.ftruncate(fd, found.position)
                    else:
                        log.warning("spool %s: skipping a torn tail at byte %d", path, found.position)
                if last:
                    self._fd, self._base, self._pos, self._next = fd, base, found.position, found.next_offset
                    fd = -1
            finally:
                if fd >= 0:
                    os.close(fd)
        if not bases:
            self._next = cursor
        self.synced = self._next
        self.rewind()

    def _lose(self, expected: int, base: int) -> None:
        self.lost += base - expected
        log.error(
            "spool %s: offsets %d..%d are missing (an un-fsynced tail lost in a machine crash); "
            "%d event(s) lost", self.dir, expected, base - 1, base - expected,
        )

    def _read_cursor(self) -> int:
        try:
            return int(json.loads((self.dir / "cursor.json").read_text())["offset"])
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("spool %s: unreadable cursor (%s); replaying from the first segment", self.dir, exc)
            return 0

    # Writing (one thread) -----------------------------------------------------------------------

    def append(self, items: Sequence[Item]) -> int:
        """Spool ``items`` in order with one write; returns the offset after the last one.

        Raises ``OSError`` (nothing of ``items`` is spooled then) or :class:`SpoolClosed`."""
        if self._closed:
            raise SpoolClosed("the spool is closed")
        if self._fd is None or self._abandon or self._pos >= self.segment_bytes:
            self._new_segment()
        assert self._fd is not None
        now = int(time.time() * 1000)
        data = b"".join(
            encode_frame(self._next + i, key, value, {**headers, TOPIC_HEADER: topic}, now)
            for i, (topic, key, value, headers) in enumerate(items)
        )
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write to the spool ({written} of {len(data)} bytes)")
        except OSError:
            try:
                os.ftruncate(self._fd, self._pos)
            except OSError:
                self._abandon = True
            raise
        with self._lock:
            self._pos += len(data)
            self._next += len(items)
            if self.events == 0:
                self.oldest_ms = now
            self.events += len(items)
            self.unshipped_bytes += len(data)
            return self._next

    def _new_segment(self) -> None:
        path = self.dir / _segment_name(self._next)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        with self._lock:
            if self._fd is not None:
                self._rotated.append(self._fd)
            self._fd, self._base, self._pos, self._abandon = fd, self._next, 0, False
            if not self._segments or self._segments[-1] != self._next:
                self._segments.append(self._next)
            self._dir_dirty = True

    # Durability (one thread) --------------------------------------------------------------------

    def sync(self) -> int:
        """``fsync`` everything written so far; returns the offset below which all is durable."""
        with self._lock:
            target = self._next
            rotated, self._rotated = self._rotated, []
            current = self._fd
            dir_dirty, self._dir_dirty = self._dir_dirty, False
        try:
            for fd in rotated:
                os.fsync(fd)
            if current is not None and target > self.synced:
                os.fsync(current)
            if dir_dirty:
                fsync_dir(self.dir)
        finally:
            for fd in rotated:
                os.close(fd)
        self.synced = max(self.synced, target)
        return self.synced

    # Reading (the shipper) ----------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        return self._next

    @property
    def cursor(self) -> int:
        return self._c_off

    def read(self, max_records: int, max_bytes: int) -> list[Spooled]:
        """Up to ``max_records`` records (and about ``max_bytes``, at least one) after the last read."""
        with self._lock:
            if self._closed:
                raise SpoolClosed("the spool is closed")
            end = self._next
            segments = list(self._segments)
        out: list[Spooled] = []
        size = 0
        while len(out) < max_records and size < max_bytes and self._r_next < end:
            if self._r_fd is None:
                self._r_fd = os.open(self.dir / _segment_name(self._r_seg), os.O_RDONLY)
            found = scan(
                self._r_fd, self._r_pos, self._r_next,
                max_records=min(max_records - len(out), end - self._r_next), path=_segment_name(self._r_seg),
            )
            start = self._r_pos
            for decoded, frame_end in found.frames:
                headers = dict(decoded.headers)
                topic = headers.pop(TOPIC_HEADER)
                out.append(Spooled(decoded.offset, topic, decoded.key, decoded.value, headers, decoded.timestamp_ms,
                                   frame_end - start, self._r_seg, frame_end))
                size += frame_end - start
                start = frame_end
                if size >= max_bytes:
                    break
            if out and out[-1].segment == self._r_seg:
                self._r_pos, self._r_next = out[-1].end, out[-1].offset + 1
            if found.frames:
                continue
            later = [b for b in segments if b > self._r_seg]
            if not later:
                break  # the writer's segment: nothing more yet
            os.close(self._r_fd)
            self._r_fd, self._r_seg, self._r_pos = None, later[0], 0
            self._r_next = max(self._r_next, later[0])
        if out and out[0].offset == self._c_off:
            self.oldest_ms = out[0].timestamp_ms
        return out

    def rewind(self) -> None:
        """Read again from the cursor (the records after it were not acknowledged)."""
        if self._r_fd is not None and self._r_seg != self._c_seg:
            os.close(self._r_fd)
            self._r_fd = None
        self._r_seg, self._r_pos, self._r_next = self._c_seg, self._c_pos, self._c_off

    def ack(self, records: Sequence[Spooled]) -> None:
        """The bus acknowledged ``records`` (the next ones in order): move the cursor past them."""
        if not records:
            return
        last = records[-1]
        with self._lock:
            if self._closed:
                return  # acknowledged after close: sent again at the next start (at-least-once)
            self._c_seg, self._c_pos, self._c_off = last.segment, last.end, last.offset + 1
            self.events = max(0, self.events - len(records))
            self.unshipped_bytes = max(0, self.unshipped_bytes - sum(r.size for r in records))
            if self.events == 0:
                self.oldest_ms = None
            done = []
            while len(self._segments) > 1 and self._segments[1] <= self._c_off:
                done.append(self._segments.pop(0))
            if self._c_seg in done:  # the cursor sits at the end of a deleted segment: the next one's start
                self._c_seg, self._c_pos = self._segments[0], 0
        for base in done:
            (self.dir / _segment_name(base)).unlink(missing_ok=True)
        if time.monotonic() - self._c_saved_at >= CURSOR_INTERVAL_S:
            self._save_cursor()

    def _save_cursor(self) -> None:
        """Write the cursor file. It only bounds what is sent again after a crash, so a failure
        (a full disk) is logged and retried at the next interval, never raised to the shipper."""
        self._c_saved_at = time.monotonic()
        if self._c_off == self._c_saved:
            return
        try:
            write_atomic(self.dir / "cursor.json", json.dumps({"offset": self._c_off}).encode())
        except OSError as exc:
            if not self._c_failing:
                log.warning("spool %s: cannot save the cursor (%s); shipping goes on, a crash now would send "
                            "records from offset %d again", self.dir, exc, self._c_saved)
            self._c_failing = True
            return
        if self._c_failing:
            log.info("spool %s: cursor saved again", self.dir)
            self._c_failing = False
        self._c_saved = self._c_off

    def close_reader(self) -> None:
        """Release the reader's file (the shipper, when it stops)."""
        if self._r_fd is not None:
            os.close(self._r_fd)
            self._r_fd = None

    # Closing ------------------------------------------------------------------------------------

    def close(self) -> None:
        """``fsync`` what is written, save the cursor and release the folder. The reader's file is
        the shipper's to close (:meth:`close_reader`)."""
        if self._closed:
            return
        try:
            self.sync()
            self._save_cursor()
        finally:
            with self._lock:
                self._closed = True
                fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
