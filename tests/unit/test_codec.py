"""The weight codec: canonical hashing, full checkpoints, and lossless deltas on fresh random states."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import zstandard

from flywheel.weights.codec import container, kernels, sparse, streams, tensor_coding
from flywheel.weights.codec.bitview import from_order_keys, order_keys, zigzag
from flywheel.weights.codec.classes import SAMPLE_BLOCK, SAMPLE_BLOCKS
from flywheel.weights.codec.container import read_delta_header
from flywheel.weights.codec.delta import apply_delta, encode_delta
from flywheel.weights.codec.state import DeltaError, decode_full, encode_full, state_sha256
from flywheel.weights.codec.stats import count_changed, delta_stats

pytestmark = pytest.mark.unit

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = ((), (0,), (3, 0), (1,), (7,), (33, 17), (4, 5, 6), (257, 64))
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SPECIAL_BITS = {  # bit patterns: NaN payloads, -NaN, +-inf, +-0, denormals, largest finite
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x7F7F],
    torch.float16: [0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF],
    torch.float32: [
        0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF
    ],
}


def _signed(value: int, width_bits: int) -> int:
    return value - (1 << width_bits) if value >= 1 << (width_bits - 1) else value


SPECIALS = {  # the same patterns as the signed integers that torch's int views hold
    dtype: [_signed(v, 8 * torch.empty((), dtype=dtype).element_size()) for v in values]
    for dtype, values in _SPECIAL_BITS.items()
}


def gen(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.getrandbits(63))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()])


def random_state(rng: random.Random, n: int = 12) -> dict[str, torch.Tensor]:
    g = gen(rng)
    state = {}
    for i in range(n):
        dtype = FLOATS[i % len(FLOATS)]
        shape = SHAPES[rng.randrange(len(SHAPES))]
        state[f"layers.{i}.w"] = (torch.randn(shape, generator=g) * rng.choice([0.02, 1.0, 300.0])).to(dtype)
    state["scalar"] = torch.tensor(rng.random(), dtype=torch.bfloat16)
    state["steps"] = torch.randint(-(2**40), 2**40, (19,), generator=g)
    return state


def perturb(rng: random.Random, state: dict[str, torch.Tensor], fraction: float) -> dict[str, torch.Tensor]:
    """Move ``fraction`` of the elements by +-1-2 ULP; also a few arbitrary changes, sign flips and
    special bit patterns."""
    g = gen(rng)
    out = {}
    for name, t in state.items():
        new = t.clone()
        if t.numel() and t.dtype in FLOATS:
            b = bits(new).reshape(-1)
            n = b.numel()
            moved = torch.rand(n, generator=g) < fraction
            step = torch.randint(1, 3, (n,), generator=g, dtype=b.dtype)
            # One ULP towards or away from zero: the magnitude bits move by the step.
            step = torch.where(torch.rand(n, generator=g) < 0.5, step, -step)
            magnitude_ok = (b & torch.iinfo(b.dtype).max) > 2  # stay clear of wrapping across zero
            b[:] = torch.where(moved & magnitude_ok, b + step, b)
            for _ in range(rng.randrange(3)):
                i = rng.randrange(n)
                kind = rng.randrange(3)
                if kind == 0:  # arbitrary bits
                    b[i] = rng.randrange(torch.iinfo(b.dtype).min, torch.iinfo(b.dtype).max)
                elif kind == 1:  # sign flip
                    new.reshape(-1)[i] = -new.reshape(-1)[i]
                else:
                    b[i] = rng.choice(SPECIALS[t.dtype])
        out[name] = new
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert state_sha256(a) == state_sha256(b)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        if a[name].numel():
            assert torch.equal(bits(a[name]), bits(b[name])), name


# --- hashing ------------------------------------------------------------------------------------


def test_hash_is_canonical_and_sensitive_to_every_bit(rng: random.Random) -> None:
    state = random_state(rng)
    h = state_sha256(state)
    reordered = {name: state[name].clone() for name in reversed(list(state))}
    assert state_sha256(reordered) == h

    big = next(n for n, t in state.items() if t.numel() > 1 and t.dtype in FLOATS)
    strided = state[big].reshape(-1).flip(0).flip(0)  # same values, a fresh layout
    assert state_sha256({**state, big: strided.reshape(state[big].shape)}) == h
    transposed = state[big].reshape(-1, 1).t().contiguous().t()  # non-contiguous view
    assert state_sha256({**state, big: transposed.reshape(state[big].shape)}) == h

    flipped = {n: t.clone() for n, t in state.items()}
    b = bits(flipped[big]).reshape(-1)
    b[rng.randrange(b.numel())] ^= 1 << rng.randrange(8 * flipped[big].element_size())
    assert state_sha256(flipped) != h

    renamed = {("x" + n if n == big else n): t for n, t in state.items()}
    assert state_sha256(renamed) != h
    assert state_sha256({**state, big: state[big].unsqueeze(0)}) != h  # shape matters
    half = torch.zeros(3, dtype=torch.float16)
    assert state_sha256({"a": half}) != state_sha256({"a": half.view(torch.bfloat16)})  # dtype matters


def test_full_checkpoint_round_trip(rng: random.Random) -> None:
    state = random_state(rng)
    state["tied"] = state["layers.0.w"]  # shared storage is written as two tensors
    assert_same(decode_full(encode_full(state)), state)
    with pytest.raises(DeltaError):
        decode_full(b"not a safetensors file at all")


def test_hashing_and_reading_a_header_import_no_jit_compiler() -> None:
    """Processes that only hash states (trainer, nodes, the vLLM adapter) must not pay for numba:
    the numba-free modules import the compiled side only when a delta is encoded or applied."""
    script = (
        "import sys, torch\n"
        "import flywheel.weights.registry, flywheel.weights.store, flywheel.weights.cli\n"
        "from flywheel.weights.codec import bitview, container, delta, state, stats, streams, workers\n"
        "old = {'w': torch.zeros(70, dtype=torch.bfloat16)}\n"
        "new = {'w': torch.ones(70, dtype=torch.bfloat16)}\n"
        "state.state_sha256(new), state.decode_full(state.encode_full(new)), stats.count_changed(old, new)\n"
        "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules, 'imported before any delta'\n"
        "blob = delta.encode_delta(old, new)\n"
        "container.read_delta_header(blob)\n"
        "assert 'numba' in sys.modules, 'encoding a delta uses the kernels'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


# --- deltas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_delta_round_trip_is_bit_exact(rng: random.Random, fraction: float) -> None:
    old = random_state(rng)
    new = perturb(rng, old, fraction)
    delta = encode_delta(old, new)
    result = apply_delta(old, delta)
    assert_same(result, new)
    assert read_delta_header(delta)[0].target_sha256 == state_sha256(new)


def test_special_values_round_trip_in_every_float_dtype(rng: random.Random) -> None:
    old, new = {}, {}
    for dtype in FLOATS:
        width_view = INT_VIEW[torch.empty((), dtype=dtype).element_size()]
        patterns = torch.tensor(SPECIALS[dtype], dtype=torch.int64).to(width_view)
        perm = torch.randperm(len(patterns), generator=gen(rng))
        name = str(dtype)
        old[name] = patterns.view(dtype)
        new[name] = patterns[perm].view(dtype)  # every special becomes another special
        old[name + ".nz"] = patterns.view(dtype)
        new[name + ".nz"] = (-patterns.view(dtype).float()).to(dtype)  # sign flips of all of them
    assert_same(apply_delta(old, encode_delta(old, new)), new)


def test_structure_changes_are_coded_in_full(rng: random.Random) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.01)
    first, second, third = list(old)[:3]
    new["added"] = torch.randn(5, 4, generator=gen(rng)).bfloat16()
    del new[first]  # removed
    new[second] = old[second].float()  # dtype change
    new[third] = old[third].reshape(-1)  # shape change
    delta = encode_delta(old, new)
    schemes = {e["name"]: e["scheme"] for e in read_delta_header(delta)[0].tensors}
    assert first not in schemes
    assert schemes["added"] == "full"
    assert schemes[second] == "full" or old[second].numel() == 0
    assert schemes[third] in ("full", "same")  # an empty tensor reshaped is still empty
    assert_same(apply_delta(old, delta), new)


def test_unchanged_tensors_cost_nothing(rng: random.Random) -> None:
    old = random_state(rng)
    same = {n: t.clone() for n, t in old.items()}
    delta = encode_delta(old, same)
    header, offset = read_delta_header(delta)
    assert offset == len(delta)  # header only, no payload
    assert {e["scheme"] for e in header.tensors} == {"same"}

    # One changed tensor among many unchanged: the unchanged ones add nothing to the payload.
    name = next(n for n, t in old.items() if t.numel() > 100 and t.dtype in FLOATS)
    one = dict(same)
    one[name] = perturb(rng, {name: old[name]}, 0.05)[name]
    alone = encode_delta({name: old[name]}, {name: one[name]})
    together = encode_delta(old, one)
    payload = lambda d: len(d) - read_delta_header(d)[1]  # noqa: E731
    assert payload(together) == payload(alone)


def test_one_ulp_on_two_percent_of_bf16_is_tiny() -> None:
    seed = random.SystemRandom().getrandbits(32)
    g = torch.Generator().manual_seed(seed)
    old = {f"w{i}": (torch.randn(512, 512, generator=g) * 0.02).bfloat16() for i in range(4)}
    new = {}
    for name, t in old.items():
        b = bits(t.clone())
        moved = torch.rand(b.shape, generator=g) < 0.02
        new[name] = torch.where(moved, b + 1, b).view(torch.bfloat16)
    delta = encode_delta(old, new)
    full = sum(t.numel() * 2 for t in new.values())
    stats = delta_stats(old, new)
    assert len(delta) < 0.05 * full, (seed, len(delta), full)
    assert stats["bytes_delta"] == len(delta)
    assert stats["bytes_delta"] < stats["bytes_xor_zstd"]  # better than the naive baseline
    assert stats["bytes_entropy_floor"] <= stats["bytes_delta"]
    assert_same(apply_delta(old, delta), new)


def test_mostly_changed_tensor_falls_back_to_full(rng: random.Random) -> None:
    g = gen(rng)
    old = {"w": torch.randn(300, 200, generator=g).bfloat16()}
    new = {"w": torch.randn(300, 200, generator=g).bfloat16()}
    delta = encode_delta(old, new)
    assert read_delta_header(delta)[0].tensors[0]["scheme"] == "full"
    assert len(delta) < 300 * 200 * 2  # zstd over byte planes beats the raw bytes
    assert_same(apply_delta(old, delta), new)


def test_result_does_not_alias_the_base(rng: random.Random) -> None:
    old = random_state(rng)
    snapshot = state_sha256(old)
    result = apply_delta(old, encode_delta(old, perturb(rng, old, 0.1)))
    for t in result.values():
        if t.numel():
            bits(t).reshape(-1)[0] ^= 1
    assert state_sha256(old) == snapshot


def test_delta_stats_counts(rng: random.Random) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.05)
    stats = delta_stats(old, new)
    changed, elements = count_changed(old, new)
    assert (stats["changed"], stats["elements"]) == (changed, elements)
    assert stats["fraction_changed"] == pytest.approx(changed / elements)
    assert stats["bytes_full"] == sum(t.numel() * t.element_size() for t in new.values())
    assert sum(r["elements"] for r in stats["by_dtype"].values()) == elements
    assert set(stats["by_dtype"]) <= {"bfloat16", "float16", "float32", "int64"}


# --- refusing bad input -------------------------------------------------------------------------


def test_wrong_parent_is_refused(rng: random.Random) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.02)
    delta = encode_delta(old, new)
    with pytest.raises(DeltaError, match="different parent"):
        apply_delta(new, delta)
    with pytest.raises(DeltaError, match="different parent"):
        apply_delta(perturb(rng, old, 0.001) | {"extra": torch.zeros(1)}, delta)


def test_truncated_deltas_are_refused(rng: random.Random) -> None:
    old = random_state(rng)
    delta = encode_delta(old, perturb(rng, old, 0.05))
    cuts = {0, 4, 8, 13, len(delta) - 1} | {rng.randrange(len(delta)) for _ in range(40)}
    for cut in sorted(cuts):
        with pytest.raises(DeltaError):
            apply_delta(old, delta[:cut])
    with pytest.raises(DeltaError, match="trailing"):
        apply_delta(old, delta + b"\x00")


def test_corrupted_deltas_never_yield_wrong_weights(rng: random.Random) -> None:
    old = random_state(rng)
    new = perturb(rng, old, 0.05)
    delta = encode_delta(old, new)
    target = state_sha256(new)
    _, payload_start = read_delta_header(delta)
    refused = 0
    trials = 120
    for _ in range(trials):
        corrupt = bytearray(delta)
        i = rng.randrange(len(corrupt)) if rng.random() < 0.3 else rng.randrange(payload_start, len(corrupt))
        corrupt[i] ^= 1 << rng.randrange(8)
        try:
            result = apply_delta(old, bytes(corrupt))
        except DeltaError:
            refused += 1
            continue
        assert state_sha256(result) == target  # a flip that changes nothing is harmless
    assert refused > trials * 0.8
    with pytest.raises(DeltaError, match="magic"):
        apply_delta(old, b"XX" + delta[2:])
    version_bumped = delta[:8] + (container.FORMAT_VERSION + 1).to_bytes(2, "little") + delta[10:]
    with pytest.raises(DeltaError, match="format version"):
        apply_delta(old, version_bumped)


def test_garbage_header_is_refused(rng: random.Random) -> None:
    old = random_state(rng)
    base = state_sha256(old)
    headers = [
        b"{",
        b"[]",
        b'{"base_sha256": 1}',
        b'{"base_sha256":"%s","target_sha256":"x","tensors":[{"name":"a"}]}' % base.encode(),
        b'{"base_sha256":"%s","target_sha256":"x","tensors":[{"name":"a","scheme":"sparse","dtype":"float32",'
        b'"shape":[2],"len":0}]}' % base.encode(),
    ]
    for header in headers:
        # The header is zstd coded JSON: garbage inside a good frame, and a raw (unframed) header.
        for head in (zstandard.ZstdCompressor().compress(header), header):
            blob = container.MAGIC + container.PREFIX.pack(container.FORMAT_VERSION, len(head)) + head
            with pytest.raises(DeltaError):
                apply_delta(old, blob)


# --- the integer machinery ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_float_keys_are_monotone_and_bijective(rng: random.Random, dtype: type) -> None:
    width = np.dtype(dtype).itemsize
    raw = np.random.default_rng(rng.getrandbits(64)).integers(0, 2 ** (8 * width), 5000, dtype=dtype)
    keys = order_keys(raw, True)
    assert np.array_equal(from_order_keys(keys, True), raw)
    as_float = raw.view(np.float16 if width == 2 else np.float32)
    finite = np.isfinite(as_float)
    floats = as_float[finite].astype(np.float64)
    order = np.argsort(keys[finite], kind="stable")
    assert np.all(np.diff(floats[order]) >= 0)  # key order is value order
    one = np.array([0x3F80], dtype=np.uint16)  # bf16 1.0 and its next value up: a step of +1
    assert zigzag(order_keys(one + 1, True) - order_keys(one, True))[0] == 2


def test_integer_streams_round_trip_including_escapes(rng: random.Random) -> None:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(), zstandard.ZstdDecompressor()
    edges = [0, 1, 254, 255, 256, 65534, 65535, 65536, 2**32 - 2, 2**32 - 1, 2**32, 2**64 - 1]
    gen_np = np.random.default_rng(rng.getrandbits(64))
    cases = [
        np.array(edges, dtype=np.uint64),
        gen_np.geometric(0.05, 10_000).astype(np.uint64),
        np.concatenate([gen_np.integers(0, 200, 5000), gen_np.integers(0, 2**63, 20)]).astype(np.uint64),
        gen_np.integers(0, 2**16, 3000).astype(np.uint16),
        np.array([], dtype=np.uint64),
    ]
    for values in cases:
        packed = streams.pack(values, cctx)
        assert np.array_equal(streams.unpack(packed, values.size, dctx, "t"), values.astype(np.uint64))
    with pytest.raises(DeltaError):
        streams.unpack(streams.pack(cases[1], cctx), cases[1].size + 1, dctx, "t")


@pytest.mark.parametrize(
    "kind", ["empty", "one", "zeros", "geometric", "huge_gaps", "mixed", "one_huge"]
)
def test_rice_streams_round_trip(rng: random.Random, kind: str) -> None:
    gen_np = np.random.default_rng(rng.getrandbits(64))
    values = {
        "empty": np.array([], dtype=np.uint64),
        "one": np.array([rng.randrange(1000)], dtype=np.uint64),
        "zeros": np.zeros(rng.randrange(1, 5000), dtype=np.uint64),  # every element changed
        "geometric": gen_np.geometric(rng.choice([0.5, 0.02, 0.001]), rng.randrange(1, 20_000)).astype(np.uint64) - 1,
        "huge_gaps": gen_np.integers(2**16, 2**24, rng.randrange(1, 300)).astype(np.uint64),
        "mixed": np.concatenate([gen_np.integers(0, 40, 3000), gen_np.integers(2**17, 2**20, 5)]).astype(np.uint64),
        "one_huge": np.array([2**40 + rng.randrange(1000)], dtype=np.uint64),
    }[kind]
    k = sparse.rice_k(values)
    unary, low = sparse.rice_encode(values, k)
    assert np.array_equal(sparse.rice_decode(unary, low, k, values.size, "t"), values)
    if values.size:
        with pytest.raises(DeltaError):
            sparse.rice_decode(unary, low, k, values.size + 1, "t")  # fewer codes than claimed
        with pytest.raises(DeltaError):
            sparse.rice_decode(unary + b"\x01", low, k, values.size, "t")  # trailing garbage
        if k:
            with pytest.raises(DeltaError):
                sparse.rice_decode(unary, low[:-1], k, values.size, "t")  # truncated remainders


def test_rice_cost_is_near_the_geometric_entropy(rng: random.Random) -> None:
    p = rng.choice([0.005, 0.02, 0.05])
    gaps = np.random.default_rng(rng.getrandbits(64)).geometric(p, 50_000).astype(np.uint64) - 1
    unary, low = sparse.rice_encode(gaps, sparse.rice_k(gaps))
    entropy = -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) / p  # bits per geometric gap
    assert 8 * (len(unary) + len(low)) / gaps.size < entropy * 1.03


def context_pair(rng: random.Random, n: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Old weights of widely varying magnitude; small ones change far more often (as under Adam)."""
    g = gen(rng)
    old = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 2, (n,), generator=g).float())).to(dtype)
    b = bits(old.clone())
    rate = torch.where(old.float().abs() < 2**-6, 0.3, 0.002)
    moved = (torch.rand(n, generator=g) < rate) & ((b & torch.iinfo(b.dtype).max) > 2)
    step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1).to(b.dtype)
    new = torch.where(moved, b + step, b).view(dtype)
    return {"w": old}, {"w": new}


