"""A tensor's changed elements, the input of its sparse coding, as the numba kernels find them.

:class:`Changes` is what both finders return: :func:`scan` here (tensors on the CPU) and
:func:`.device.scan_torch` (torch ops on any device). They find exactly the same thing, so the delta
is the same, byte for byte, whichever ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flywheel.weights.codec.bitview import width_consts
from flywheel.weights.codec.classes import MANTISSA, choose_thresholds, kernel_thresholds
from flywheel.weights.codec.kernels import nb_scan


@dataclass(frozen=True)
class Changes:
    """The changed elements of one tensor, the input of its sparse coding: the class thresholds
    and, class by class, the Rice gaps between their ranks (uint64) and their zigzag coded steps
    (unsigned integers of the element width), in element order."""

    thresholds: list[int]
    gaps: list[np.ndarray]
    steps: list[np.ndarray]


def scan(old_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> Changes:
    """The changed elements of a tensor (as :func:`.bitview.element_bits` views), found by the numba
    kernels."""
    numel = old_bits.size
    mask, sign, full = width_consts(old_bits.dtype.itemsize)
    mantissa = MANTISSA.get(dtype)
    thresholds, estimate = choose_thresholds(old_bits, new_bits, mantissa) if mantissa is not None else ([], numel)
    t1, t2, top = kernel_thresholds(thresholds)
    classes = len(thresholds) + 1
    narrow = old_bits.dtype.type
    # Room per class for twice the sampled estimate of changes (kept small so that the allocator
    # reuses memory it has already touched), and if that was not enough, for every element.
    for cap in (min(numel, 2 * estimate + 4096), numel):
        gaps = np.empty((classes, cap), dtype=np.uint64)
        steps = np.empty((classes, cap), dtype=old_bits.dtype)
        counts = np.zeros(classes, dtype=np.int64)
        if nb_scan(old_bits, new_bits, narrow(t1), narrow(t2), narrow(mask), top, dtype.is_floating_point,
                   sign, full, gaps, steps, counts):
            break
    return Changes(thresholds, [gaps[c, : counts[c]] for c in range(classes)],
                   [steps[c, : counts[c]] for c in range(classes)])
