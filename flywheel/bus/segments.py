"""The local log's segments: their names, the roll, and the erasure of expired ones.

A partition of the local log (flywheel/bus/locallog.py) is a sequence of segment files in its
topic's directory, each holding the frames from its *base* offset on::

    <p>.log                      the segment of base 0 (the whole partition of a log written
                                 before segments existed: such a log is read as it is)
    <p>.<base, 20 digits>.log    the segment whose first record has offset ``base``

Invariants:

- The segment named by a segment's end offset exists only once that segment is *sealed*: the roll
  (a writer's, or :func:`seal`'s) creates ``<p>.<end>.log`` while holding the ``flock`` of the
  segment it seals, after truncating any torn tail, and nobody appends to a segment whose successor
  exists (a writer checks under that lock). So a reader at the end of a segment moves on exactly
  when the file named by its next offset exists, and offsets run on across segments unbroken.
- An empty segment is never sealed, and the newest segment is never deleted: a partition that was
  ever written keeps its log end (the next offset) across any expiry.
- :func:`expire` (run by the ``janitor`` role, flywheel/janitor.py) deletes the oldest segments whose
  newest record is older than the retention, and seals the newest one first when even that one is
  that old. A segment's newest record is at most its file's modification time (the time of its last
  append), which is what is compared: never early, late by at most the write's own delay. A deleted
  segment is first renamed out of the partition (``<segment>.erasing``), then overwritten with
  zeros under its ``flock``, ``fsync``ed and unlinked: its records cannot be read back from the file
  system's blocks (on a file system that writes in place: ext4, xfs; a copy-on-write one or an SSD's
  remapping may keep old blocks). A reader that still holds it and meets the zeros finds its segment
  gone from the partition and seeks again from the current segments (``locallog``); a writer cannot
  meet them (it appends under the same ``flock``, only to a segment without a successor, and one
  whose file was unlinked, ``st_nlink == 0``, goes on in the newest). A janitor killed mid-erasure
  leaves the ``.erasing`` file, which the next :func:`expire` finishes.
- A writer opens a segment without creating it, except base 0 of a partition never written: a
  segment listed a moment ago may have been sealed and erased since, and recreating it would
  reuse its offsets.
- A record lives at most the retention plus the age at which a segment rolls (a writer rolls a
  segment at ``segment_bytes``, or once its first record is ``segment_s`` old).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

from flywheel.bus.frames import CorruptLogError, Scan, fsync_dir, scan

log = logging.getLogger(__name__)

#: A segment rolls when it reaches this size.
SEGMENT_BYTES = 64 * 1024 * 1024
#: The longest a segment stays open for appends (its first record's age), unless the retention is shorter.
SEGMENT_S_MAX = 24 * 3600.0
_ZERO_CHUNK = 1024 * 1024
#: The suffix of a segment being erased (no longer a segment: ``segment_bases`` does not list it).
ERASING = ".erasing"
_DIGITS = 20


def segment_path(directory: Path, partition: int, base: int) -> Path:
    """The file of partition ``partition``'s segment starting at offset ``base``."""
    return directory / (f"{partition}.log" if base == 0 else f"{partition}.{base:0{_DIGITS}d}.log")


def segment_bases(directory: Path, partition: int) -> list[int]:
    """The base offsets of the partition's segments, oldest first (empty: never written)."""
    prefix = f"{partition}."
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name == f"{partition}.log":
            out.append(0)
        elif name.startswith(prefix) and name.endswith(".log"):
            middle = name[len(prefix):-4]
            if len(middle) == _DIGITS and middle.isdigit():
                out.append(int(middle))
    return sorted(out)


def segment_s_for(retention_s: float | None) -> float | None:
    """The age at which a writer rolls a segment: a quarter of the retention, at most a day."""
    return None if retention_s is None else min(retention_s / 4, SEGMENT_S_MAX)


def end_of(fd: int, base: int, path: Path, position: int = 0, next_offset: int | None = None) -> tuple[int, int, bool]:
    """``(position, next offset, torn)`` after the last good frame of a segment file."""
    next_offset = base if next_offset is None else next_offset
    while True:
        found = scan(fd, position, next_offset, max_records=10_000, path=str(path))
        position, next_offset = found.position, found.next_offset
        if not found.frames or found.torn:
            return position, next_offset, found.torn


def open_for_append(directory: Path, partition: int, base: int) -> tuple[int, int, Path]:
    """``(fd, base, path)`` of segment ``base`` opened for appends; one erased since it was listed
    gives way to the newest. Only base 0 of a partition never written is created (module docstring)."""
    while True:
        path = segment_path(directory, partition, base)
        try:
            return os.open(path, os.O_RDWR | os.O_APPEND), base, path
        except FileNotFoundError:
            bases = segment_bases(directory, partition)
            if bases:
                base = bases[-1]
                continue
        base, path = 0, segment_path(directory, partition, 0)
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue  # another writer made it: open that one
        fsync_dir(directory)
        return fd, base, path


