"""Tensors as their bits: unsigned integer views, order-preserving keys and zigzag steps.

Everything the codec does to an element is done to its bit pattern read as an unsigned integer of
the same width, so every pattern (NaN payloads, -0.0, infinities, denormals) is treated exactly.
For floats, :func:`order_keys` maps sign-magnitude bits to integers in value order, so that a move
of one ULP is a step of +-1; :func:`zigzag` then makes a small step of either sign a small number.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
TORCH_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name hashes and delta headers record)."""
    return str(dtype).removeprefix("torch.")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1)


def element_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width (a view where possible).

    Element widths other than 1, 2, 4, 8 bytes (complex128) come back as a uint8 byte view.
    """
    flat = _flat(t)
    size = flat.element_size()
    if size not in TORCH_VIEW:
        return flat.view(torch.uint8).numpy()
    return flat.view(TORCH_VIEW[size]).numpy().view(UINT[size])


def tensor_from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`element_bits`: a tensor of ``dtype`` and ``shape`` over ``bits``."""
    width = bits.dtype.itemsize
    base = torch.from_numpy(bits.view(SINT[width]) if width > 1 else bits)
    return base.view(dtype).reshape(shape)


def le_bytes(bits: np.ndarray) -> memoryview:
    """``bits`` as little-endian bytes (a view on little-endian machines)."""
    if sys.byteorder == "big" and bits.dtype.itemsize > 1:
        bits = bits.byteswap()
    return memoryview(np.ascontiguousarray(bits)).cast("B")


def order_keys(bits: np.ndarray, floating: bool) -> np.ndarray:
    """Order-preserving unsigned keys: for sign-magnitude floats, negatives below positives."""
    if not floating:
        return bits
    sign = bits.dtype.type(1 << (bits.dtype.itemsize * 8 - 1))
    return np.where(bits & sign, ~bits, bits | sign)


def from_order_keys(keys: np.ndarray, floating: bool) -> np.ndarray:
    """Inverse of :func:`order_keys`."""
    if not floating:
        return keys
    sign = keys.dtype.type(1 << (keys.dtype.itemsize * 8 - 1))
    return np.where(keys & sign, keys ^ sign, ~keys)


def zigzag(step: np.ndarray) -> np.ndarray:
    """Wrapped unsigned step -> zigzag unsigned (small magnitudes of either sign stay small)."""
    width = step.dtype.itemsize
    signed = step.view(SINT[width])
    return ((signed << 1) ^ (signed >> (8 * width - 1))).view(UINT[width])


def width_consts(width: int) -> tuple[np.uint64, np.uint64, np.uint64]:
    """``(magnitude mask, sign bit, all bits)`` of an element ``width`` bytes wide."""
    bits = 8 * width
    return np.uint64((1 << (bits - 1)) - 1), np.uint64(1 << (bits - 1)), np.uint64((1 << bits) - 1)


def sparse_capable(t: torch.Tensor) -> bool:
    """Whether a tensor's changes can be coded element by element (scheme ``sparse``): an element
    width with an integer view, and not complex."""
    return t.element_size() in TORCH_VIEW and not t.dtype.is_complex
