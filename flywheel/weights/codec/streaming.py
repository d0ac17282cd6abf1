"""Deltas between safetensors files, tensor by tensor: encode and apply in bounded memory.

:func:`diff_files` is :func:`.delta.encode_delta` on two files and gives the same bytes (tensors in
name order, as :func:`.state.decode_full` returns them); :func:`apply_files` is
:func:`.delta.apply_delta` from a file into a file. Neither ever holds a state: each tensor is read
(:mod:`.tensorfile`), hashed, coded and dropped on the codec's thread pool, so peak memory is the
interpreter plus a few of the largest tensors per thread plus the delta itself, whatever the
model's size. Both hashes are computed in the same pass (the state hash is two-level, a digest per
tensor, see :func:`.state.combine_digests`), so every byte of both files is read once.

Invariant, as for :func:`.delta.apply_delta`: :func:`apply_files` returns normally only when the
file it wrote rebuilds the delta's target hash from a base with the delta's base hash; otherwise
it raises :class:`.state.DeltaError` and the caller discards the file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from flywheel.weights.codec.bitview import dtype_name
from flywheel.weights.codec.container import check_entry, pack_container, read_delta_header
from flywheel.weights.codec.state import DeltaError, combine_digests, tensor_digest
from flywheel.weights.codec.tensorfile import TensorReader, TensorWriter, scratch
from flywheel.weights.codec.workers import map_tensors

Digest = tuple[str, str, tuple[int, ...], int, bytes]


def _digest(name: str, t: torch.Tensor) -> Digest:
    """What :func:`.state.combine_digests` takes for one tensor."""
    return name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), tensor_digest(t)


@contextlib.contextmanager
def _none() -> Iterator[None]:
    """A base tensor that is not there."""
    yield None


def _hash_all(reader: TensorReader, names: list[str]) -> list[Digest]:
    """The digests of ``names`` in ``reader``'s file, read and hashed on the thread pool."""
    def one(name: str) -> Digest:
        with reader.view(name) as t:
            return _digest(name, t)

    return map_tensors(one, names, [reader.index[n].numel for n in names])


def diff_files(old_path: str | os.PathLike[str], new_path: str | os.PathLike[str], *,
               device: torch.device | None = None) -> tuple[bytes, dict[str, Any]]:
    """The delta that turns the state in ``old_path`` into the one in ``new_path`` (byte for byte
    :func:`.delta.encode_delta` of the two states), and a summary: ``elements``, ``changed``,
    ``bytes_full`` (the target's tensor bytes). ``device``: as :func:`.delta.encode_delta`."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import encode_tensor

    with TensorReader(old_path) as old, TensorReader(new_path) as new:
        names = sorted(new.index)

        def encode(name: str) -> tuple[dict[str, Any], list[bytes], Digest, Digest | None]:
            with new.view(name) as target, (old.view(name) if name in old.index else _none()) as base:
                entry, blobs = encode_tensor(name, base, target, device)
                base_digest = _digest(name, base) if base is not None else None
                return entry, blobs, _digest(name, target), base_digest

        results = map_tensors(encode, names, [new.index[n].numel for n in names])
        only_old = sorted(set(old.index) - set(new.index))
        old_digests = [d for *_, d in results if d is not None]
        old_digests += _hash_all(old, only_old)
        header = {
            "base_sha256": combine_digests(old_digests),
            "target_sha256": combine_digests(d for _, _, d, _ in results),
            "tensors": [{k: v for k, v in e.items() if k != "elements"} for e, *_ in results],
        }
        delta = pack_container(header, (blob for _, blobs, *_ in results for blob in blobs))
        summary = {"elements": sum(e["elements"] for e, *_ in results),
                   "changed": sum(e["changed"] for e, *_ in results),
                   "bytes_full": sum(new.index[n].nbytes for n in names)}
    return delta, summary


def apply_files(old_path: str | os.PathLike[str], delta: bytes | memoryview, out_fd: int) -> str:
    """Rebuild the delta's target from the base in ``old_path`` into the file open at ``out_fd``
    (a safetensors file, tensors in the delta's order); returns the target's hash, verified, or
    raises :class:`DeltaError` (the base is not the delta's, the delta is corrupt)."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import decode_tensor

    header, offset = read_delta_header(delta)
    view = memoryview(delta)
    jobs: list[tuple[dict[str, Any], memoryview, int]] = []
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for entry in header.tensors:
        name, dtype, shape, scheme = check_entry(entry)
        length = 0 if scheme == "same" else entry["len"]
        if offset + length > len(view):
            raise DeltaError(f"truncated delta: payload of tensor {name!r} runs past the end")
        jobs.append((entry, view[offset : offset + length], math.prod(shape) * dtype.itemsize))
        layout.append((name, dtype, shape))
        offset += length
    if offset != len(view):
        raise DeltaError(f"delta has {len(view) - offset} unexpected trailing bytes")
    if len({n for n, _, _ in layout}) != len(layout):
        raise DeltaError("delta header names a tensor twice")
    with TensorReader(old_path) as old:
        writer = TensorWriter(out_fd, layout)

        def decode(job: tuple[dict[str, Any], memoryview, int]) -> tuple[Digest, Digest | None]:
            entry, blob, nbytes = job
            name = entry["name"]
            with old.view(name) if name in old.index else _none() as base:
                base_digest = _digest(name, base) if base is not None else None
                try:
                    target = decode_tensor((entry, blob, base), scratch(nbytes))
                except DeltaError:
                    raise
                except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as exc:
                    raise DeltaError(f"corrupt delta: {type(exc).__name__}: {exc}") from exc
            writer.write(name, target)
            if entry["scheme"] == "same" and base_digest is not None:  # the same bits: the same digest
                return base_digest, base_digest
            return _digest(name, target), base_digest

        sizes = [math.prod(shape) for _, _, shape in layout]
        failure: DeltaError | None = None
        try:
            results = map_tensors(decode, jobs, sizes)
        except DeltaError as exc:  # reported below, unless the base was the wrong one
            failure, results = exc, []
        if failure is not None:  # hash the whole base to tell "wrong base" from "corrupt delta"
            base_digests = _hash_all(old, sorted(old.index))
        else:
            base_digests = [b for _, b in results if b is not None]
            base_digests += _hash_all(old, sorted(set(old.index) - {name for name, _, _ in layout}))
    base_hash = combine_digests(base_digests)
    if base_hash != header.base_sha256:
        raise DeltaError(f"delta is for a different parent (base {header.base_sha256[:12]}, given {base_hash[:12]})")
    if failure is not None:
        raise failure
    writer.close()
    got = combine_digests(t for t, _ in results)
    if got != header.target_sha256:
        raise DeltaError(
            f"reconstructed state hash {got[:12]} does not match the delta's target {header.target_sha256[:12]}"
        )
    return got
