"""The device path: a tensor's changed elements found with torch ops, on the device its weights are on.

:func:`.changes.scan` again, as torch tensor ops, for weights that live on a GPU (a trainer's, a
node's; tensors on a device other than the CPU, or ``device=`` given to
:func:`.delta.encode_delta`): the per-element passes (the class sample's histograms, the change
mask, the ranks, the steps) run on that device (any torch device, ``cpu`` included), and only the
changed elements' gaps and steps, and two small histograms, come back to the CPU. Everything else
stays on the CPU: the Rice, step and zstd coding, the choice of scheme, tensors that cannot be
sparse, hashing, and all of decoding.

Element bits are held as *signed* integers of the element width (the views torch supports
everywhere) and widened to int64 for the arithmetic, with wrapping made explicit, so that every
step equals the numba kernels' to the bit: the delta is the same, byte for byte.
"""

from __future__ import annotations

import numpy as np
import torch

from flywheel.weights.codec.bitview import UINT
from flywheel.weights.codec.changes import Changes
from flywheel.weights.codec.classes import MANTISSA, SAMPLE_BLOCK, sample_every, split_classes

_SIGNED_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements per chunk of the torch scan: bounds its temporaries (a few bytes an element, and five
# more per class threshold) whatever the tensor's size.
TORCH_CHUNK = 1 << 24


def _signed_bits(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s elements as flat signed integers of the same width on ``device``."""
    flat = t.detach().to(device).contiguous().reshape(-1)
    return flat.view(_SIGNED_VIEW[flat.element_size()])


def _wrap(x: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 values reduced modulo ``2**bits`` to the signed range of that width (int64 arithmetic
    already wraps at 64 bits)."""
    if bits == 64:
        return x
    half = 1 << (bits - 1)
    return ((x + half) & ((1 << bits) - 1)) - half


def _torch_steps(a: torch.Tensor, b: torch.Tensor, floating: bool) -> torch.Tensor:
    """Zigzag coded steps from ``a`` to ``b`` (signed views of changed elements) in the
    order-preserving view, as in :func:`.kernels.nb_scan`; returned as the same signed view (the bits of the
    numba kernels' unsigned steps)."""
    bits = 8 * a.element_size()
    x, y = a.long(), b.long()
    if floating:  # sign-magnitude to monotone: negative values flip their magnitude bits
        magnitude = (1 << (bits - 1)) - 1
        x = x ^ ((x >> 63) & magnitude)
        y = y ^ ((y >> 63) & magnitude)
    s = _wrap(y - x, bits)
    return _wrap((s << 1) ^ (s >> 63), bits).to(a.dtype)


def _torch_thresholds(a: torch.Tensor, b: torch.Tensor, mantissa: int) -> list[int]:
    """:func:`.classes.choose_thresholds` on the device: the same sample of blocks, exponent histograms
    by ``bincount``; the split itself runs on the CPU."""
    numel = a.numel()
    every = sample_every(numel)
    stride = SAMPLE_BLOCK * every
    if every > 1:  # every ``every``-th block: the first block of each stride, and of the tail
        rows = numel // stride

        def sample(x: torch.Tensor) -> torch.Tensor:
            head = x[: rows * stride].view(rows, stride)[:, :SAMPLE_BLOCK].reshape(-1)
            return torch.cat([head, x[rows * stride : rows * stride + SAMPLE_BLOCK]])

        a, b = sample(a), sample(b)
    bits = 8 * a.element_size()
    size = 1 << (bits - 1 - mantissa)
    exponent = ((a & ((1 << (bits - 1)) - 1)) >> mantissa).long()
    n_e = torch.bincount(exponent, minlength=size)
    k_e = torch.bincount(exponent[a != b], minlength=size)
    return split_classes(n_e.cpu().numpy(), k_e.cpu().numpy(), every, mantissa)[0]


def scan_torch(old: torch.Tensor, new: torch.Tensor, device: torch.device) -> Changes:
    """What :func:`.changes.scan` finds, computed with torch on ``device`` (any device torch runs on; the
    tensors are moved there if they are elsewhere). A changed element's class is the number of
    thresholds at or below its old magnitude, its rank the members of its class before it: counts
    of the elements below each threshold, by prefix sums over chunks of the tensor."""
    a, b = _signed_bits(old, device), _signed_bits(new, device)
    bits = 8 * a.element_size()
    floating = new.dtype.is_floating_point
    mantissa = MANTISSA.get(new.dtype)
    thresholds = _torch_thresholds(a, b, mantissa) if mantissa is not None else []
    classes = len(thresholds) + 1
    below_before = [torch.zeros((), dtype=torch.int64, device=device) for _ in thresholds]
    ranks: list[list[torch.Tensor]] = [[] for _ in range(classes)]
    steps: list[list[torch.Tensor]] = [[] for _ in range(classes)]
    for start in range(0, a.numel(), TORCH_CHUNK):
        ca, cb = a[start : start + TORCH_CHUNK], b[start : start + TORCH_CHUNK]
        at = torch.nonzero(ca != cb).reshape(-1)
        # bounds[j + 1]: the elements before each change that are below thresholds[j]; bounds[0]
        # and bounds[-1] those below -inf and +inf (none, all). Class c's members before a change
        # are bounds[c + 1] - bounds[c].
        bounds = [torch.zeros_like(at)]
        cls = torch.zeros_like(at)
        if thresholds:
            magnitude = ca & ((1 << (bits - 1)) - 1)
        for j, threshold in enumerate(thresholds):
            below = magnitude < threshold
            counts = torch.cumsum(below, 0, dtype=torch.int32)
            bounds.append((counts[at] - below[at].int()).long() + below_before[j])
            cls += ~below[at]
            below_before[j] = below_before[j] + counts[-1]
        bounds.append(at + start)
        step = _torch_steps(ca[at], cb[at], floating)
        for c in range(classes):
            member = cls == c
            ranks[c].append((bounds[c + 1] - bounds[c])[member])
            steps[c].append(step[member])
    gaps: list[np.ndarray] = []
    out_steps: list[np.ndarray] = []
    for c in range(classes):
        rank = torch.cat(ranks[c])
        gap = torch.diff(rank, prepend=rank.new_full((1,), -1)) - 1
        gaps.append(gap.cpu().numpy().view(np.uint64))
        out_steps.append(torch.cat(steps[c]).cpu().numpy().view(UINT[a.element_size()]))
    return Changes(thresholds, gaps, out_steps)
