"""Magnitude classes: the thresholds that split a tensor's elements by the size of the OLD value.

Small weights change far more often than large ones under Adam, so the sparse scheme codes the
changed elements' positions per class (see :mod:`.container`). The thresholds sit at float exponent
boundaries and are chosen on a sample of blocks of the tensor to minimise the summed order-0
position cost n_c * H(p_c); they only affect size and speed, never correctness. The receiver
evaluates them on the base it already has.

The histogram and split kernels are numba (imports :mod:`.kernels`' decorator; none of them call a
kernel in another file, so numba's per-file cache stays valid).
"""

from __future__ import annotations

import numpy as np
import torch

from flywheel.weights.codec.bitview import width_consts
from flywheel.weights.codec.kernels import kernel

#: Mantissa bits of the float dtypes whose exponent gives the position context.
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
MAX_CLASSES = 3
# Thresholds are chosen on a sample of about SAMPLE_BLOCKS blocks of SAMPLE_BLOCK elements spread
# evenly over the tensor (all of a small tensor).
SAMPLE_BLOCK = 1024
SAMPLE_BLOCKS = 32
# Coded-size allowance for each extra class (its stream lengths in the header, Rice tail): bits.
_CLASS_COST_BITS = 400


@kernel()
def _nb_histograms(old, new, block, every, mask, shift, n_e, k_e):  # pragma: no cover - compiled
    """Exponent histograms of a sample (blocks of ``block`` elements, every ``every``-th block) and
    of the changed elements in it. Four interleaved histograms (rows of ``n_e``, ``k_e``) keep
    repeated exponents from waiting on each other."""
    n = old.size
    for start in range(0, n, block * every):
        stop = min(start + block, n)
        i = start
        while i + 4 <= stop:
            for u in range(4):
                a = old[i + u]
                e = (a & mask) >> shift
                n_e[u, e] += 1
                if a != new[i + u]:
                    k_e[u, e] += 1
            i += 4
        while i < stop:
            a = old[i]
            e = (a & mask) >> shift
            n_e[0, e] += 1
            if a != new[i]:
                k_e[0, e] += 1
            i += 1


@kernel()
def _nb_class_bits(n, k, class_cost):  # pragma: no cover - compiled
    """n * H(k / n) + ``class_cost``: the order-0 position cost of one class, in bits."""
    if n <= 0.0:
        return class_cost
    p = k / n
    h = 0.0
    if p > 0.0:
        h -= p * np.log2(p)
    if p < 1.0:
        h -= (1.0 - p) * np.log2(1.0 - p)
    return n * h + class_cost


@kernel()
def _nb_split(n_e, k_e, max_classes, class_cost):  # pragma: no cover - compiled
    """Best split of the exponent range into up to three classes of consecutive present exponents,
    minimising the summed :func:`_nb_class_bits`. Returns the exponents where classes 1 and 2 start
    (-1 where there is no such class)."""
    size = n_e.size
    cuts = np.empty(size + 1, dtype=np.int64)
    m = 0
    for e in range(size):
        if n_e[e] > 0:
            cuts[m] = e
            m += 1
    if m < 2:
        return -1, -1
    cuts[m] = size
    cn = np.zeros(m + 1)
    ck = np.zeros(m + 1)
    run_n = 0.0
    run_k = 0.0
    at = 0
    for e in range(size + 1):
        if at <= m and cuts[at] == e:
            cn[at] = run_n
            ck[at] = run_k
            at += 1
        if e < size:
            run_n += n_e[e]
            run_k += k_e[e]
    last = m
    cost = np.full((m + 1, m + 1), np.inf)
    for i in range(m + 1):
        for j in range(i + 1, m + 1):
            cost[i, j] = _nb_class_bits(cn[j] - cn[i], ck[j] - ck[i], class_cost)
    best = cost[0, last]
    cut1 = -1
    cut2 = -1
    if max_classes >= 2:
        for j in range(1, last):
            c = cost[0, j] + cost[j, last]
            if c < best:
                best, cut1, cut2 = c, -1, j
    if max_classes >= 3:
        for j in range(2, last):
            tail = cost[j, last]
            for i in range(1, j):
                c = cost[0, i] + cost[i, j] + tail
                if c < best:
                    best, cut1, cut2 = c, i, j
    return (cuts[cut1] if cut1 >= 0 else -1), (cuts[cut2] if cut2 >= 0 else -1)


def choose_thresholds(old_bits: np.ndarray, new_bits: np.ndarray, mantissa: int) -> tuple[list[int], int]:
    """Magnitude thresholds (as bit patterns at exponent boundaries) that split the elements into
    at most :data:`MAX_CLASSES` classes with different change rates, chosen to minimise the sum of
    n_c * H(p_c) on a sample (``[]`` for one class), and the sample's estimate of the number of
    changed elements. Only affects size and speed, never correctness."""
    width = old_bits.dtype.itemsize
    size = 1 << (8 * width - 1 - mantissa)
    every = sample_every(old_bits.size)
    n_e = np.zeros((4, size), dtype=np.int64)
    k_e = np.zeros((4, size), dtype=np.int64)
    _nb_histograms(old_bits, new_bits, SAMPLE_BLOCK, every, width_consts(width)[0], np.uint64(mantissa), n_e, k_e)
    return split_classes(n_e.sum(axis=0), k_e.sum(axis=0), every, mantissa)


def sample_every(numel: int) -> int:
    """The threshold sample takes every this-many-th block of :data:`SAMPLE_BLOCK` elements."""
    return max(1, numel // (SAMPLE_BLOCK * SAMPLE_BLOCKS))


def split_classes(n_e: np.ndarray, k_e: np.ndarray, every: int, mantissa: int) -> tuple[list[int], int]:
    """:func:`choose_thresholds` from the sample's exponent histograms (int64, of all elements and
    of the changed ones), each sampled element standing for ``every``."""
    estimate = int(k_e.sum()) * every
    if estimate <= 64:
        return [], estimate
    cut1, cut2 = _nb_split(n_e.astype(np.float64) * every, k_e.astype(np.float64) * every,
                           MAX_CLASSES, float(_CLASS_COST_BITS))
    return [int(c) << mantissa for c in (cut1, cut2) if c >= 0], estimate


def kernel_thresholds(thresholds: list[int]) -> tuple[np.uint64, np.uint64, int]:
    """Up to two thresholds as the kernels' ``(t1, t2, top)``: missing ones at the front are 0
    (nothing is below), so class ``top - below t1 - below t2`` runs from 0 to ``len(thresholds)``."""
    padded = [0] * (2 - len(thresholds)) + list(thresholds)
    return np.uint64(padded[0]), np.uint64(padded[1]), len(thresholds)
