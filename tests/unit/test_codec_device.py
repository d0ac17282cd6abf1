"""The codec's torch path (changed elements found on a torch device) against the numba kernels.

Every test runs on the ``cpu`` torch device, which checks the torch ops everywhere, and again on
``cuda`` where a GPU is present (skipped, with the reason, where it is not). The torch path must
find exactly what the numba kernels find (same changed positions, classes, gaps and steps, also
checked against a plain numpy reading of the format), so that the delta is the same, byte for byte.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flywheel.weights.codec import changes, tensor_coding
from flywheel.weights.codec import device as torch_path
from flywheel.weights.codec.bitview import element_bits, order_keys, sparse_capable, zigzag
from flywheel.weights.codec.classes import SAMPLE_BLOCK, SAMPLE_BLOCKS
from flywheel.weights.codec.container import read_delta_header
from flywheel.weights.codec.delta import apply_delta, encode_delta, resolve_device
from flywheel.weights.codec.stats import delta_stats
from tests.unit.test_codec import (
    FLOATS,
    SPECIALS,
    assert_same,
    bits,
    change_a_tenth,
    context_pair,
    gen,
    perturb,
    random_state,
)

pytestmark = pytest.mark.unit

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device here (torch.cuda.is_available() is False): the cuda path is checked on a GPU machine")),
]
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def expected_changes(old: torch.Tensor, new: torch.Tensor, thresholds: list[int]) -> tuple[list, list]:
    """Per class, the gaps and zigzag steps of the changed elements, read off the format's
    definition with numpy (the classes from the given thresholds)."""
    a, b = element_bits(old), element_bits(new)
    changed = a != b
    magnitude = a & a.dtype.type((1 << (8 * a.itemsize - 1)) - 1)
    cls = sum((magnitude >= t).astype(np.int64) for t in thresholds) if thresholds else np.zeros(a.size, np.int64)
    floating = new.dtype.is_floating_point
    gaps, steps = [], []
    for c in range(len(thresholds) + 1):
        members = cls == c
        rank = np.cumsum(members) - 1
        hit = changed & members
        gaps.append((np.diff(rank[hit], prepend=-1) - 1).astype(np.uint64))
        steps.append(zigzag(order_keys(b[hit], floating) - order_keys(a[hit], floating)))
    return gaps, steps


def assert_same_changes(old: torch.Tensor, new: torch.Tensor, device: str) -> changes.Changes:
    """The torch path on ``device`` finds what the numba kernels find, and what numpy reads."""
    want = changes.scan(element_bits(old), element_bits(new), new.dtype)
    got = torch_path.scan_torch(old, new, torch.device(device))
    assert got.thresholds == want.thresholds
    gaps, steps = expected_changes(old, new, want.thresholds)
    for name, ours, theirs, numpy_read in (("gaps", got.gaps, want.gaps, gaps),
                                           ("steps", got.steps, want.steps, steps)):
        assert len(ours) == len(theirs) == len(numpy_read) == len(want.thresholds) + 1, name
        for c, (x, y, z) in enumerate(zip(ours, theirs, numpy_read, strict=True)):
            assert x.dtype == y.dtype == z.dtype, (name, c)
            assert np.array_equal(x, y) and np.array_equal(y, z), (name, c)
    assert sum(g.size for g in got.gaps) == int(np.count_nonzero(element_bits(old) != element_bits(new)))
    return got


def assert_same_delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], device: str) -> bytes:
    """Same delta bytes from the numba kernels and from torch on ``device``; it rebuilds ``new``."""
    delta = encode_delta(old, new)
    assert encode_delta(old, new, device=device) == delta
    assert_same(apply_delta(old, delta), new)
    return delta


def three_rate_pair(rng: random.Random, n: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Small, middling and large weights moving at three different rates: three classes (as
    :func:`context_pair`, which makes two)."""
    g = gen(rng)
    old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    magnitude = old.float().abs()
    rate = torch.where(magnitude < 0.005, 0.3, torch.where(magnitude < 0.02, 0.05, 0.002))
    b = bits(old).clone()
    return {"w": old}, {"w": torch.where(torch.rand(n, generator=g) < rate, b + 1, b).view(dtype)}


