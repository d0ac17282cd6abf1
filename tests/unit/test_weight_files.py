"""Deltas between safetensors files, tensor by tensor: the same bytes as the whole-state codec, exact
rebuilds, bad files and bad deltas refused, and memory bounded by the largest tensor."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flywheel.weights.codec import streaming
from flywheel.weights.codec.delta import encode_delta
from flywheel.weights.codec.state import DeltaError, state_sha256
from flywheel.weights.codec.streaming import Step, StepError, apply_chain, apply_files, delta_layout, diff_files
from flywheel.weights.codec.tensorfile import TensorReader, TensorWriter
from tests.unit.test_codec import assert_same, perturb, random_state

pytestmark = pytest.mark.unit


def save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` as the reference writer lays it out."""
    path.write_bytes(safetensors.torch.save({k: v.contiguous() for k, v in state.items()}))
    return path


def load(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(path.read_bytes())


def pair(rng: random.Random) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A base and a target with every kind of tensor a delta meets: changed floats, untouched ones,
    integers and booleans, one tensor gone, one new, one reshaped, one empty."""
    old = random_state(rng)
    new = perturb(rng, old, 0.02)
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    old["steps"] = torch.randint(0, 1000, (64,), generator=g)
    new["steps"] = old["steps"] + 1
    old["mask"] = torch.rand(33, generator=g) > 0.5
    new["mask"] = old["mask"].clone()
    old["gone"] = torch.randn(5, 5, generator=g)
    new["added"] = torch.randn(7, generator=g).half()
    old["reshaped"] = torch.randn(4, 6, generator=g).bfloat16()
    new["reshaped"] = old["reshaped"].reshape(6, 4).clone()
    new["empty"] = old["empty"] = torch.empty(0, 3)
    return old, new


def test_streamed_diff_is_the_codecs_delta_and_apply_rebuilds_the_target(rng: random.Random, tmp_path: Path) -> None:
    old, new = pair(rng)
    a, b = save(tmp_path / "a.safetensors", old), save(tmp_path / "b.safetensors", new)
    delta, summary = diff_files(a, b)
    ordered = lambda s: dict(sorted(s.items()))  # noqa: E731 - the files' tensors, in name order
    assert delta == encode_delta(ordered(old), ordered(new))
    assert summary["elements"] == sum(t.numel() for t in new.values())
    assert 0 < summary["changed"] < summary["elements"]
    with open(tmp_path / "out.safetensors", "wb") as fh:
        sha = apply_files(a, delta, fh.fileno())
    rebuilt = load(tmp_path / "out.safetensors")
    assert_same(rebuilt, new)
    assert sha == state_sha256(new) == state_sha256(rebuilt)
    # Written around the page cache (O_DIRECT: the temp folder's filesystem takes it), the same file.
    with open(tmp_path / "direct.safetensors", "wb") as fh:
        assert apply_files(a, delta, fh.fileno(), direct=True) == sha
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "out.safetensors").read_bytes()


def test_apply_refuses_the_wrong_base_and_a_corrupt_delta(rng: random.Random, tmp_path: Path) -> None:
    old, new = pair(rng)
    a, b = save(tmp_path / "a.safetensors", old), save(tmp_path / "b.safetensors", new)
    delta, _ = diff_files(a, b)
    with open(tmp_path / "out", "wb") as fh, pytest.raises(DeltaError, match="different parent"):
        apply_files(b, delta, fh.fileno())
    failures = 0
    for i in range(40):
        damaged = bytearray(delta)
        damaged[len(delta) // 2 + i * 7 % (len(delta) // 2)] ^= 1 << (i % 8)
        with open(tmp_path / "out", "wb") as fh:
            try:
                sha = apply_files(a, bytes(damaged), fh.fileno())
            except DeltaError:
                failures += 1
                continue
        assert sha == state_sha256(new) and state_sha256(load(tmp_path / "out")) == sha  # a flip that changes nothing
    assert failures > 30


def test_a_chain_applies_in_one_pass_as_its_deltas_do_one_by_one(rng: random.Random, tmp_path: Path) -> None:
    """Three deltas (tensors added, dropped, reshaped on the way) applied in one pass write the file
    the three applied one by one write; a damaged middle delta is blamed on its step, a wrong base
    on the first."""
    states = list(pair(rng))
    states.append(perturb(rng, states[-1], 0.02))
    states.append({n: t for n, t in perturb(rng, states[-1], 0.02).items() if n != "steps"})
    files = [save(tmp_path / f"s{i}.safetensors", s) for i, s in enumerate(states)]
    deltas = [diff_files(a, b)[0] for a, b in zip(files, files[1:])]

    def chained(base: Path, chain: list[bytes], out: Path) -> str:
        with open(out, "wb") as fh, TensorReader(base) as old:
            writer = TensorWriter(fh.fileno(), delta_layout(chain[-1]))
            got = apply_chain(old, [Step([(d, None)]) for d in chain], writer)
            writer.close()
        return got

    hashed = []
    digest = streaming.tensor_digest
    with pytest.MonkeyPatch.context() as patch:  # a clean pass hashes each tensor it writes, once
        patch.setattr(streaming, "tensor_digest", lambda t: hashed.append(t.shape) or digest(t))
        assert chained(files[0], deltas, tmp_path / "chained") == state_sha256(states[-1])
    assert len(hashed) == len(states[-1])
    step_by_step = files[0]
    for i, delta in enumerate(deltas):
        with open(tmp_path / f"one{i}", "wb") as fh:
            apply_files(step_by_step, delta, fh.fileno())
        step_by_step = tmp_path / f"one{i}"
    assert (tmp_path / "chained").read_bytes() == step_by_step.read_bytes()
    assert_same(load(tmp_path / "chained"), states[-1])

    # A wrong base: the mask, which every delta leaves as it is, flipped (a base that differs only
    # where the chain rewrites everything would give the target all the same: pair() may draw one).
    flipped = save(tmp_path / "wrong.safetensors", {**states[0], "mask": ~states[0]["mask"]})
    with pytest.raises(StepError, match="different parent") as wrong:
        chained(flipped, deltas, tmp_path / "out")
    assert wrong.value.step == 0
    blamed = set()
    for i in range(20):
        damaged = bytearray(deltas[1])
        damaged[len(damaged) // 2 + i * 11 % (len(damaged) // 2)] ^= 1 << (i % 8)
        try:
            chained(files[0], [deltas[0], bytes(damaged), deltas[2]], tmp_path / "out")
        except StepError as exc:
            blamed.add(exc.step)
    assert blamed == {1}


def test_bad_files_are_refused_with_a_delta_error(tmp_path: Path) -> None:
    good = save(tmp_path / "good.safetensors", {"w": torch.ones(4, 4)})
    data = good.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    beyond = dict(header, w=dict(header["w"], data_offsets=[0, 128]))
    text = json.dumps(beyond).encode()
    cases = {
        "short": data[:5],
        "truncated": data[:-8],
        "huge header": struct.pack("<Q", 1 << 40) + data[8:],
        "not json": struct.pack("<Q", 4) + b"\xff\xfe{]" + data[12:],
        "offsets past the end": struct.pack("<Q", len(text)) + text + data[8 + length :],
        "unknown dtype": data.replace(b'"F32"', b'"Q99"'),
    }
    for label, body in cases.items():
        (tmp_path / "bad").write_bytes(body)
        with pytest.raises(DeltaError):
            TensorReader(tmp_path / "bad")
            pytest.fail(label)


def test_writer_lays_files_out_as_the_reference_reader_expects(rng: random.Random, tmp_path: Path) -> None:
    state, _ = pair(rng)
    path = tmp_path / "w.safetensors"
    with open(path, "wb") as fh:
        writer = TensorWriter(fh.fileno(), [(n, t.dtype, tuple(t.shape)) for n, t in state.items()], {"k": "v"})
        for name in reversed(list(state)):
            writer.write(name, state[name])
        writer.close()
    assert_same(load(path), state)
    with TensorReader(path) as reader:
        assert reader.metadata == {"k": "v"}
        assert_same({n: reader.read(n) for n in reader.index}, state)
    with open(path, "r+b") as fh:
        writer = TensorWriter(fh.fileno(), [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
        writer.write("a", torch.ones(2))
        with pytest.raises(DeltaError, match="bytes where the layout"):
            writer.write("b", torch.ones(2))
        with pytest.raises(DeltaError, match="never written"):
            writer.close()


_MEASURE = """
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM, the peak, starts again from the current RSS
before = status("VmRSS")
JOB
print(status("VmHWM") - before)
"""


def _growth(warm: str, job: str) -> int:
    """How far (bytes) a fresh interpreter's peak RSS rises above its RSS after ``warm`` while it
    runs ``job`` (Linux: ``clear_refs`` resets the peak)."""
    code = warm + _MEASURE.replace("JOB", job)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    return int(done.stdout.split()[-1])


def test_memory_stays_bounded_by_the_largest_tensor_not_the_model(tmp_path: Path) -> None:
    """Files of 20 tensors of 4 MB (80 MB each): diff and apply hold a few tensors, never a file,
    while the whole-state path, measured the same way, holds both files."""
    g = torch.Generator().manual_seed(0)
    old = {f"layer.{i}": (torch.randn(2048, 1024, generator=g) * 0.02).bfloat16() for i in range(20)}
    new = {n: (t.float() + torch.randn(t.shape, generator=g) * 2e-6).bfloat16() for n, t in old.items()}  # ~2% change
    a, b = save(tmp_path / "a.safetensors", old), save(tmp_path / "b.safetensors", new)
    tiny_a, tiny_b = save(tmp_path / "ta", {"w": torch.zeros(64)}), save(tmp_path / "tb", {"w": torch.ones(64)})
    del old, new
    largest, file_size = 2048 * 1024 * 2, a.stat().st_size
    warm = ("import os\nfrom flywheel.weights.codec.streaming import apply_files, diff_files\n"  # kernels loaded
            f"d, _ = diff_files({str(tiny_a)!r}, {str(tiny_b)!r})\n"
            f"apply_files({str(tiny_a)!r}, d, os.open({str(tmp_path / 'tiny-out')!r}, os.O_CREAT | os.O_WRONLY))\n")
    diff = _growth(warm, f"d, _ = diff_files({str(a)!r}, {str(b)!r})\nopen({str(tmp_path / 'd')!r}, 'wb').write(d)")
    apply = _growth(warm, f"apply_files({str(a)!r}, open({str(tmp_path / 'd')!r}, 'rb').read(), "
                          f"os.open({str(tmp_path / 'out')!r}, os.O_CREAT | os.O_WRONLY))")
    direct = _growth(warm, f"apply_files({str(a)!r}, open({str(tmp_path / 'd')!r}, 'rb').read(), "
                           f"os.open({str(tmp_path / 'out-direct')!r}, os.O_CREAT | os.O_WRONLY), direct=True)")
    whole = _growth(warm, "from flywheel.weights.codec.delta import encode_delta\n"
                          "from flywheel.weights.codec.tensorfile import TensorReader\n"
                          "def read(p):\n    with TensorReader(p) as r:\n        return {n: r.read(n) for n in r.index}\n"
                          f"encode_delta(read({str(a)!r}), read({str(b)!r}))")
    # Two threads, each with a base and a target (diff) or a base and an output buffer (apply) in
    # hand, plus the kernels' per-tensor scratch: a few tensors, whatever the file's size.
    for label, grew in (("diff", diff), ("apply", apply), ("direct apply", direct)):
        assert grew < 8 * largest, f"{label}: {grew / 2**20:.1f} MiB over the interpreter"
    assert whole > 2 * file_size  # the measurement sees a state held whole
    assert state_sha256(load(tmp_path / "out")) == state_sha256(load(b)) == state_sha256(load(tmp_path / "out-direct"))
