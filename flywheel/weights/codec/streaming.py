"""Deltas between safetensors files, tensor by tensor: encode and apply in bounded memory.

:func:`diff_files` is :func:`.delta.encode_delta` on two files and gives the same bytes (tensors in
name order, as :func:`.state.decode_full` returns them); :func:`apply_files` is
:func:`.delta.apply_delta` from a file into a file; :func:`apply_into` is its core, from any
reader (several files, a subset of their tensors: a shard's base) into any writer (several
deltas into one file: a sharded version). None ever holds a state: each tensor is read
(:mod:`.tensorfile`), hashed, coded and dropped on the codec's thread pool, so peak memory is the
interpreter plus a few of the largest tensors per thread plus the delta itself, whatever the
model's size. Both hashes are computed in the same pass (the state hash is two-level, a digest per
tensor, see :func:`.state.combine_digests`), so every byte of both files is read once.

Invariant, as for :func:`.delta.apply_delta`: :func:`apply_files` and :func:`apply_into` return
normally only when what they wrote rebuilds the delta's target hash from a base with the delta's
base hash; otherwise they raise :class:`.state.DeltaError` and the caller discards the file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from flywheel.weights.codec.bitview import dtype_name
from flywheel.weights.codec.container import check_entry, pack_container, read_delta_header
from flywheel.weights.codec.state import DeltaError, combine_digests, tensor_digest
from flywheel.weights.codec.tensorfile import Discard, TensorInfo, TensorReader, TensorWriter, scratch
from flywheel.weights.codec.workers import map_tensors

Digest = tuple[str, str, tuple[int, ...], int, bytes]
#: A tensor as a file lays it out: name, dtype, shape.
Layout = tuple[str, torch.dtype, tuple[int, ...]]
#: One tensor of a delta: its header entry, its payload, its layout.
_Job = tuple[dict[str, Any], memoryview, Layout]


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


def delta_layout(delta: bytes | memoryview) -> list[Layout]:
    """The target's tensors as a delta lays them out (its order): what :class:`.tensorfile.TensorWriter` takes."""
    return [layout for _, _, layout in _delta_jobs(delta)[1]]


def _delta_jobs(delta: bytes | memoryview) -> tuple[Any, list[_Job]]:
    """The delta's header, and per tensor its entry, payload and ``(name, dtype, shape)``; checked."""
    header, offset = read_delta_header(delta)
    view = memoryview(delta)
    jobs = []
    for entry in header.tensors:
        name, dtype, shape, scheme = check_entry(entry)
        length = 0 if scheme == "same" else entry["len"]
        if offset + length > len(view):
            raise DeltaError(f"truncated delta: payload of tensor {name!r} runs past the end")
        jobs.append((entry, view[offset : offset + length], (name, dtype, shape)))
        offset += length
    if offset != len(view):
        raise DeltaError(f"delta has {len(view) - offset} unexpected trailing bytes")
    if len({layout[0] for _, _, layout in jobs}) != len(jobs):
        raise DeltaError("delta header names a tensor twice")
    return header, jobs


