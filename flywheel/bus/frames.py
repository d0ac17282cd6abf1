"""Record frames and the small durable-file helpers shared by the local log and the gateway spool.

Frame: ``length u32 | crc32 u32 | payload`` (big endian), ``crc32 = crc32(length bytes + payload)``;
payload = ``version u8 | offset u64 | timestamp_ms i64 | key_len i32 (-1: none) | key |
headers_len u32 | headers (JSON object) | value``. A file of frames numbers them with consecutive
offsets from a base the reader knows (0 for a partition log, the segment's name for a spool
segment); :func:`scan` checks each frame's offset, so a frame from the wrong place is caught too.

Invariants of :func:`scan`: it returns only whole frames that pass every check. A crash
mid-append leaves a torn tail: an incomplete frame, or a complete one that fails its checks and
reaches the end of the file (or is followed only by zero bytes); ``scan`` stops before it and says
``torn``. A bad frame with good data after it cannot come from a crash: it raises
:class:`CorruptLogError`.

``write_atomic`` replaces a small file so that a reader sees the old or the new content, never a
mix, and the new content is durable when it returns; ``try_lock`` takes an exclusive ``flock``
without waiting (held until its descriptor is closed or the process dies).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from flywheel.bus.base import BusError

FORMAT_VERSION = 1
_HEADER = struct.Struct(">II")  # length, crc32
_FIXED = struct.Struct(">BQqi")  # version, offset, timestamp_ms, key_len
_U32 = struct.Struct(">I")
#: Smallest payload: fixed part + headers_len (empty key, headers and value still need these).
MIN_PAYLOAD = _FIXED.size + _U32.size
MAX_PAYLOAD = 256 * 1024 * 1024
_READ_CHUNK = 256 * 1024


class CorruptLogError(BusError):
    """A frame in the middle of a file fails its checks: not a torn tail, real damage."""


# Frames (pure) ----------------------------------------------------------------------------------


def encode_frame(
    offset: int, key: str | None, value: bytes, headers: dict[str, str], timestamp_ms: int
) -> bytes:
    key_bytes = b"" if key is None else key.encode("utf-8")
    header_bytes = json.dumps(headers, separators=(",", ":"), sort_keys=True).encode("utf-8")
    payload = b"".join(
        (
            _FIXED.pack(FORMAT_VERSION, offset, timestamp_ms, -1 if key is None else len(key_bytes)),
            key_bytes,
            _U32.pack(len(header_bytes)),
            header_bytes,
            value,
        )
    )
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record of {len(payload)} bytes exceeds the {MAX_PAYLOAD} byte limit")
    length = _U32.pack(len(payload))
    return length + _U32.pack(zlib.crc32(length + payload)) + payload


@dataclass(frozen=True)
class Decoded:
    offset: int
    timestamp_ms: int
    key: str | None
    headers: dict[str, str]
    value: bytes


def _decode_payload(payload: bytes) -> Decoded:
    version, offset, ts, key_len = _FIXED.unpack_from(payload, 0)
    if version != FORMAT_VERSION:
        raise ValueError(f"unknown frame version {version}")
    at = _FIXED.size
    key: str | None = None
    if key_len >= 0:
        key = payload[at : at + key_len].decode("utf-8")
        at += key_len
    elif key_len != -1:
        raise ValueError("negative key length")
    (headers_len,) = _U32.unpack_from(payload, at)
    at += _U32.size
    headers = json.loads(payload[at : at + headers_len])
    if not isinstance(headers, dict):
        raise ValueError("headers are not an object")
    at += headers_len
    if at > len(payload):
        raise ValueError("frame fields overrun the payload")
    return Decoded(offset, ts, key, headers, payload[at:])


@dataclass
class Scan:
    """What one pass over a partition file found, from ``start`` onwards."""

    frames: list[tuple[Decoded, int]]  # (record, file position after it)
    position: int  # after the last good frame returned
    next_offset: int
    torn: bool  # bytes after ``position`` that are not (yet) a good frame


def _is_zero_tail(fd: int, pos: int, size: int) -> bool:
    while pos < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - pos), pos)
        if not chunk or chunk.count(0) != len(chunk):
            return False
        pos += len(chunk)
    return True


def scan(fd: int, position: int, next_offset: int, *, max_records: int | None, path: str) -> Scan:
    """Read good frames from ``position`` (whose offset must be ``next_offset``) up to EOF.

    Stops early after ``max_records``. A torn tail sets ``torn``; damage followed by more data
    raises :class:`CorruptLogError`.
    """
    size = os.fstat(fd).st_size
    frames: list[tuple[Decoded, int]] = []
    buf = b""
    buf_at = position  # file position of buf[0]
    pos = position
    while pos < size and (max_records is None or len(frames) < max_records):
        if pos + _HEADER.size > buf_at + len(buf):
            buf = os.pread(fd, min(_READ_CHUNK, size - pos), pos)
            buf_at = pos
        if len(buf) - (pos - buf_at) < _HEADER.size:
            return Scan(frames, pos, next_offset, torn=True)  # partial header
        length, crc = _HEADER.unpack_from(buf, pos - buf_at)
        end = pos + _HEADER.size + length
        if MIN_PAYLOAD <= length <= MAX_PAYLOAD and end > size:
            return Scan(frames, pos, next_offset, torn=True)  # incomplete frame
        problem = ""
        decoded = None
        if not MIN_PAYLOAD <= length <= MAX_PAYLOAD:
            problem = f"impossible frame length {length}"
        else:
            if end > buf_at + len(buf):
                buf = os.pread(fd, max(_READ_CHUNK, end - pos), pos)
                buf_at = pos
            lo = pos - buf_at
            frame = buf[lo : lo + _HEADER.size + length]
            if zlib.crc32(frame[:4] + frame[_HEADER.size :]) != crc:
                problem = "crc32 mismatch"
            else:
                try:
                    decoded = _decode_payload(frame[_HEADER.size :])
                except (ValueError, struct.error, UnicodeDecodeError) as exc:
                    problem = f"undecodable frame ({exc})"
                else:
                    if decoded.offset != next_offset:
                        problem = f"frame offset {decoded.offset}, expected {next_offset}"
        if problem:
            if end >= size or _is_zero_tail(fd, pos, size):
                return Scan(frames, pos, next_offset, torn=True)
            raise CorruptLogError(f"{path}: {problem} at byte {pos} (offset {next_offset})")
        assert decoded is not None
        frames.append((decoded, end))
        pos = end
        next_offset += 1
    return Scan(frames, pos, next_offset, torn=False)


# Small file helpers ------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(path: Path, *, create: bool = True) -> int | None:
    """Open ``path`` (creating it if ``create``) and take an exclusive flock without waiting; None if held."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
