"""Deltas between safetensors files, tensor by tensor: encode and apply in bounded memory.

:func:`diff_files` is :func:`.delta.encode_delta` on two files and gives the same bytes (tensors in
name order, as :func:`.state.decode_full` returns them); :func:`apply_files` is
:func:`.delta.apply_delta` from a file into a file; :func:`apply_chain` is their core: a chain of
deltas (each version's one delta, or its shards, each on a subset of the state before it) from any
reader (several files) into any writer, every tensor taken through the whole chain on one thread
before it is written, so the versions between are never written; :func:`apply_into` is a chain of
one delta. None ever holds a state: each tensor is read
(:mod:`.tensorfile`), hashed, coded and dropped on the codec's thread pool, so peak memory is the
interpreter plus a few of the largest tensors per thread plus the delta itself, whatever the
model's size. A diff computes both hashes in the same pass (the state hash is two-level, a digest
per tensor, see :func:`.state.combine_digests`), so every byte of both files is read once; an
apply hashes what it writes only, once however long the chain (see :func:`apply_chain`).

Invariant, as for :func:`.delta.apply_delta`: :func:`apply_files`, :func:`apply_into` and
:func:`apply_chain` return normally only when what they wrote hashes to the last delta's target
(each part's and the whole's); otherwise they raise :class:`.state.DeltaError` (from
:func:`apply_chain`, a :class:`StepError` naming the step) and the caller discards the file. A
wrong base or a corrupt delta anywhere in a chain gives a wrong target, unless the chain rewrites
every byte where the base differs, and then what was written is the target all the same.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.weights.codec.bitview import dtype_name
from flywheel.weights.codec.container import check_entry, pack_container, read_delta_header
from flywheel.weights.codec.state import DeltaError, combine_digests, tensor_digest
from flywheel.weights.codec.tensorfile import Discard, StateReader, TensorReader, TensorWriter, scratch
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


def tensor_entries(files: Any, names: Iterable[str] | None = None) -> list[Digest]:
    """What :func:`.state.combine_digests` takes for ``names`` (all, in name order, by default) of
    ``files`` (a :class:`.tensorfile.TensorReader`, :class:`.tensorfile.TensorFiles` or
    :class:`.tensorfile.StateReader`), read and hashed on the thread pool."""
    names = sorted(files.index) if names is None else list(names)

    def one(name: str) -> Digest:
        with files.view(name) as t:
            return _digest(name, t)

    return map_tensors(one, names, [files.index[n].numel for n in names])


def diff_files(old_path: str | os.PathLike[str], new_path: str | os.PathLike[str], *,
               device: torch.device | None = None) -> tuple[bytes, dict[str, Any]]:
    """The delta that turns the state in ``old_path`` into the one in ``new_path`` (byte for byte
    :func:`.delta.encode_delta` of the two states), and its summary (:func:`diff_readers`)."""
    with TensorReader(old_path) as old, TensorReader(new_path) as new:
        return diff_readers(old, new, device=device)


def diff_readers(old: Any, new: Any, *, device: torch.device | None = None) -> tuple[bytes, dict[str, Any]]:
    """:func:`diff_files` between any two readers (``index``, ``view``: files or a state in
    memory). The summary: ``elements``, ``changed``, ``bytes_full`` (the target's tensor bytes),
    ``digests`` (the target's :func:`tensor_entries`, computed in the same pass). ``device``: as
    :func:`.delta.encode_delta`."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import encode_tensor

    names = sorted(new.index)

    def encode(name: str) -> tuple[dict[str, Any], list[bytes], Digest, Digest | None]:
        with new.view(name) as target, (old.view(name) if name in old.index else _none()) as base:
            entry, blobs = encode_tensor(name, base, target, device)
            base_digest = _digest(name, base) if base is not None else None
            return entry, blobs, _digest(name, target), base_digest

    results = map_tensors(encode, names, [new.index[n].numel for n in names])
    old_digests = [d for *_, d in results if d is not None]
    old_digests += tensor_entries(old, sorted(set(old.index) - set(new.index)))
    header = {
        "base_sha256": combine_digests(old_digests),
        "target_sha256": combine_digests(d for _, _, d, _ in results),
        "tensors": [{k: v for k, v in e.items() if k != "elements"} for e, *_ in results],
    }
    delta = pack_container(header, (blob for _, blobs, *_ in results for blob in blobs))
    summary = {"elements": sum(e["elements"] for e, *_ in results),
               "changed": sum(e["changed"] for e, *_ in results),
               "bytes_full": sum(new.index[n].nbytes for n in names),
               "digests": [d for _, _, d, _ in results]}
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


@dataclass(frozen=True)
class Step:
    """One version's change for :func:`apply_chain`: its delta containers (one delta, or a sharded
    version's shards), each with the names that are its base, those of them the state before the
    step has (``None``: all of that state; a shard names its own tensors, and one it adds has no
    base); and the whole state's hashes before and after the step where the caller knows them (a
    sharded version's manifest; a lone delta's header says them itself)."""

    parts: Sequence[tuple[bytes | memoryview, Iterable[str] | None]]
    base_sha256: str | None = None
    sha256: str | None = None


class StepError(DeltaError):
    """An :func:`apply_chain` failure, and the index of the step it blames."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class _Parsed:
    """A :class:`Step` read: per part its header and base names; the target's jobs by name, with
    the index of the part that holds each."""

    headers: list[Any]
    bases: list[set[str]]
    jobs: dict[str, tuple[_Job, int]]


def _parse(index: int, step: Step, before: set[str]) -> _Parsed:
    headers, bases, jobs = [], [], {}
    try:
        for part, (delta, base_names) in enumerate(step.parts):
            header, part_jobs = _delta_jobs(delta)
            base = set(before) if base_names is None else before & set(base_names)
            for job in part_jobs:
                if job[2][0] in jobs:
                    raise DeltaError(f"tensor {job[2][0]!r} is in two parts of one step")
                jobs[job[2][0]] = (job, part)
            headers.append(header)
            bases.append(base)
    except DeltaError as exc:
        raise StepError(index, str(exc)) from exc
    return _Parsed(headers, bases, jobs)


def _decode(job: _Job, prior: torch.Tensor | None, slot: int) -> torch.Tensor:
    """One tensor of a delta decoded on ``prior`` into this thread's buffer ``slot``; a failure of
    any kind is a :class:`DeltaError`."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import decode_tensor

    entry, blob, (_, dtype, shape) = job
    try:
        return decode_tensor((entry, blob, prior), scratch(math.prod(shape) * dtype.itemsize, slot))
    except DeltaError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as exc:
        raise DeltaError(f"corrupt delta: {type(exc).__name__}: {exc}") from exc


def apply_chain(old: Any, steps: Sequence[Step], writer: Any, *, base_sha256: str | None = None,
                every_step: bool = False) -> str:
    """Decode ``steps`` one after the other on the base in ``old`` (a :class:`.tensorfile.TensorReader`
    or :class:`.tensorfile.TensorFiles`) and write the last step's tensors into ``writer``, whose
    layout must hold them with their dtypes and shapes. Each tensor goes through the whole chain on
    one thread, between two reused buffers, so the intermediate states are never written or held:
    memory is a few tensors per thread and the deltas, whatever the chain's length.
    ``base_sha256``: the base's hash when the caller has verified it (the first step's headers must
    name it; the first step's parts must then take the whole base).

    Returns the last step's state hash, verified: each of its parts' target hashes and its own
    (``Step.sha256``) are checked against what was written, which a wrong base or any corrupt step
    cannot pass (SHA-256), so the base and the states between are not hashed: one hash per tensor,
    not one per step. When that check fails, the pass runs again with ``every_step`` (each step
    checked as if applied alone: its base's hashes, each part's and the whole's where known, then
    its decoding, then its target's), to raise :class:`StepError` for the first step that fails (a
    wrong base is blamed on the step whose base it is, before a corrupt delta); the caller discards
    what was written."""
    if not steps:
        raise ValueError("apply_chain needs at least one step")
    levels = [set(old.index)]
    parsed: list[_Parsed] = []
    for i, step in enumerate(steps):
        parsed.append(_parse(i, step, levels[-1]))
        levels.append(set(parsed[-1].jobs))
    last = len(steps) - 1
    for name, ((_, _, (_, dtype, shape)), _) in parsed[-1].jobs.items():
        if writer.layout.get(name) != (dtype, shape):
            raise StepError(last, f"tensor {name!r} is not laid out as {dtype_name(dtype)} {list(shape)} in the output")
    whole_base = steps[0].base_sha256 is not None or any(b is None for _, b in steps[0].parts)
    if base_sha256 is not None:
        if not all(b is None for _, b in steps[0].parts):
            raise ValueError("a verified base_sha256 needs a first step whose parts take the whole base")
        for want in [h.base_sha256 for h in parsed[0].headers] + [steps[0].base_sha256 or base_sha256]:
            if want != base_sha256:
                raise StepError(0, f"delta is for a different parent (base {want[:12]}, given {base_sha256[:12]})")
    first = levels[0] if whole_base else set().union(*parsed[0].bases)
    names = sorted(first | set().union(*levels[1:]))

    def lineage(name: str) -> tuple[list[Digest | None], tuple[int, DeltaError] | None]:
        digests: list[Digest | None] = [None] * (len(steps) + 1)
        with old.view(name) if name in first else _none() as current:
            if current is not None and base_sha256 is None and every_step:
                digests[0] = _digest(name, current)
            for i, step in enumerate(parsed):
                found = step.jobs.get(name)
                if found is None:
                    current = None
                    continue
                job, part = found
                prior = current if name in step.bases[part] else None
                try:
                    current = _decode(job, prior, i % 2)
                except DeltaError as exc:
                    return digests, (i, exc)
                if every_step or i == last:
                    same = job[0]["scheme"] == "same" and prior is not None and digests[i] is not None
                    digests[i + 1] = digests[i] if same else _digest(name, current)
            if current is not None:
                writer.write(name, current)
        return digests, None

    results = dict(zip(names, map_tensors(lineage, names, [_numel(old, parsed, n) for n in names]), strict=True))
    failures: dict[int, DeltaError] = {}
    for _, failure in results.values():
        if failure is not None:
            failures.setdefault(*failure)

    def target(i: int) -> str:
        """Step ``i``'s state hash from what was decoded, checked against its parts' and its own."""
        read = parsed[i]
        after = {n: results[n][0][i + 1] for n in read.jobs}
        got = combine_digests(after.values())
        targets = [(h.target_sha256, combine_digests(after[n] for n, (_, part) in read.jobs.items() if part == p)
                    if len(read.headers) > 1 else got) for p, h in enumerate(read.headers)]
        for want, have in targets + ([(steps[i].sha256, got)] if steps[i].sha256 is not None else []):
            if have != want:
                raise StepError(i, f"reconstructed state hash {have[:12]} does not match the delta's target {want[:12]}")
        return got

    if not every_step:
        try:
            if not failures:
                return target(last)
        except StepError:
            pass
        # Something is wrong: run again, every step checked, to blame the right one.
        return apply_chain(old, steps, writer, base_sha256=base_sha256, every_step=True)
    got = ""
    for i, (step, read) in enumerate(zip(steps, parsed, strict=True)):
        level = [d for d in (results[n][0][i] for n in sorted(levels[i])) if d is not None]
        if i > 0 or base_sha256 is None:
            bases = [(h.base_sha256, [results[n][0][i] for n in sorted(b)]) for h, b in zip(read.headers, read.bases,
                                                                                              strict=True)]
            if step.base_sha256 is not None:
                bases.append((step.base_sha256, level))
            for want, digests in bases:
                have = combine_digests(d for d in digests if d is not None)
                if have != want:
                    raise StepError(i, f"delta is for a different parent (base {want[:12]}, given {have[:12]})")
        if i in failures:
            raise StepError(i, str(failures[i])) from failures[i]
        got = target(i)
    return got


def _numel(old: Any, parsed: list[_Parsed], name: str) -> int:
    """A tensor's elements, for the thread pool's order: the base's, else the first step's that makes it."""
    if name in old.index:
        return old.index[name].numel
    return next(math.prod(p.jobs[name][0][2][2]) for p in parsed if name in p.jobs)


def apply_into(old: Any, delta: bytes | memoryview, writer: Any, *, base_sha256: str | None = None) -> str:
    """One delta (:func:`apply_chain` of one step) decoded on the base in ``old`` into ``writer``;
    returns the target's hash, verified, or raises :class:`DeltaError` (the base is not the
    delta's, the delta is corrupt)."""
    return apply_chain(old, [Step([(delta, None)])], writer, base_sha256=base_sha256)


def apply_files(old_path: str | os.PathLike[str], delta: bytes | memoryview, out_fd: int, *,
                direct: bool = False) -> str:
    """Rebuild the delta's target from the base in ``old_path`` into the file open at ``out_fd``
    (a safetensors file, tensors in the delta's order); returns the target's hash, verified, or
    raises :class:`DeltaError` (the base is not the delta's, the delta is corrupt). ``direct``: as
    :class:`.tensorfile.TensorWriter`."""
    writer = TensorWriter(out_fd, delta_layout(delta), direct=direct)
    with TensorReader(old_path) as old:
        got = apply_into(old, delta, writer)
    writer.close()
    return got


def files_sha256(files: Any) -> str:
    """The state hash (:func:`.state.state_sha256`) of every tensor in ``files`` (a
    :class:`.tensorfile.TensorReader` or :class:`.tensorfile.TensorFiles`), read tensor by tensor."""
    return combine_digests(tensor_entries(files))


def check_delta(old: Mapping[str, torch.Tensor], delta: bytes | memoryview, *, old_sha256: str) -> str:
    """:func:`.delta.apply_delta`'s checks without keeping its result: each tensor is decoded on
    ``old`` (whose hash ``old_sha256`` the caller verified), hashed and dropped, so the check holds
    a few tensors, not a second state. Returns the target hash, verified, or raises :class:`DeltaError`."""
    return apply_into(StateReader(old), delta, Discard(delta_layout(delta)), base_sha256=old_sha256)