@pytest.mark.parametrize("dtype", FLOATS)
def test_magnitude_classes_round_trip_and_pay_off(rng: random.Random, dtype: torch.dtype) -> None:
    old, new = context_pair(rng, 200_000, dtype)
    delta = encode_delta(old, new)
    entry = read_delta_header(delta)[0].tensors[0]
    assert entry["scheme"] == "sparse" and len(entry["classes"]) >= 1
    assert_same(apply_delta(old, delta), new)
    stats = delta_stats(old, new)
    assert stats["bytes_delta"] < stats["bytes_entropy_floor"]  # the context beats the order-0 floor


def test_sparse_edge_cases_round_trip(rng: random.Random) -> None:
    g = gen(rng)
    n = 300_000
    base = (torch.randn(n, generator=g) * 0.02).bfloat16()
    b = bits(base.clone())
    cases = {
        "first_only": [0],
        "last_only": [n - 1],
        "far_apart": sorted(rng.sample(range(n), 3)),  # gaps far beyond 2**16
        "all": list(range(n)),
        "ends": [0, 1, n - 2, n - 1],
    }
    for positions in cases.values():
        nb = b.clone()
        nb[torch.tensor(positions)] += 1
        new = {"w": nb.view(torch.bfloat16), "one": torch.tensor([1.5], dtype=torch.bfloat16)}
        old = {"w": base, "one": torch.tensor([1.0], dtype=torch.bfloat16)}
        delta = encode_delta(old, new)
        assert_same(apply_delta(old, delta), new)
    none = {"w": base.clone()}
    assert read_delta_header(encode_delta({"w": base}, none))[0].tensors[0]["scheme"] == "same"


