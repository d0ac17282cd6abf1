"""Lossless deltas between two states: encode, apply (verified), and the device argument.

The public delta API. Importing it is cheap: the compiled side (:mod:`.tensor_coding` and, through
it, numba and the kernels) is imported inside :func:`encode_delta_with_summary` and
:func:`decode_unverified`, so a process pays for numba only when it first encodes or applies a
delta. Tensors are coded on a small thread pool (the kernels and zstd release the GIL), largest
first; the container and its schemes are described in :mod:`.container`.

Invariants: :func:`apply_delta` either returns exactly the target state (its hash is checked against
the recorded target hash) or raises :class:`DeltaError`; it never returns wrong weights. It also
refuses a base whose hash is not the recorded base hash. Every ``device`` gives the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flywheel.weights.codec.container import check_entry, pack_container, read_delta_header
from flywheel.weights.codec.state import DeltaError, State, state_sha256
from flywheel.weights.codec.workers import map_tensors


@dataclass(frozen=True)
class DeltaSummary:
    """What :func:`encode_delta_with_summary` learned while encoding."""

    elements: int
    changed: int
    tensors: list[dict[str, Any]]

    @property
    def fraction_changed(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def resolve_device(name: str) -> torch.device | None:
    """The ``device`` argument of :func:`encode_delta` for a command line's ``--device``: ``cpu``
    the numba kernels (None), ``cuda`` or ``cuda:N`` that GPU, ``auto`` a GPU when there is one.
    An unknown name or a GPU that is not there raises :class:`ValueError` with a message for a person.
    """
    if name == "cpu":
        return None
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise ValueError(f"unknown device {name!r} (expected cpu, cuda, cuda:N or auto)")
    if not torch.cuda.is_available():
        built = "with" if torch.backends.cuda.is_built() else "without"
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here "
                         f"(torch {torch.__version__}, built {built} CUDA)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} asked for, but there are only {torch.cuda.device_count()} CUDA devices")
    return device


def encode_delta_with_summary(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    old_sha256: str | None = None,
    new_sha256: str | None = None,
    device: str | torch.device | None = None,
) -> tuple[bytes, DeltaSummary]:
    """:func:`encode_delta`, also returning element counts and per-tensor entries.

    ``old_sha256`` / ``new_sha256``: the states' :func:`state_sha256` when the caller already has
    them (saves hashing twice); a wrong value only makes the delta unusable, never wrong.
    ``device``: as :func:`encode_delta`.
    """
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import encode_tensor

    names = list(new)
    total = sum(new[n].numel() for n in names)
    chosen = None if device is None else torch.device(device)

    def encode(name: str) -> tuple[dict[str, Any], list[bytes]]:
        t = new[name]
        where = chosen if chosen is not None or t.device.type == "cpu" else t.device
        return encode_tensor(name, old.get(name), t, where)

    results = map_tensors(encode, names, [new[n].numel() for n in names])
    entries = [entry for entry, _ in results]
    header = {
        "base_sha256": old_sha256 if old_sha256 is not None else state_sha256(old),
        "target_sha256": new_sha256 if new_sha256 is not None else state_sha256(new),
        "tensors": [{k: v for k, v in e.items() if k != "elements"} for e in entries],
    }
    delta = pack_container(header, (blob for _, blobs in results for blob in blobs))
    summary = DeltaSummary(
        elements=total, changed=sum(e["changed"] for e in entries), tensors=entries
    )
    return delta, summary


def encode_delta(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, device: str | torch.device | None = None
) -> bytes:
    """A self-describing lossless delta that turns ``old`` (the base) into ``new`` (the target).

    ``device``: the torch device that finds the changed elements (tensors elsewhere are copied
    there, one at a time); by default the numba kernels do for tensors on the CPU and torch on the
    device of any other. Every choice gives the same bytes.
    """
    return encode_delta_with_summary(old, new, device=device)[0]


def decode_unverified(old: Mapping[str, torch.Tensor], delta: bytes | memoryview) -> State:
    """The state a delta describes on top of ``old``, WITHOUT checking either hash: the decoding
    work of :func:`apply_delta` alone (for benchmarks). Use :func:`apply_delta` to load weights."""
    # The compiled side (numba and the kernels), imported on first use.
    from flywheel.weights.codec.tensor_coding import decode_tensor

    header, offset = read_delta_header(delta)
    view = memoryview(delta)
    jobs = []
    names: list[str] = []
    sizes: list[int] = []
    for entry in header.tensors:
        name, _, shape, scheme = check_entry(entry)
        length = 0 if scheme == "same" else entry["len"]
        if offset + length > len(view):
            raise DeltaError(f"truncated delta: payload of tensor {name!r} runs past the end")
        jobs.append((entry, view[offset : offset + length], old.get(name)))
        names.append(name)
        offset += length
        sizes.append(math.prod(shape))
    if offset != len(view):
        raise DeltaError(f"delta has {len(view) - offset} unexpected trailing bytes")
    if len(set(names)) != len(names):
        raise DeltaError("delta header names a tensor twice")
    try:
        tensors = map_tensors(decode_tensor, jobs, sizes)
    except DeltaError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as exc:
        # Bad input that got past the checks above (an exotic dtype, an impossible view): still bad input.
        raise DeltaError(f"corrupt delta: {type(exc).__name__}: {exc}") from exc
    return dict(zip(names, tensors, strict=True))


def apply_delta(
    old: Mapping[str, torch.Tensor], delta: bytes | memoryview, *, old_sha256: str | None = None
) -> State:
    """Rebuild the target state from its base and a delta; bit-exact or :class:`DeltaError`.

    ``old_sha256``, when the caller already verified it, saves hashing the base again.
    """
    header, _ = read_delta_header(delta)
    base_hash = old_sha256 if old_sha256 is not None else state_sha256(old)
    if base_hash != header.base_sha256:
        raise DeltaError(
            f"delta is for a different parent (base {header.base_sha256[:12]}, given {base_hash[:12]})"
        )
    result = decode_unverified(old, delta)
    got = state_sha256(result)
    if got != header.target_sha256:
        raise DeltaError(
            f"reconstructed state hash {got[:12]} does not match the delta's target {header.target_sha256[:12]}"
        )
    return result
