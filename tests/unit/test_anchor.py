"""Compressed full checkpoints (anchors): bit-exact round trips of every dtype, float-aligned planes,
old safetensors still read, and corrupt or truncated input refused, never wrong weights."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import zstandard

from flywheel.weights.codec import anchor, planes
from flywheel.weights.codec.anchor import decode_anchor, encode_anchor, read_anchor_header, read_full
from flywheel.weights.codec.state import DeltaError, combine_digests, encode_full, state_sha256, tensor_digests
from tests.unit.test_codec import INT_VIEW, SHAPES, SPECIALS, gen, random_state

pytestmark = pytest.mark.unit

OTHER_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float64,
                torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (every width, complex128 included), and the same hash."""
    assert state_sha256(got) == state_sha256(want) and sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        raw = lambda x: x.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(got[name]), raw(t)), name


def every_dtype_state(rng: random.Random) -> dict[str, torch.Tensor]:
    """Random floats with every special pattern, every other dtype, empty tensors of every shape,
    a non-contiguous view and two tensors on one storage."""
    g = gen(rng)
    state = random_state(rng)
    for dtype, patterns in SPECIALS.items():
        view = INT_VIEW[torch.empty((), dtype=dtype).element_size()]
        specials = torch.tensor(patterns, dtype=torch.int64).to(view).view(dtype)
        noise = (torch.randn(500, generator=g) * rng.choice([1e-3, 1.0, 1e4])).to(dtype)
        state[f"special.{dtype}"] = torch.cat([specials, noise, specials])
        for shape in SHAPES:
            if 0 in shape:
                state[f"empty.{dtype}.{shape}"] = torch.empty(shape, dtype=dtype)
    for dtype in OTHER_DTYPES:
        raw = torch.randint(0, 256, (rng.randrange(1, 300) * 16,), generator=g, dtype=torch.uint8)
        if dtype == torch.bool:
            raw = raw & 1
        state[f"other.{dtype}"] = raw.view(dtype).reshape(-1, 1)
        state[f"other.{dtype}.empty"] = torch.empty(0, 3, dtype=dtype)
    wide = torch.randn(40, 30, generator=g).bfloat16()
    state["strided"] = wide.t()  # not contiguous
    state["tied"] = state["special.torch.bfloat16"]  # shares storage with another tensor
    state["slice"] = wide[3:7]  # a view into the middle of a storage
    return state


def test_every_dtype_round_trips_bit_exact(rng: random.Random) -> None:
    state = every_dtype_state(rng)
    blob = encode_anchor(state)
    got, sha = decode_anchor(blob)
    assert sha == state_sha256(state) == read_anchor_header(blob)[0]["sha256"]
    assert list(got) == sorted(state)
    assert_same(got, state)
    entries = {e["name"]: e for e in read_anchor_header(blob)[0]["tensors"]}
    assert all(entries[f"special.{dtype}"]["lens"][1] > 0 for dtype in SPECIALS)  # NaN, inf, 0: escaped
    for t in got.values():  # fresh, writable tensors that share nothing
        if t.numel():
            t.reshape(-1).view(torch.uint8)[0] ^= 0xFF
    assert_same(decode_anchor(blob)[0], state)
    assert got["tied"].untyped_storage().data_ptr() != got["special.torch.bfloat16"].untyped_storage().data_ptr()


def test_bytes_depend_on_the_state_only(rng: random.Random) -> None:
    state = random_state(rng)
    reordered = {name: state[name].clone().t().contiguous().t() if state[name].dim() == 2 else state[name]
                 for name in reversed(list(state))}
    assert encode_anchor(reordered) == encode_anchor(state)
    assert decode_anchor(encode_anchor({}))[0] == {}


def _bf16(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int16).view(torch.bfloat16)