def test_bad_class_entries_are_refused(rng: random.Random) -> None:
    old, new = context_pair(rng, 50_000, torch.bfloat16)
    delta = encode_delta(old, new)
    _, offset = read_delta_header(delta)
    for key, value in [("classes", [5, 3]), ("classes", [0]), ("counts", [1, 2]), ("rice", [70] * 3),
                       ("parts", [10**9, 0]), ("classes", [1 << 20]), ("counts", "x")]:
        parsed = read_delta_header(delta)[0]
        raw = {"base_sha256": parsed.base_sha256, "target_sha256": parsed.target_sha256, "tensors": parsed.tensors}
        raw["tensors"][0][key] = value
        head = container.header_bytes(raw)
        blob = container.MAGIC + container.PREFIX.pack(container.FORMAT_VERSION, len(head)) + head + delta[offset:]
        with pytest.raises(DeltaError):
            apply_delta(old, blob)


# --- the compiled kernels -------------------------------------------------------------------------


def change_a_tenth(old: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """``old`` with a random tenth of each tensor's elements changed, whatever the dtype (integers
    by flipping the low bit, which includes wrapping at the extremes)."""
    new = {}
    for name, t in old.items():
        flat = t.clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
        if t.dtype == torch.bool:
            flat[idx] = ~flat[idx]
        elif t.dtype.is_complex:
            flat[idx] = flat[idx] * 2
        elif t.dtype.is_floating_point:
            flat[idx] = -flat[idx] * 1.5
        else:
            flat[idx] = flat[idx] ^ torch.tensor(1, dtype=t.dtype)
        new[name] = flat.reshape(t.shape)
    return new


def test_other_dtypes_round_trip(rng: random.Random) -> None:
    """Every element width goes through the same kernels (uint8 .. uint64 views)."""
    g = gen(rng)
    old = {
        "i8": torch.randint(-128, 128, (1000,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (70,), generator=g, dtype=torch.uint8),
        "b": torch.rand(300, generator=g) < 0.5,
        "i16": torch.randint(-(2**15), 2**15, (129,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31, (200,), generator=g, dtype=torch.int32),
        "f64": torch.randn(257, generator=g, dtype=torch.float64),
        "c64": torch.randn(33, generator=g, dtype=torch.complex64),
    }
    new = change_a_tenth(old, g)
    delta = encode_delta(old, new)
    assert_same(apply_delta(old, delta), new)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_step_streams_round_trip_including_escapes(rng: random.Random, width: int) -> None:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(), zstandard.ZstdDecompressor()
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    top = 2 ** (8 * width) - 1
    gen_np = np.random.default_rng(rng.getrandbits(64))
    count = rng.randrange(1, 3000)
    small = gen_np.integers(1, 9, count).astype(np.uint64)
    edges = np.array([1, 2, 6, 7, 8, 9, top - 1, top, top // 2, top // 2 + 1], dtype=np.uint64)
    steps = np.concatenate([small, edges])[gen_np.permutation(count + edges.size)].astype(dtype)
    (signs, mags, rest), _ = sparse.encode_steps(steps, cctx)
    decoded = sparse.decode_steps(memoryview(signs), memoryview(mags), memoryview(rest), steps.size, width, dctx, "t")
    assert np.array_equal(decoded, steps.astype(np.uint64))
    with pytest.raises(DeltaError):
        sparse.decode_steps(memoryview(signs), memoryview(mags), memoryview(rest), steps.size + 9, width, dctx, "t")
    with pytest.raises(DeltaError):  # a set padding bit (or one byte too many)
        bad = signs[:-1] + bytes([signs[-1] | 0x80]) if steps.size % 8 else signs + b"\x01"
        sparse.decode_steps(memoryview(bad), memoryview(mags), memoryview(rest), steps.size, width, dctx, "t")


def test_select_finds_the_rth_set_bit(rng: random.Random) -> None:
    for _ in range(2000):
        x = rng.getrandbits(64) & rng.getrandbits(64) if rng.random() < 0.5 else rng.getrandbits(64)
        x |= 1 << rng.randrange(64)
        ones = [b for b in range(64) if x >> b & 1]
        r = rng.randrange(len(ones))
        assert kernels.nb_select(np.uint64(x), r) == ones[r]


def test_changes_the_threshold_sample_misses_still_round_trip(rng: random.Random) -> None:
    """The encoder sizes its buffers from a sample of blocks; changes only between the sampled
    blocks overflow them, and it must start again with room for everything."""
    g = gen(rng)
    n = SAMPLE_BLOCK * SAMPLE_BLOCKS * 4
    old = {"w": (torch.randn(n, generator=g) * 0.02).bfloat16()}
    b = bits(old["w"]).clone()
    every = n // (SAMPLE_BLOCK * SAMPLE_BLOCKS)
    block = torch.arange(n) // SAMPLE_BLOCK
    b[block % every != 0] += 1  # every element outside the sampled blocks moves
    new = {"w": b.view(torch.bfloat16)}
    delta = encode_delta(old, new)
    assert read_delta_header(delta)[0].tensors[0]["scheme"] in ("sparse", "full")
    assert_same(apply_delta(old, delta), new)


def test_magnitude_classes_are_used_and_exact(rng: random.Random) -> None:
    """Small weights change far more often than large ones: the encoder splits them into classes."""
    g = gen(rng)
    old = {"w": (torch.randn(200_000, generator=g) * 0.02).bfloat16()}
    b = bits(old["w"]).clone()
    magnitude = old["w"].float().abs()
    p = torch.where(magnitude < 0.005, 0.2, torch.where(magnitude < 0.02, 0.03, 0.002))
    b = torch.where(torch.rand(b.shape, generator=g) < p, b + 1, b)
    new = {"w": b.view(torch.bfloat16)}
    delta = encode_delta(old, new)
    entry = read_delta_header(delta)[0].tensors[0]
    assert entry["scheme"] == "sparse" and len(entry["classes"]) >= 1
    assert_same(apply_delta(old, delta), new)


def test_packed_value_stream_round_trips(rng: random.Random, monkeypatch: pytest.MonkeyPatch) -> None:
    """When most steps are escaped (big moves), the encoder also tries the steps as one packed
    stream and keeps the smaller; force the packed one and check it decodes exactly."""
    g = gen(rng)
    old = {"w": torch.randn(20_000, generator=g) * 0.02}
    moved = torch.rand(20_000, generator=g) < 0.3
    new = {"w": torch.where(moved, old["w"] + 1e-4 * torch.randn(20_000, generator=g), old["w"])}
    assert_same(apply_delta(old, encode_delta(old, new)), new)  # whichever was smaller
    split = sparse.encode_steps
    monkeypatch.setattr(tensor_coding, "encode_steps",
                        lambda steps, cctx: ([b"\0" * 10**6, b"", b""], split(steps, cctx)[1]))
    delta = encode_delta(old, new)
    entry = read_delta_header(delta)[0].tensors[0]
    assert entry["scheme"] == "sparse" and entry.get("values") == "packed"
    assert_same(apply_delta(old, delta), new)
