"""Whole states: their canonical SHA-256 and full checkpoints (safetensors); the codec's error.

A *state* is a ``dict[str, torch.Tensor]`` (CPU or not; it is read through CPU views). The hash is
what registries, trainers and nodes compare to know two states are the same weights, so this module
must stay cheap to import: it never imports the delta kernels (numba).

Invariant: :func:`state_sha256` is independent of dict order and memory layout, and any bit flip,
rename, dtype or shape change changes it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping

import safetensors.torch
import torch

from flywheel.weights.codec.bitview import dtype_name, element_bits, le_bytes
from flywheel.weights.codec.workers import map_tensors

State = dict[str, torch.Tensor]


class DeltaError(ValueError):
    """A delta (or full checkpoint) is corrupt, truncated, or does not belong to the given base."""


def tensor_digest(t: torch.Tensor) -> bytes:
    """SHA-256 of one tensor's raw little-endian bytes: the inner level of :func:`state_sha256`."""
    return hashlib.sha256(le_bytes(element_bits(t))).digest()


def combine_digests(entries: Iterable[tuple[str, str, tuple[int, ...], int, bytes]]) -> str:
    """The outer level of :func:`state_sha256` from ``(name, dtype name, shape, byte count, tensor
    digest)`` per tensor, in any order: what a reader that streams tensors one at a time (from a
    file, from shards) computes without holding the state."""
    h = hashlib.sha256(b"flywheel-state-v1\x00")
    for name, dtype, shape, nbytes, digest in sorted(entries, key=lambda e: e[0]):
        encoded_name = name.encode("utf-8")
        dtype_bytes = dtype.encode()
        h.update(struct.pack("<I", len(encoded_name)) + encoded_name)
        h.update(struct.pack("<I", len(dtype_bytes)) + dtype_bytes)
        h.update(struct.pack(f"<I{len(shape)}q", len(shape), *shape))
        h.update(struct.pack("<Q", nbytes))
        h.update(digest)
    return h.hexdigest()


def tensor_digests(state: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """Every tensor's :func:`tensor_digest` by name, hashed in parallel: what :func:`state_sha256`
    combines, and what an anchor records per tensor (:func:`.anchor.encode_anchor` takes them)."""
    names = list(state)
    digests = map_tensors(lambda n: tensor_digest(state[n]), names, [state[n].numel() for n in names])
    return dict(zip(names, digests, strict=True))


def state_sha256(state: Mapping[str, torch.Tensor], digests: Mapping[str, bytes] | None = None) -> str:
    """Canonical SHA-256 of a state, independent of dict order and memory layout.

    Two levels, so that tensors hash in parallel: each tensor's raw little-endian bytes are hashed
    on their own (:func:`tensor_digest`), then one SHA-256 covers, for every name in sorted order,
    the name, dtype string, shape, byte count and that tensor digest (:func:`combine_digests`).
    Equal states give equal hashes; any bit flip, rename, dtype or shape change gives a different one.
    ``digests``: the state's :func:`tensor_digests` when the caller already has them (trusted).
    """
    if digests is None:
        digests = tensor_digests(state)
    return combine_digests(
        (n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), digests[n]) for n, t in state.items()
    )


def encode_full(state: Mapping[str, torch.Tensor]) -> bytes:
    """A safetensors file holding ``state`` (tensors that share storage are written separately)."""
    seen: set[int] = set()
    out: State = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return safetensors.torch.save(out)


def decode_full(data: bytes) -> State:
    """Inverse of :func:`encode_full`, tensors in name order (safetensors' own order varies from
    call to call, and a delta's layout follows its input's order); corrupt input raises
    :class:`DeltaError`."""
    try:
        return dict(sorted(safetensors.torch.load(bytes(data)).items()))
    except Exception as exc:  # safetensors raises its own SafetensorError and others on bad input
        raise DeltaError(f"corrupt full checkpoint: {exc}") from exc