def test_planes_follow_the_float_layout() -> None:
    """bf16 and float32: the 8 exponent bits in one byte, the sign and top 7 mantissa bits in the
    next; float16: exponent, sign with the top 2 mantissa bits, the low mantissa byte."""
    def split(t: torch.Tensor) -> list[list[int]]:
        le = t.reshape(-1).view(torch.uint8).numpy()
        return [p.tolist() for p in planes.split_planes(le, planes.coding_of(t.dtype), t.element_size())]

    values = [1.0, -1.5, 2.0**-130]  # 0x3F80, 0xBFC0, a denormal (exponent 0)
    assert split(torch.tensor(values, dtype=torch.bfloat16)) == [[0x7F, 0x7F, 0x00], [0x00, 0xC0, 0x08]]
    assert split(torch.tensor([1.0, -1.5, 1 + 2**-23], dtype=torch.float32)) == [
        [0x7F, 0x7F, 0x7F], [0x00, 0xC0, 0x00], [0, 0, 0], [0, 0, 1]]
    assert split(torch.tensor([1.0, -1.5, -(1 + 2**-10)], dtype=torch.float16)) == [
        [0x0F, 0x0F, 0x0F], [0b000, 0b110, 0b100], [0, 0, 1]]
    assert split(torch.tensor([0x1234], dtype=torch.int16)) == [[0x34], [0x12]]
    nan = _bf16(0xFFC1)  # -NaN with a payload: exponent 0xFF, sign and mantissa 0xC1
    assert split(nan) == [[0xFF], [0xC1]]


