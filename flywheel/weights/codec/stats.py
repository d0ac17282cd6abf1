"""What a delta costs: its size next to a naive baseline and an entropy floor; changed elements.

For benchmarks, the command line (``flywheel weights stats``) and the registry (the fraction of
elements changed in a version it stores in full). Pure functions; only :func:`delta_stats` encodes
(and so loads the kernels).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from flywheel.weights.codec.bitview import element_bits, order_keys, sparse_capable, zigzag
from flywheel.weights.codec.delta import encode_delta_with_summary
from flywheel.weights.codec.workers import ZSTD_LEVEL


def _entropy_bits(counts: Iterable[int]) -> float:
    arr = np.asarray(list(counts), dtype=np.float64)
    total = arr.sum()
    if total <= 0:
        return 0.0
    p = arr[arr > 0] / total
    return float(-(p * np.log2(p)).sum() * total)


def delta_stats(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, device: str | torch.device | None = None
) -> dict[str, Any]:
    """Sizes of the delta from ``old`` to ``new`` (encoded as :func:`encode_delta` with ``device``)
    next to a naive baseline and an entropy floor.

    ``bytes_full``: raw bytes of ``new``; ``bytes_delta``: this codec; ``bytes_xor_zstd``: XOR of the
    bits with the base, zstd level 3; ``bytes_entropy_floor``: order-0 estimate (H(p) per element for
    the positions plus the empirical entropy of the steps, raw bytes for tensors with no base).
    """
    delta, summary = encode_delta_with_summary(old, new, device=device)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    by_dtype: dict[str, dict[str, Any]] = {}
    totals = {"bytes_full": 0, "bytes_xor_zstd": 0, "bytes_entropy_floor": 0.0}
    for entry in summary.tensors:
        name = entry["name"]
        t_new, t_old = new[name], old.get(name)
        new_bits = element_bits(t_new)
        nbytes = new_bits.nbytes
        comparable = t_old is not None and t_old.dtype == t_new.dtype and tuple(t_old.shape) == tuple(t_new.shape)
        if comparable:
            assert t_old is not None
            old_bits = element_bits(t_old)
            xor_len = len(cctx.compress((old_bits ^ new_bits).tobytes()))
            mask = old_bits != new_bits
            n, k = new_bits.size, int(np.count_nonzero(mask))
            floor = _entropy_bits([k, n - k])
            if k and sparse_capable(t_new):
                floating = t_new.dtype.is_floating_point
                steps = zigzag(order_keys(new_bits[mask], floating) - order_keys(old_bits[mask], floating))
                floor += _entropy_bits(np.unique(steps, return_counts=True)[1])
            elif k:
                floor += 8 * nbytes
        else:
            xor_len = len(cctx.compress(new_bits.tobytes()))
            floor = 8.0 * nbytes
        row = by_dtype.setdefault(
            entry["dtype"],
            {"tensors": 0, "elements": 0, "changed": 0, "bytes_full": 0, "bytes_delta": 0,
             "bytes_xor_zstd": 0, "bytes_entropy_floor": 0.0},
        )
        row["tensors"] += 1
        row["elements"] += entry["elements"]
        row["changed"] += entry["changed"]
        row["bytes_full"] += nbytes
        row["bytes_delta"] += entry.get("len", 0)
        row["bytes_xor_zstd"] += xor_len
        row["bytes_entropy_floor"] += floor / 8
        totals["bytes_full"] += nbytes
        totals["bytes_xor_zstd"] += xor_len
        totals["bytes_entropy_floor"] += floor / 8
    for row in by_dtype.values():
        row["fraction_changed"] = row["changed"] / row["elements"] if row["elements"] else 0.0
        row["bytes_entropy_floor"] = round(row["bytes_entropy_floor"])
    return {
        "tensors": len(summary.tensors),
        "elements": summary.elements,
        "changed": summary.changed,
        "fraction_changed": summary.fraction_changed,
        "bytes_full": totals["bytes_full"],
        "bytes_delta": len(delta),
        "bytes_xor_zstd": totals["bytes_xor_zstd"],
        "bytes_entropy_floor": round(totals["bytes_entropy_floor"]),
        "schemes": {s: sum(1 for e in summary.tensors if e["scheme"] == s) for s in ("same", "sparse", "full")},
        "by_dtype": by_dtype,
    }


def count_changed(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """``(changed, elements)`` of ``new`` against ``old``: elements whose bits differ, counting every
    element of a tensor that is new or changed dtype or shape."""
    changed = elements = 0
    for name, t_new in new.items():
        t_old = old.get(name)
        elements += t_new.numel()
        if t_old is None or t_old.dtype != t_new.dtype or tuple(t_old.shape) != tuple(t_new.shape):
            changed += t_new.numel()
        else:
            diff = element_bits(t_old) != element_bits(t_new)
            if diff.size != t_new.numel():  # byte view of a wide dtype
                diff = diff.reshape(t_new.numel(), -1).any(axis=1)
            changed += int(np.count_nonzero(diff))
    return changed, elements