def special_pair(rng: random.Random, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every special pattern (NaN payloads, +-inf, +-0, denormals, largest finite) moving to every
    other, placed at random among small random moves of ordinary values."""
    g = gen(rng)
    old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    a = bits(old).clone()
    b = a.clone()
    moved = torch.rand(n, generator=g) < 0.05
    b[moved] += torch.randint(1, 4, (int(moved.sum()),), generator=g, dtype=b.dtype)
    pairs = [(x, y) for x in SPECIALS[dtype] for y in SPECIALS[dtype]]  # including x == y: unchanged
    where = torch.randperm(n, generator=g)[: len(pairs)]
    a[where] = torch.tensor([x for x, _ in pairs], dtype=a.dtype)
    b[where] = torch.tensor([y for _, y in pairs], dtype=b.dtype)
    return a.view(dtype), b.view(dtype)


# --- changed elements, class by class ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_changes_match_the_kernels_with_special_values(rng: random.Random, device: str, dtype: torch.dtype) -> None:
    old, new = special_pair(rng, dtype, 50_000)
    assert_same_changes(old, new, device)
    assert_same_delta({"w": old}, {"w": new}, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_changes_match_the_kernels_with_magnitude_classes(rng: random.Random, device: str,
                                                          dtype: torch.dtype) -> None:
    # 32 sampled blocks and a short tail: the threshold sample takes a partial last block.
    n = SAMPLE_BLOCK * SAMPLE_BLOCKS * 6 + rng.randrange(1, SAMPLE_BLOCK)
    for make, classes in ((context_pair, 2), (three_rate_pair, 3)):
        old, new = make(rng, n, dtype)
        found = assert_same_changes(old["w"], new["w"], device)
        assert len(found.thresholds) + 1 == classes  # the case this is for
        delta = assert_same_delta(old, new, device)
        assert read_delta_header(delta)[0].tensors[0]["scheme"] == "sparse"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_signs_all_changed_none_changed_and_tiny_tensors(rng: random.Random, device: str,
                                                              dtype: torch.dtype) -> None:
    g = gen(rng)
    view = SIGNED[torch.empty((), dtype=dtype).element_size()]
    # +0.0 <-> -0.0: different bits, equal values.
    zeros = torch.zeros(100, dtype=dtype)
    assert_same_changes(zeros, -zeros, device)
    assert_same_changes(-zeros, zeros, device)
    for n in (1, 2, 7, 63, 64, 65, 129, 5000):
        old = (torch.randn(n, generator=g) * rng.choice([1e-3, 1.0, 100.0])).to(dtype)
        every = (bits(old) ^ 1).view(dtype)  # all changed, by one ULP either way
        anything = torch.randint(torch.iinfo(view).min, torch.iinfo(view).max, (n,), generator=g, dtype=view)
        anything = torch.where(anything == bits(old), anything ^ 1, anything).view(dtype)  # all changed, anyhow
        for new in (old.clone(), every, anything):
            assert_same_changes(old, new, device)
            assert_same_delta({"w": old}, {"w": new}, device)
        found = torch_path.scan_torch(old, old.clone(), torch.device(device))
        assert sum(s.size for s in found.steps) == 0
    delta = encode_delta({"w": old}, {"w": old.clone()}, device=device)
    assert read_delta_header(delta)[0].tensors[0]["scheme"] == "same"


@pytest.mark.parametrize("device", DEVICES)
def test_a_partial_last_sample_block_counts(rng: random.Random, device: str) -> None:
    """The class thresholds come from a sample of blocks that ends in a partial block: when all the
    changes are there, both paths must still see them (and split small from large weights)."""
    g = gen(rng)
    stride = SAMPLE_BLOCK * 6
    n = stride * SAMPLE_BLOCKS + rng.randrange(300, SAMPLE_BLOCK)  # every 6th block
    scale = torch.where(torch.arange(n) % 2 == 0, 1e-4, 1.0)
    old = (torch.randn(n, generator=g) * scale).bfloat16()
    b = bits(old).clone()
    tail = torch.arange(n) >= stride * SAMPLE_BLOCKS
    new = torch.where(tail & (scale < 1), b + 1, b).view(torch.bfloat16)
    assert len(assert_same_changes(old, new, device).thresholds) == 1
    assert_same_delta({"w": old}, {"w": new}, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_boundaries(rng: random.Random, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path works through a tensor in chunks, carrying the class counts across."""
    monkeypatch.setattr(torch_path, "TORCH_CHUNK", rng.choice([64, 1000, 4099]))
    for dtype in FLOATS:
        old, new = three_rate_pair(rng, 30_000 + rng.randrange(1000), dtype)
        assert_same_changes(old["w"], new["w"], device)
        assert_same_delta(old, new, device)


@pytest.mark.parametrize("device", DEVICES)
def test_other_dtypes_match_the_kernels(rng: random.Random, device: str) -> None:
    g = gen(rng)
    old = {
        "i8": torch.randint(-128, 128, (1000,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (70,), generator=g, dtype=torch.uint8),
        "b": torch.rand(300, generator=g) < 0.5,
        "i16": torch.randint(-(2**15), 2**15, (129,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31, (200,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-(2**63), 2**63 - 1, (300,), generator=g, dtype=torch.int64),
        "f64": torch.randn(20_000, generator=g, dtype=torch.float64) * 0.02,
        "c64": torch.randn(33, generator=g, dtype=torch.complex64),
    }
    new = change_a_tenth(old, g)
    # Moves that wrap around the element width, both ways.
    extremes = torch.tensor([-(2**63), 2**63 - 1, -1, 0], dtype=torch.int64)
    old["i64"][:4], new["i64"][:4] = extremes, extremes.flip(0)
    old["f64"][:2] = torch.tensor([float("inf"), -float("inf")], dtype=torch.float64)
    new["f64"][:2] = -old["f64"][:2]
    for name, t in old.items():
        if sparse_capable(t):
            assert_same_changes(t, new[name], device)
    assert_same_delta(old, new, device)


# --- whole deltas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_random_states_give_the_same_delta(rng: random.Random, device: str, fraction: float) -> None:
    old = random_state(rng)
    new = perturb(rng, old, fraction)
    new["added"] = torch.ones(5, dtype=torch.bfloat16)  # no base: coded in full
    new["layers.0.w"] = new["layers.0.w"].float()  # dtype change: coded in full
    assert_same_delta(old, new, device)


def test_the_device_argument_picks_the_path(rng: random.Random, monkeypatch: pytest.MonkeyPatch) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.05)
    delta = encode_delta(old, new)

    def not_this_one(*args: object) -> None:
        raise AssertionError("the other path was taken")

    with monkeypatch.context() as patch:
        patch.setattr(tensor_coding, "scan", not_this_one)
        assert encode_delta(old, new, device="cpu") == delta
        assert encode_delta(old, new, device=torch.device("cpu")) == delta
    monkeypatch.setattr(tensor_coding, "scan_torch", not_this_one)
    assert encode_delta(old, new, device=None) == delta


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_on_the_device_use_it_by_default(rng: random.Random, device: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.05)
    on = {n: t.to(device) for n, t in old.items()}, {n: t.to(device) for n, t in new.items()}
    delta = encode_delta(old, new)
    if device != "cpu":  # CPU tensors go to the numba kernels; others must not
        monkeypatch.setattr(tensor_coding, "scan",
                            lambda *args: pytest.fail("numba path taken for tensors on a device"))
    assert encode_delta(*on) == delta
    assert delta_stats(*on)["bytes_delta"] == len(delta)
    assert delta_stats(old, new, device=device)["bytes_delta"] == len(delta)
    assert_same(apply_delta(on[0], delta), new)


def test_resolve_device() -> None:
    assert resolve_device("cpu") is None
    assert resolve_device("auto") == (torch.device("cuda") if torch.cuda.is_available() else None)
    for bad in ("gpu", "mps", "cuda:x", ""):
        with pytest.raises(ValueError, match="unknown device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    else:
        assert resolve_device("cuda") == torch.device("cuda")
        with pytest.raises(ValueError, match="CUDA devices"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