def taken_away(fd: int, path: Path) -> bool:
    """Whether the segment open as ``fd`` is no longer ``path``: renamed for erasure, or unlinked."""
    try:
        return os.stat(path).st_ino != os.fstat(fd).st_ino
    except FileNotFoundError:
        return True


def scan_kept(fd: int, position: int, next_offset: int, *, max_records: int | None, path: Path) -> Scan | None:
    """``frames.scan`` of the segment open as ``fd``; None when it read damage because the segment
    was taken away (:func:`taken_away`: being zeroed for erasure) since it was opened, so the reader
    seeks again. Damage in a segment still in place raises :class:`CorruptLogError`, as ``scan`` does."""
    try:
        return scan(fd, position, next_offset, max_records=max_records, path=str(path))
    except CorruptLogError:
        if not taken_away(fd, path):
            raise
        return None


def first_timestamp_ms(fd: int, base: int, path: Path) -> int | None:
    """The timestamp of a segment's first record; None while it has none."""
    found = scan(fd, 0, base, max_records=1, path=str(path))
    return found.frames[0][0].timestamp_ms if found.frames else None


def seal(directory: Path, partition: int, base: int) -> int | None:
    """Roll the partition's segment ``base`` if it is still the newest and not empty: its torn tail
    (a crashed writer's) is truncated and its successor created; the successor's base, else None."""
    path = segment_path(directory, partition, base)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        position, end, torn = end_of(fd, base, path)
        if end == base or os.fstat(fd).st_nlink == 0 or segment_path(directory, partition, end).exists():
            return None
        if torn:
            log.warning("truncating torn tail of %s at byte %d", path, position)
            os.ftruncate(fd, position)
        os.fsync(fd)
        create(directory, partition, end)
        return end
    finally:
        os.close(fd)


def create(directory: Path, partition: int, base: int) -> None:
    """Create the (empty) segment ``base``, durably; the caller holds the predecessor's lock."""
    fd = os.open(segment_path(directory, partition, base), os.O_RDWR | os.O_CREAT, 0o644)
    os.close(fd)
    fsync_dir(directory)


def erase(path: Path) -> int:
    """Take a sealed segment out of the partition, then overwrite it with zeros and unlink it; its
    size (0: it was gone already). The rename comes first: from then on no reader or writer lists
    it, and one still holding it open meets zeros only in a file that is no longer a segment (a
    reader seeks again, ``locallog``). A crash between the rename and the unlink leaves an
    ``.erasing`` file, finished by the next :func:`expire`."""
    erasing = path.with_name(path.name + ERASING)
    try:
        os.rename(path, erasing)
    except FileNotFoundError:
        return 0  # another janitor's
    fsync_dir(path.parent)
    return _zero_and_unlink(erasing)


def _zero_and_unlink(path: Path) -> int:
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer mid-append finishes first (one after it sees st_nlink == 0)
        size = os.fstat(fd).st_size
        for start in range(0, size, _ZERO_CHUNK):
            os.pwrite(fd, bytes(min(_ZERO_CHUNK, size - start)), start)
        os.fsync(fd)
        with contextlib.suppress(FileNotFoundError):  # two janitors: the other unlinked it
            path.unlink()
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return size


def erasing_left(directory: Path, partition: int) -> list[Path]:
    """The partition's segments a crash left half-erased (renamed, not yet unlinked)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.endswith(ERASING):
            segment = name[:-len(ERASING)]
            if segment == f"{partition}.log" or (segment.startswith(f"{partition}.") and segment.endswith(".log")
                                                  and len(segment[len(f"{partition}."):-4]) == _DIGITS):
                out.append(directory / name)
    return sorted(out)


def expire(directory: Path, partition: int, retention_s: float, now: float | None = None) -> tuple[int, int]:
    """Delete the partition's segments older than ``retention_s`` (module docstring); ``(segments, bytes)``."""
    cutoff = (time.time() if now is None else now) - retention_s
    segments = erased = 0
    for left in erasing_left(directory, partition):  # a crashed janitor's
        erased += _zero_and_unlink(left)
        segments += 1
    bases = segment_bases(directory, partition)
    if not bases:
        return segments, erased
    if _mtime(segment_path(directory, partition, bases[-1])) < cutoff:
        new = seal(directory, partition, bases[-1])
        if new is not None:
            bases.append(new)
    for base in bases[:-1]:
        path = segment_path(directory, partition, base)
        if _mtime(path) >= cutoff:
            break  # segments are deleted oldest first, so the kept ones stay contiguous
        erased += erase(path)
        segments += 1
    return segments, erased


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
