"""The delta container (format version 3): its framing, its header, and the checks of each entry.

All integers little-endian (the framing is :mod:`.framing`'s, shared with anchors)::

    MAGIC (8 bytes) | u16 format version | u32 header length | zstd(header JSON, UTF-8) | payload

The header names the base and target state hashes and, per tensor of the target (in the target's
order): name, dtype, shape, scheme, and the byte lengths of its payload blobs (which follow one
another in header order). Schemes:

- ``same``: the tensor equals the base's, bit for bit; no payload.
- ``sparse``: only the changed elements, in up to three *classes* by the magnitude of the OLD
  element (``classes``: increasing magnitude thresholds at float exponent boundaries, which the
  receiver evaluates on the base it already has; small weights change far more often under Adam,
  so per-class coding beats the order-0 floor H(p)/p). Per class, the changed elements' ranks
  within the class are gap coded with a Rice code (``rice``: its parameter; ``counts``: changed
  elements) as two packed bit streams (LSB first), the unary quotients and the fixed-width
  remainders (``parts``: their byte lengths, class by class). Then the values, for all classes in
  the same order: the *step* ``s`` between the old and new element in an order-preserving integer
  view of the bits (for floats the usual sign-magnitude to monotone map, so a move of one ULP is a
  step of +-1), zigzag coded to ``z >= 1`` and split as ``u = z - 1``: the low bit of each ``u``
  (the step's sign) as a raw bit stream, ``m = u >> 1`` (0 for a move of one ULP) in 2-bit fields,
  four per byte, zstd coded, with field value 3 escaping ``m - 3`` to a side stream (``parts``
  ends with the byte lengths of the sign and field streams; the escapes, a zstd frame of a fixed
  width integer stream, take the rest). When most moves are large (escaped), the zigzag steps
  themselves may instead be that one fixed width stream (``values``: ``"packed"``, the sign and
  field streams empty), whichever is smaller. Steps wrap modulo the element width, so every bit
  pattern (NaN payloads, -0.0, infinities, denormals) round-trips exactly.
- ``full``: the new tensor's raw bytes, split into byte planes and zstd coded. Used for tensors
  absent from the base, dtype or shape changes, and whenever it is smaller than ``sparse`` (tried
  when ``sparse`` costs over 1/16 of the raw bytes and a zstd probe of a slice says it may win).

This module frames and parses; :mod:`.tensor_coding` writes and reads each tensor's payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.weights.codec import framing
from flywheel.weights.codec.state import DeltaError
from flywheel.weights.codec.workers import ZSTD_LEVEL

MAGIC = b"FWDELTA\x00"
FORMAT_VERSION = 3
#: After the magic: the format version and the header's length (:mod:`.framing`).
PREFIX = framing.PREFIX


@dataclass(frozen=True)
class DeltaHeader:
    format_version: int
    base_sha256: str
    target_sha256: str
    tensors: list[dict[str, Any]]


def header_bytes(header: dict[str, Any]) -> bytes:
    """The container's header: compact JSON, zstd coded (tensor names and keys repeat)."""
    return framing.header_bytes(header, ZSTD_LEVEL)


def pack_container(header: dict[str, Any], payloads: Iterable[bytes]) -> bytes:
    """A whole delta: the prefix, ``header`` (``base_sha256``, ``target_sha256``, ``tensors``) and
    the tensors' payload blobs in header order."""
    return b"".join([framing.frame_header(MAGIC, FORMAT_VERSION, header, ZSTD_LEVEL), *payloads])


def read_delta_header(delta: bytes | memoryview) -> tuple[DeltaHeader, int]:
    """Parse and check the container prefix and header; returns it and the payload offset."""
    header, offset = framing.read_framed_header(delta, MAGIC, FORMAT_VERSION, "delta")
    try:
        parsed = DeltaHeader(
            format_version=FORMAT_VERSION,
            base_sha256=str(header["base_sha256"]),
            target_sha256=str(header["target_sha256"]),
            tensors=list(header["tensors"]),
        )
    except (KeyError, TypeError) as exc:
        raise DeltaError(f"corrupt delta header: {exc}") from exc
    return parsed, offset


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or name.startswith(("qint", "quint")):
        raise DeltaError(f"unknown dtype {name!r} in delta header")
    return dtype


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_entry(entry: Any) -> tuple[str, torch.dtype, tuple[int, ...], str]:
    """A header entry's ``(name, dtype, shape, scheme)``, after checking that it has the fields its
    scheme needs, of the right types (the values themselves are checked where they are used)."""
    try:
        name, scheme, shape = entry["name"], entry["scheme"], tuple(entry["shape"])
    except (KeyError, TypeError) as exc:
        raise DeltaError(f"corrupt tensor entry in delta header: {exc}") from exc
    if not isinstance(name, str) or scheme not in ("same", "sparse", "full"):
        raise DeltaError(f"corrupt tensor entry in delta header: {entry!r:.200}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise DeltaError(f"bad shape {shape!r} for tensor {name!r}")
    required = {"same": (), "full": ("len",), "sparse": ("len", "changed")}[scheme]
    for key in required:
        if not _is_count(entry.get(key)):
            raise DeltaError(f"missing or bad {key!r} for tensor {name!r}")
    if scheme == "sparse":
        for key in ("classes", "counts", "rice", "parts"):
            value = entry.get(key)
            if not isinstance(value, list) or not all(_is_count(v) for v in value):
                raise DeltaError(f"missing or bad {key!r} for tensor {name!r}")
    return name, _parse_dtype(entry.get("dtype")), shape, scheme
