"""One tensor's header entry and payload, both ways: the choice of scheme, and its checks on decode.

:func:`encode_tensor` codes a tensor of the target against the base's tensor of that name:
``same``, ``sparse`` (its changed elements found by :func:`.changes.scan` or, given a device,
:func:`.device.scan_torch`; then Rice and step coded by :mod:`.sparse`) or ``full`` (byte planes,
zstd), whichever the rules in :mod:`.container` pick. :func:`decode_tensor` is its inverse and
checks every field of the entry it uses: bad input raises :class:`DeltaError`, never wrong weights.

Imports numba (through the kernels): only :mod:`.delta` imports this module, on first use.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import numpy as np
import torch
import zstandard

from flywheel.weights.codec.bitview import (
    TORCH_VIEW,
    dtype_name,
    element_bits,
    sparse_capable,
    tensor_from_bits,
    width_consts,
)
from flywheel.weights.codec.changes import scan
from flywheel.weights.codec.classes import MANTISSA, MAX_CLASSES, kernel_thresholds
from flywheel.weights.codec.container import check_entry
from flywheel.weights.codec.device import scan_torch
from flywheel.weights.codec.kernels import nb_apply
from flywheel.weights.codec.sparse import decode_steps, encode_steps, rice_code, rice_ranks
from flywheel.weights.codec.state import DeltaError
from flywheel.weights.codec.streams import decompress, pack, planes, unpack, unplanes
from flywheel.weights.codec.workers import zstd_contexts

# "full" is also tried when the sparse coding costs more than this fraction of the raw bytes.
_TRY_FULL_ABOVE = 1 / 16
# ... and then only if a zstd probe of this many elements suggests it may win.
_FULL_PROBE = 1 << 13
# Steps are also tried as one plain packed stream when more than 1/this of them are escaped.
_PACKED_STEPS_ABOVE = 4


def _encode_full_tensor(new_bits: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    return cctx.compress(planes(new_bits))


def _full_worth_trying(new_bits: np.ndarray, sparse_len: int, cctx: zstandard.ZstdCompressor) -> bool:
    """Whether ``full`` may beat a sparse coding of ``sparse_len`` bytes (which costs over
    :data:`_TRY_FULL_ABOVE` of the raw bytes): estimated from a slice of at most :data:`_FULL_PROBE`
    elements, with a wide margin (this only saves time, the final choice compares real sizes)."""
    if new_bits.size <= 2 * _FULL_PROBE:
        return True
    probe = new_bits[(new_bits.size - _FULL_PROBE) // 2 :][:_FULL_PROBE]
    estimate = len(_encode_full_tensor(probe, cctx)) * (new_bits.size / _FULL_PROBE)
    return estimate < 1.5 * sparse_len


def encode_tensor(
    name: str, old: torch.Tensor | None, new: torch.Tensor, device: torch.device | None = None
) -> tuple[dict[str, Any], list[bytes]]:
    """One tensor's header entry and payload blobs; ``device``: find its changed elements with
    :func:`.device.scan_torch` there instead of the numba kernels (same result)."""
    cctx, _ = zstd_contexts()
    entry: dict[str, Any] = {"name": name, "dtype": dtype_name(new.dtype), "shape": list(new.shape)}
    numel = new.numel()
    entry["elements"] = numel
    comparable = old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape)
    if not comparable or not sparse_capable(new) or numel == 0:
        new_bits = element_bits(new)
        if comparable and np.array_equal(element_bits(old), new_bits):  # type: ignore[arg-type]
            entry.update(scheme="same", changed=0)
            return entry, []
        blob = _encode_full_tensor(new_bits, cctx)
        entry.update(scheme="full", changed=numel, len=len(blob))
        return entry, [blob]
    assert old is not None
    if device is not None:
        found = scan_torch(old, new, device)
    else:
        found = scan(element_bits(old), element_bits(new), new.dtype)
    changed = sum(g.size for g in found.gaps)
    if changed == 0:
        entry.update(scheme="same", changed=0)
        return entry, []
    blobs: list[bytes] = []
    ks: list[int] = []
    for gaps in found.gaps:
        k, unary, low = rice_code(gaps)
        blobs += [unary, low]
        ks.append(k)
    steps = np.concatenate(found.steps)
    step_blobs, escaped = encode_steps(steps, cctx)
    packed = False
    if escaped * _PACKED_STEPS_ABOVE > steps.size:  # big moves: the plain packed stream may be smaller
        plain = pack(steps, cctx)
        if len(plain) < sum(len(b) for b in step_blobs):
            step_blobs, packed = [b"", b"", plain], True
    blobs.extend(step_blobs)
    sparse_len = sum(len(b) for b in blobs)
    if sparse_len > _TRY_FULL_ABOVE * numel * new.element_size():
        new_bits = element_bits(new)
        if _full_worth_trying(new_bits, sparse_len, cctx):
            full_blob = _encode_full_tensor(new_bits, cctx)
            if len(full_blob) < sparse_len:
                entry.update(scheme="full", changed=changed, len=len(full_blob))
                return entry, [full_blob]
    entry.update(scheme="sparse", changed=changed, len=sparse_len, classes=found.thresholds,
                 counts=[g.size for g in found.gaps], rice=ks, parts=[len(b) for b in blobs[:-1]])
    if packed:
        entry["values"] = "packed"
    return entry, blobs


def decode_tensor(
    job: tuple[dict[str, Any], memoryview, torch.Tensor | None], out: np.ndarray | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_tensor` for ``(entry, its payload, the base's tensor of that name or
    None)``: the target tensor (on the CPU), or :class:`DeltaError`. ``out``: a uint8 buffer of
    exactly the target's bytes to build it in (a reader's reused buffer; the result views it),
    which must not overlap the base."""
    entry, blob, old = job
    name, dtype, shape, scheme = check_entry(entry)
    numel = math.prod(shape)
    if out is not None and out.nbytes != numel * dtype.itemsize:
        raise DeltaError(f"tensor {name!r}: output buffer of {out.nbytes} bytes for {numel} elements of {dtype}")
    if scheme == "same":
        if old is None or old.dtype != dtype or tuple(old.shape) != shape:
            raise DeltaError(f"tensor {name!r} is marked unchanged but the base has no matching tensor")
        if out is None:
            return old.detach().cpu().clone()
        return _into(out, element_bits(old), dtype, shape)
    _, dctx = zstd_contexts()
    width = dtype.itemsize
    if scheme == "full":
        raw = decompress(blob, dctx, numel * width, f"tensor {name!r}")
        if len(raw) != numel * width:
            raise DeltaError(f"tensor {name!r}: {len(raw)} bytes for {numel} elements of {dtype}")
        if width in TORCH_VIEW:
            bits = unplanes(raw, width, numel)
        else:
            bits = np.frombuffer(raw, dtype=np.uint8).copy()
        return tensor_from_bits(bits, dtype, shape) if out is None else _into(out, bits, dtype, shape)
    # sparse
    if old is None or old.dtype != dtype or tuple(old.shape) != shape or width not in TORCH_VIEW:
        raise DeltaError(f"tensor {name!r} is a sparse delta but the base has no matching tensor")
    thresholds, counts, ks, parts = entry["classes"], entry["counts"], entry["rice"], entry["parts"]
    changed = entry["changed"]
    classes = len(thresholds) + 1
    top = (1 << (8 * width - 1)) - 1
    if (len(counts) != classes or len(ks) != classes or len(parts) != 2 * classes + 2 or classes > MAX_CLASSES
            or sum(parts) > len(blob) or sum(counts) != changed or not 0 < changed <= numel
            or any(not 0 < t <= top for t in thresholds) or any(a >= b for a, b in pairwise(thresholds))
            or (thresholds and dtype not in MANTISSA)):
        raise DeltaError(f"tensor {name!r}: bad sparse entry")
    ranks = np.empty(changed, dtype=np.int64)
    starts = np.zeros(4, dtype=np.int64)  # per level (see kernels.nb_apply): class c is level c + 3 - classes
    offset = at = 0
    for c in range(classes):
        unary = blob[offset : offset + parts[2 * c]]
        offset += parts[2 * c]
        low = blob[offset : offset + parts[2 * c + 1]]
        offset += parts[2 * c + 1]
        rice_ranks(unary, low, ks[c], counts[c], numel, ranks[at : at + counts[c]], f"tensor {name!r} positions")
        at += counts[c]
        starts[c + 4 - classes :] = at
    signs = blob[offset : offset + parts[-2]]
    offset += parts[-2]
    mags = blob[offset : offset + parts[-1]]
    offset += parts[-1]
    what = f"tensor {name!r} values"
    if entry.get("values", "split") == "packed":
        if len(signs) or len(mags):
            raise DeltaError(f"{what}: sign or field streams beside a packed stream")
        steps = unpack(blob[offset:], changed, dctx, what)
        if changed and (int(steps.max()) > (1 << (8 * width)) - 1 or int(steps.min()) == 0):
            raise DeltaError(f"{what}: step out of range")
    elif entry.get("values", "split") == "split":
        steps = decode_steps(signs, mags, blob[offset:], changed, width, dctx, what)
    else:
        raise DeltaError(f"{what}: unknown value coding {entry.get('values')!r}")
    old_bits = element_bits(old)
    new_bits = np.empty_like(old_bits) if out is None else out.view(old_bits.dtype)
    mask, sign, full = width_consts(width)
    t1, t2, _ = kernel_thresholds(thresholds)
    narrow = old_bits.dtype.type
    if not nb_apply(old_bits, new_bits, narrow(t1), narrow(t2), narrow(mask), ranks, starts, steps,
                    dtype.is_floating_point, sign, full):
        raise DeltaError(f"tensor {name!r}: change position out of range")
    return tensor_from_bits(new_bits, dtype, shape)


def _into(out: np.ndarray, bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``bits`` copied into the uint8 buffer ``out``, as a tensor of ``dtype`` and ``shape``."""
    view = out.view(bits.dtype)
    np.copyto(view, bits.reshape(-1))
    return tensor_from_bits(view, dtype, shape)