def test_exponents_are_4_bit_codes_around_a_base_with_escapes() -> None:
    exps = [120, 121, 134, 140, 0, 255, 100, 127, 127]  # window 120..134; 140, 0, 255, 100 escape
    bits = torch.tensor([e << 7 for e in exps], dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    le = bits.view(torch.uint8).numpy()
    codes, escapes, sign_top = planes.cut_streams(le, "e8", 2, 120)
    assert codes.tolist() == [0x10, 0xFE, 0xFF, 0x7F, 0x07]  # 0,1 | 14,15 | 15,15 | 15,7 | 7,pad 0
    assert escapes.tolist() == [140, 0, 255, 100] and sign_top.tolist() == [0] * 9
    assert planes.escape_count(codes, 9) == 4
    assert np.array_equal(planes.join_streams([codes, escapes, sign_top], "e8", 2, 9, 120), le)
    assert planes.exponent_base(le, "e8", 2) == 120  # only 120..134 holds five of them


def test_a_bf16_checkpoint_shrinks_and_noisy_planes_stay_raw() -> None:
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": (torch.randn(256, 512, generator=g) * 0.02).bfloat16() for i in range(4)}
    state["norm"] = torch.ones(512, dtype=torch.bfloat16)
    blob = encode_anchor(state)
    raw = anchor.raw_bytes(state)
    assert len(blob) < 0.70 * raw < len(encode_full(state))
    entries = {e["name"]: e for e in read_anchor_header(blob)[0]["tensors"]}
    # exponent codes coded (under 2.8 bits an exponent), few escapes, sign + mantissa noise stored raw
    assert entries["w0"]["zstd"][0] and not entries["w0"]["zstd"][2]
    lens = entries["w0"]["lens"]
    assert lens[0] < 0.35 * 256 * 512 and lens[1] < 100 and lens[2] == 256 * 512
    assert sum(entries["norm"]["lens"]) < 64  # a constant tensor costs next to nothing


def test_old_safetensors_checkpoints_still_read(rng: random.Random) -> None:
    state = random_state(rng)
    state["tied"] = state["layers.0.w"]
    for data in (encode_full(state), encode_anchor(state)):
        got, sha = read_full(data)
        assert sha == state_sha256(state)
        assert_same(got, state)
    with pytest.raises(DeltaError):
        read_full(b"not a safetensors file at all")


def test_truncated_or_padded_anchors_are_refused(rng: random.Random) -> None:
    blob = encode_anchor(random_state(rng))
    cuts = {0, 4, 8, 9, 13, 14, len(blob) - 1} | {rng.randrange(len(blob)) for _ in range(60)}
    for cut in sorted(cuts):
        with pytest.raises(DeltaError):
            read_full(blob[:cut]) if cut >= 8 else decode_anchor(blob[:cut])
    with pytest.raises(DeltaError, match="trailing"):
        decode_anchor(blob + b"\x00")


def test_corrupted_anchors_never_yield_wrong_weights(rng: random.Random) -> None:
    state = random_state(rng)
    blob = encode_anchor(state)
    want = state_sha256(state)
    _, body = read_anchor_header(blob)
    refused, trials = 0, 150
    for _ in range(trials):
        corrupt = bytearray(blob)
        i = rng.randrange(len(corrupt)) if rng.random() < 0.3 else rng.randrange(body, len(corrupt))
        corrupt[i] ^= 1 << rng.randrange(8)
        try:
            got, sha = decode_anchor(bytes(corrupt))
        except DeltaError:
            refused += 1
            continue
        assert sha == want and state_sha256(got) == want  # a flip that changes nothing is harmless
    assert refused > 0.9 * trials
    with pytest.raises(DeltaError, match="magic"):
        decode_anchor(b"XX" + blob[2:])
    bumped = blob[:8] + (anchor.FORMAT_VERSION + 1).to_bytes(2, "little") + blob[10:]
    with pytest.raises(DeltaError, match="format version"):
        decode_anchor(bumped)


def _with_header(blob: bytes, edit: object) -> bytes:
    """``blob`` with its header replaced by ``edit(header)`` (or by raw bytes), blobs unchanged."""
    header, body = read_anchor_header(blob)
    text = edit if isinstance(edit, bytes) else json.dumps(edit(header)).encode()  # type: ignore[operator]
    head = zstandard.ZstdCompressor().compress(text)
    return anchor.MAGIC + anchor.PREFIX.pack(anchor.FORMAT_VERSION, len(head)) + head + blob[body:]


def test_garbage_headers_are_refused() -> None:
    state = {"a": torch.arange(64, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.int16)}
    blob = encode_anchor(state)
    assert decode_anchor(_with_header(blob, lambda h: h))[1] == state_sha256(state)

    def entry(field: str, value: object) -> object:
        def edit(h: dict) -> dict:
            h["tensors"][0][field] = value
            return h
        return edit

    edits = [
        b"{", b"[]", b'{"sha256": "x"}', b'{"tensors": []}',
        lambda h: {**h, "sha256": "0" * 64},
        lambda h: {**h, "tensors": [h["tensors"][0], h["tensors"][0]]},
        lambda h: {**h, "tensors": [*h["tensors"], 7]},
        entry("dtype", "qint8"), entry("dtype", "nonsense"), entry("dtype", 3),
        entry("coding", "bytes"), entry("shape", [-1]), entry("shape", [65]), entry("shape", "64"),
        entry("lens", [1, 2]), entry("lens", [True, 0, 0, 0]), entry("zstd", [1, 0, 0, 0]),
        entry("digest", "zz"), entry("digest", "00" * 31), entry("digest", "00" * 32), entry("name", 5),
    ]
    for edit in edits:
        with pytest.raises(DeltaError):
            decode_anchor(_with_header(blob, edit))


def test_a_frame_claiming_more_than_it_can_hold_is_refused_before_decoding() -> None:
    state = {"z": torch.zeros(4, dtype=torch.uint8)}
    header, body = read_anchor_header(encode_anchor(state))
    bomb = bytearray(zstandard.ZstdCompressor().compress(b"\x00" * 4))
    huge = 1 << 40  # rewrite the frame's content size field: an 8-byte size, single segment
    frame = bytes([0x28, 0xB5, 0x2F, 0xFD, 0xE0]) + struct.pack("<Q", huge) + bytes(bomb[6:])
    entry = header["tensors"][0]
    entry.update(shape=[huge], lens=[len(frame)], zstd=[True])
    header["sha256"] = combine_digests([("z", "uint8", (huge,), huge, bytes.fromhex(entry["digest"]))])
    head = zstandard.ZstdCompressor().compress(json.dumps(header).encode())
    data = anchor.MAGIC + anchor.PREFIX.pack(anchor.FORMAT_VERSION, len(head)) + head + frame
    with pytest.raises(DeltaError, match="cannot hold"):
        decode_anchor(data)


def test_encoding_and_reading_anchors_import_no_jit_compiler() -> None:
    script = (
        "import sys, torch\n"
        "from flywheel.weights.codec import anchor\n"
        "state = {'w': torch.randn(70000).bfloat16()}\n"
        "assert anchor.read_full(anchor.encode_anchor(state))[0]['w'].equal(state['w'])\n"
        "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_planes_and_streams_round_trip_on_random_bytes_across_blocks(rng: random.Random, dtype: torch.dtype) -> None:
    gen_np = np.random.default_rng(rng.getrandbits(64))
    width = torch.empty((), dtype=dtype).element_size()
    block = planes.BLOCK_BYTES // width
    coding = planes.coding_of(dtype)
    for count in (0, 1, 2, block - 1, block + 1, 2 * block + rng.randrange(block)):
        le = gen_np.integers(0, 256, count * width, dtype=np.uint8)
        split = planes.split_planes(le, coding, width)
        assert len(split) == planes.plane_count(coding, width)
        assert all(p.dtype == np.uint8 and p.size == count for p in split)
        assert np.array_equal(planes.join_planes(split, coding, width, count), le)
        base = planes.exponent_base(le, coding, width) if coding != "bytes" else 0
        streams = planes.cut_streams(le, coding, width, base)
        assert len(streams) == planes.stream_count(coding, width)
        if coding != "bytes":
            assert streams[0].size == (count + 1) // 2 and streams[1].size == planes.escape_count(streams[0], count)
        assert np.array_equal(planes.join_streams(streams, coding, width, count, base), le)


def test_digests_the_caller_already_has_make_the_same_anchor_and_are_checked_on_read() -> None:
    """``encode_anchor(state, digests)`` skips hashing (a full publish hashes each tensor once) and
    writes the very bytes it would have hashed itself; digests that do not fit are refused, and a
    wrong one makes an anchor no read accepts."""
    g = torch.Generator().manual_seed(random.getrandbits(63))
    state = {"w": torch.randn(257, 33, generator=g).bfloat16(), "b": torch.randn(9, generator=g), "e": torch.zeros(0)}
    digests = tensor_digests(state)
    blob = encode_anchor(state, digests)
    assert blob == encode_anchor(state)
    assert decode_anchor(blob)[1] == state_sha256(state, digests) == state_sha256(state)
    for bad in ({"w": digests["w"]}, {**digests, "x": digests["w"]}, {**digests, "b": b"\x00" * 31}):
        with pytest.raises(ValueError, match="digests"):
            encode_anchor(state, bad)
    with pytest.raises(DeltaError, match="digest"):
        decode_anchor(encode_anchor(state, {**digests, "b": digests["w"]}))


def test_read_by_ranges_an_anchor_is_the_same_state_in_few_reads(tmp_path) -> None:
    """AnchorReader (a node reading an anchor from an object store by ranges): the header, then
    runs of consecutive tensors up to READ_BATCH bytes per read, so 300 small tensors cost a few
    requests, not 300; a big tensor is read on its own; the file it writes is the state."""
    import safetensors.torch

    from flywheel.weights.codec.tensorfile import TensorWriter

    g = torch.Generator().manual_seed(3)
    state = {f"norm.{i:03d}": torch.randn(512, generator=g).bfloat16() for i in range(300)}
    state["embed"] = (torch.randn(3000, 2048, generator=g) * 0.02).bfloat16()  # 12 MB: over one batch
    data = encode_anchor(state)
    reads: list[tuple[int, int]] = []

    def read(at: int, length: int) -> bytes:
        reads.append((at, length))
        return data[at : at + length]

    reader = anchor.AnchorReader(read, len(data))
    assert reader.sha256 == state_sha256(state) and [n for n, *_ in reader.layout] == sorted(state)
    with open(tmp_path / "out.safetensors", "wb") as fh:
        writer = TensorWriter(fh.fileno(), reader.layout)
        assert reader.decode_into(writer) == state_sha256(state)
        writer.close()
    assert_same(safetensors.torch.load_file(tmp_path / "out.safetensors"), state)
    body = sorted(reads[2:])
    assert len(reads) == 2 + 2  # prefix, header, the big tensor, the 300 small ones together
    assert max(length for _, length in body) > anchor.READ_BATCH  # the embedding, alone
    assert all(a + n <= b for (a, n), (b, _) in zip(body, body[1:], strict=False))  # no byte read twice
    assert sum(n for _, n in reads) == len(data)


def test_an_anchor_whose_first_tensor_stores_nothing_is_read_by_ranges() -> None:
    """An empty tensor first in the object (no stored bytes) starts a run like any small one."""
    state = {"a.empty": torch.empty(0, dtype=torch.bfloat16), "b.w": torch.randn(64).bfloat16()}
    data = encode_anchor(state)
    got: dict[str, torch.Tensor] = {}
    anchor.anchor_reader(data).decode_into(_Keep(got, state))
    assert_same(got, state)


class _Keep:
    """A writer laid out as ``state`` that keeps what it is given."""

    def __init__(self, into: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        self.into, self.layout = into, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.into[name] = tensor.clone()