def apply_into(old: Any, delta: bytes | memoryview, writer: Any, *, base_names: Iterable[str] | None = None,
               base_sha256: str | None = None) -> str:
    """Decode the delta's tensors on the base in ``old`` (a :class:`.tensorfile.TensorReader` or
    :class:`.tensorfile.TensorFiles`; ``base_names``: the base is these of its tensors, default all)
    and write each into ``writer``, whose layout must hold them with their dtypes and shapes.
    ``base_sha256``: the base's hash when the caller has verified it (it is then not hashed again).
    Returns the target's hash, verified; raises :class:`DeltaError` when the base is not the
    delta's or the delta is corrupt (the caller discards what was written)."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import decode_tensor

    header, jobs = _delta_jobs(delta)
    base = set(old.index) if base_names is None else set(base_names)
    if missing := sorted(base - set(old.index)):
        raise DeltaError(f"the base lacks tensor {missing[0]!r}")
    for _, _, (name, dtype, shape) in jobs:
        if writer.layout.get(name) != (dtype, shape):
            raise DeltaError(f"tensor {name!r} is not laid out as {dtype_name(dtype)} {list(shape)} in the output")

    if base_sha256 is not None and base_sha256 != header.base_sha256:
        raise DeltaError(f"delta is for a different parent (base {header.base_sha256[:12]}, given {base_sha256[:12]})")

    def decode(job: _Job) -> tuple[Digest, Digest | None]:
        entry, blob, (name, dtype, shape) = job
        with old.view(name) if name in base else _none() as prior:
            base_digest = _digest(name, prior) if prior is not None and base_sha256 is None else None
            try:
                target = decode_tensor((entry, blob, prior), scratch(math.prod(shape) * dtype.itemsize))
            except DeltaError:
                raise
            except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as exc:
                raise DeltaError(f"corrupt delta: {type(exc).__name__}: {exc}") from exc
            writer.write(name, target)
            if entry["scheme"] == "same" and base_digest is not None:  # the same bits: the same digest
                return base_digest, base_digest
            return _digest(name, target), base_digest

    failure: DeltaError | None = None
    try:
        results = map_tensors(decode, jobs, [math.prod(shape) for *_, (_, _, shape) in jobs])
    except DeltaError as exc:  # reported below, unless the base was the wrong one
        failure, results = exc, []
    if base_sha256 is not None:
        base_hash = base_sha256
    elif failure is not None:  # hash the whole base to tell "wrong base" from "corrupt delta"
        base_hash = combine_digests(_hash_all(old, sorted(base)))
    else:
        base_digests = [b for _, b in results if b is not None]
        base_digests += _hash_all(old, sorted(base - {layout[0] for *_, layout in jobs}))
        base_hash = combine_digests(base_digests)
    if base_hash != header.base_sha256:
        raise DeltaError(f"delta is for a different parent (base {header.base_sha256[:12]}, given {base_hash[:12]})")
    if failure is not None:
        raise failure
    got = combine_digests(t for t, _ in results)
    if got != header.target_sha256:
        raise DeltaError(
            f"reconstructed state hash {got[:12]} does not match the delta's target {header.target_sha256[:12]}"
        )
    return got


def apply_files(old_path: str | os.PathLike[str], delta: bytes | memoryview, out_fd: int) -> str:
    """Rebuild the delta's target from the base in ``old_path`` into the file open at ``out_fd``
    (a safetensors file, tensors in the delta's order); returns the target's hash, verified, or
    raises :class:`DeltaError` (the base is not the delta's, the delta is corrupt)."""
    writer = TensorWriter(out_fd, delta_layout(delta))
    with TensorReader(old_path) as old:
        got = apply_into(old, delta, writer)
    writer.close()
    return got


def files_sha256(files: Any) -> str:
    """The state hash (:func:`.state.state_sha256`) of every tensor in ``files`` (a
    :class:`.tensorfile.TensorReader` or :class:`.tensorfile.TensorFiles`), read tensor by tensor."""
    return combine_digests(_hash_all(files, sorted(files.index)))


class _StateReader:
    """A state in memory as :func:`apply_into` reads a base (``index``, ``view``)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state
        self.index = {n: TensorInfo(n, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()) for n, t in state.items()}

    @contextlib.contextmanager
    def view(self, name: str) -> Iterator[torch.Tensor]:
        yield self._state[name].detach().cpu().contiguous()


def check_delta(old: Mapping[str, torch.Tensor], delta: bytes | memoryview, *, old_sha256: str) -> str:
    """:func:`.delta.apply_delta`'s checks without keeping its result: each tensor is decoded on
    ``old`` (whose hash ``old_sha256`` the caller verified), hashed and dropped, so the check holds
    a few tensors, not a second state. Returns the target hash, verified, or raises :class:`DeltaError`."""
    return apply_into(_StateReader(old), delta, Discard(delta_layout(delta)), base_sha256=old_sha256)
