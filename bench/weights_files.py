"""Peak memory and speed of ``flywheel weights diff`` and ``apply`` on a pair of big safetensors files.

It writes a pair of bf16 checkpoints shaped like a ~1B-parameter Llama (``--layers``, ``--hidden``,
``--intermediate``, ``--vocab``; 1.0B elements, ~2 GB a file by default), tensor by tensor: the
base drawn at the usual init scale, the target the base plus a small fp32 update rounded back to
bf16, its size chosen so that ``--changed`` of the elements change (2% by default, what one RL step
changes). Then, each as its own process under ``/usr/bin/time``, in the same run:

- ``control read+hash``: SHA-256 of both files on two threads (what any verified copy of them costs:
  the rate the codec is held against, and a gauge of the machine's load);
- ``control imports``: the interpreter with the codec's imports and nothing else (RSS floor);
- ``control write``: writing a new file of one checkpoint's size into the page cache (unlinked
  before the kernel need write it back); ``control write + fsync``: the same file made durable
  first, as ``apply`` and a node make their output (what that output costs the disk whatever the
  codec does: the floor of both rows); ``control direct write``: the same durable file written
  around the page cache (``O_DIRECT``, aligned), as ``apply`` writes its output by default;
- ``streaming diff`` / ``streaming apply``: the commands as a user runs them; ``apply --buffered``:
  the apply writing its output through the page cache, as it did before it wrote directly;
- ``in-memory diff`` / ``in-memory apply`` (unless ``--no-baseline``): the same work through the
  whole-state API (:func:`encode_delta` / :func:`apply_delta` on :func:`decode_full` of the files),
  what the commands did before they streamed;
- ``node apply``: a vLLM node in full mode going from the base to the target through the registry
  (SQLite and a folder store in the temp folder: the base published as v0, the target as the delta
  v1), :func:`flywheel.weights.files.rebuild_file` from the base file it serves to the new file vLLM
  reloads; ``node from anchor``: the same update by a node that holds no version on the chain,
  from v0's compressed anchor read by ranges and then the delta; ``node apply, whole`` (unless
  ``--no-baseline``): what the node did before, the base decoded whole, ``Registry.load`` on it
  and the new state written as one safetensors file.

Per row: wall time (best of ``--repeats``), peak RSS (max over repeats) and its share of the two
input files' size, GB/s of model bytes (one file's size over the wall time; "after start": over
the wall time less the imports control, the interpreter's fixed start-up), and the ratio to the
read+hash control. The apply's and the node's outputs are checked byte for byte against the target file (the
generator lays files out as :class:`TensorWriter` does, so a correct apply reproduces the file
exactly), and the streaming delta against the in-memory one. Files are read warm from the page
cache, as right after a download.

On a virtual machine the first write of memory the guest has not used lately costs the host a fault
per page: filling 2.3 GB of new page cache took 5 s of system time here the first time and 0.4 s
right after the same amount was freed (one process writing a file three times). So a row that
writes a file would be timed on what the rows before it freed. Before each row the driver writes
and drops a file of one checkpoint's size (``--no-prime`` skips it), and calls ``sync`` (untimed), so
every row starts with backed memory free and nothing of another row's left to write back: the
rows measure the commands and the disk, not the hypervisor. Prints a table; ``--json PATH``
writes it (``primed`` says which way it ran).

    .venv/bin/python -m bench.weights_files --json /tmp/weights-files.json
    .venv/bin/python -m bench.weights_files --layers 2 --vocab 4096 --repeats 1 --no-baseline   # quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flywheel.weights.codec.tensorfile import TensorWriter

PYTHON = sys.executable
FLYWHEEL = [PYTHON, "-m", "launch.cli"]
_IN_MEMORY = """
import sys
from pathlib import Path
from flywheel.weights.codec.delta import apply_delta, encode_delta
from flywheel.weights.codec.tensorfile import TensorReader
def read(p):
    with TensorReader(p) as r:
        return {n: r.read(n).clone() for n in sorted(r.index)}
if sys.argv[1] == "diff":
    Path(sys.argv[4]).write_bytes(encode_delta(read(sys.argv[2]), read(sys.argv[3])))
else:
    new = apply_delta(read(sys.argv[2]), Path(sys.argv[3]).read_bytes())
    print(len(new))
"""
_NODE = """
import sys
from flywheel.db.session import make_engine, make_session_factory
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
url, store, old, out = sys.argv[2:6]
registry = Registry(make_session_factory(make_engine(url)), FolderStore(store), "bench")
if sys.argv[1] == "stream":
    from flywheel.weights.files import rebuild_file
    rebuild_file(registry, 1, out, base=(0, [old]))
elif sys.argv[1] == "anchor":
    from flywheel.weights.files import rebuild_file
    rebuild_file(registry, 1, out)
else:
    from flywheel.weights.codec.state import decode_full, encode_full
    from serving.node.vllm_files import write_synced
    state = registry.load(1, base=(0, decode_full(open(old, "rb").read())))
    write_synced(out, encode_full(state))
"""
_IMPORTS = "import torch, numba, flywheel.weights.codec.streaming, flywheel.weights.codec.tensor_coding"


def layout(layers: int, hidden: int, intermediate: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-style decoder (untied embeddings)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden)),
                                                  ("lm_head.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
                   (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (intermediate, hidden)), (p + "mlp.up_proj.weight", (intermediate, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, intermediate)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return sorted(shapes)


def _update_scale(changed: float, generator: torch.Generator) -> float:
    """The std of an fp32 update to N(0, 0.02) weights that changes ``changed`` of them in bf16."""
    w = (torch.randn(1 << 20, generator=generator) * 0.02).bfloat16()
    noise = torch.randn(w.shape, generator=generator)
    lo, hi = 1e-9, 1e-2
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        frac = ((w.float() + noise * mid).bfloat16() != w).float().mean().item()
        lo, hi = (mid, hi) if frac < changed else (lo, mid)
    return (lo * hi) ** 0.5


def write_pair(old: Path, new: Path, shapes: list[tuple[str, tuple[int, ...]]], changed: float, seed: int) -> int:
    """Write the base and target files (bounded memory: one tensor at a time); returns the changed count."""
    generator = torch.Generator().manual_seed(seed)
    scale = _update_scale(changed, generator)
    spec = [(name, torch.bfloat16, shape) for name, shape in shapes]
    count = 0
    with open(old, "wb") as fo, open(new, "wb") as fn:
        wo, wn = TensorWriter(fo.fileno(), spec), TensorWriter(fn.fileno(), spec)
        for name, shape in shapes:
            if len(shape) == 1:
                base = torch.ones(shape, dtype=torch.bfloat16)
                target = (base.float() + torch.randn(shape, generator=generator) * 1e-3).bfloat16()
            else:
                base = (torch.randn(shape, generator=generator) * 0.02).bfloat16()
                target = (base.float() + torch.randn(shape, generator=generator) * scale).bfloat16()
            count += int((base != target).sum())
            wo.write(name, base)
            wn.write(name, target)
            del base, target
        wo.close()
        wn.close()
    return count


def _hash_files(*paths: str) -> None:
    def one(path: str) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, paths))


def _write_file(path: str, size: int, durable: bool = False, direct: bool = False) -> None:
    chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()  # not zeros: a disk may skip those
    if direct:  # O_DIRECT: from a page-aligned buffer, whole blocks, the last one cut back after
        aligned = mmap.mmap(-1, len(chunk))
        aligned[:] = chunk
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for at in range(0, size, len(chunk)):
            n = min(len(chunk), -(-(size - at) // 4096) * 4096)
            os.pwrite(fd, memoryview(aligned)[:n], at)
        os.ftruncate(fd, size)
        os.fsync(fd)
        os.close(fd)
        os.unlink(path)
        return
    with open(path, "wb") as fh:
        for _ in range(size // len(chunk)):
            fh.write(chunk)
        fh.write(chunk[: size % len(chunk)])
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.unlink(path)


def publish_pair(folder: Path, old: str, new: str) -> str:
    """A registry (SQLite + folder store under ``folder``) whose v0 is ``old`` and v1 the delta to
    ``new``, as the trainer would have published them; returns its database URL."""
    from flywheel.db.session import make_engine, make_session_factory, upgrade
    from flywheel.weights.codec.tensorfile import TensorReader
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import FolderStore

    url = f"sqlite:///{folder / 'registry.db'}"
    upgrade(url)
    registry = Registry(make_session_factory(make_engine(url)), FolderStore(folder / "store"), "bench", full_every=50)
    with TensorReader(old) as a, TensorReader(new) as b:
        base = {n: a.read(n) for n in sorted(a.index)}
        registry.publish(base, parent=None)
        info = registry.publish({n: b.read(n) for n in sorted(b.index)}, parent=0, parent_state=base)
    if info.kind != "delta":
        raise RuntimeError(f"the registry stored v1 as a {info.kind}, not a delta")
    return url


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of ``cmd`` run to completion (it must succeed), started
    once the disk has written back what earlier rows wrote (``sync``, not timed), so that no row
    pays for another's write-back."""
    os.sync()
    with tempfile.NamedTemporaryFile("r") as report:
        start = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report.name, *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return wall, int(report.read().split()[-1]) * 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--changed", type=float, default=0.02, help="fraction of elements the update changes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-memory rows")
    parser.add_argument("--dir", type=Path, help="where the files go (default: a temp folder, removed after)")
    parser.add_argument("--no-prime", action="store_true",
                        help="do not write and drop a file of one checkpoint's size before each row (module docstring)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    shapes = layout(args.layers, args.hidden, args.intermediate, args.vocab)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        old, new, delta, out = (str(d / n) for n in ("old.safetensors", "new.safetensors", "d.delta", "out.safetensors"))
        t0 = time.perf_counter()
        changed = write_pair(Path(old), Path(new), shapes, args.changed, args.seed)
        generated = time.perf_counter() - t0
        size = os.path.getsize(new)
        elements = sum(torch.Size(s).numel() for _, s in shapes)
        largest = max(torch.Size(s).numel() for _, s in shapes) * 2
        cases: list[tuple[str, list[str] | Any]] = [
            ("control read+hash", [PYTHON, "-c", f"from bench.weights_files import _hash_files; _hash_files({old!r}, {new!r})"]),
            ("control write", [PYTHON, "-c", f"from bench.weights_files import _write_file; "
                                              f"_write_file({out + '.control'!r}, {os.path.getsize(new)})"]),
            ("control write + fsync", [PYTHON, "-c", f"from bench.weights_files import _write_file; "
                                                      f"_write_file({out + '.control'!r}, {os.path.getsize(new)}, True)"]),
            ("control direct write", [PYTHON, "-c", f"from bench.weights_files import _write_file; "
                                                     f"_write_file({out + '.control'!r}, {os.path.getsize(new)}, True, True)"]),
            ("control imports", [PYTHON, "-c", _IMPORTS]),
            ("streaming diff", [*FLYWHEEL, "weights", "diff", old, new, "-o", delta]),
            ("streaming apply", [*FLYWHEEL, "weights", "apply", old, delta, "-o", out]),
            ("apply --buffered", [*FLYWHEEL, "weights", "apply", "--buffered", old, delta, "-o", out + ".buffered"]),
        ]
        url = publish_pair(d, old, new)
        node_out = str(d / "node.safetensors")
        cases.append(("node apply", [PYTHON, "-c", _NODE, "stream", url, str(d / "store"), old, node_out]))
        cases.append(("node from anchor", [PYTHON, "-c", _NODE, "anchor", url, str(d / "store"), old,
                                           str(d / "node-anchor.safetensors")]))
        if not args.no_baseline:
            cases += [("in-memory diff", [PYTHON, "-c", _IN_MEMORY, "diff", old, new, delta + ".mem"]),
                      ("in-memory apply", [PYTHON, "-c", _IN_MEMORY, "apply", old, delta]),
                      ("node apply, whole", [PYTHON, "-c", _NODE, "whole", url, str(d / "store"), old,
                                             str(d / "node-whole.safetensors")])]
        rows: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):
            for label, cmd in cases:
                if (label.startswith("in-memory") or label.endswith("whole")) and label in rows:
                    continue  # once is enough for the slow whole-state path
                if not args.no_prime:  # memory the VM has backed, for the page cache this row fills
                    _write_file(out + ".prime", size)
                wall, rss = timed(cmd)
                row = rows.setdefault(label, {"wall_s": wall, "peak_rss": rss})
                row["wall_s"], row["peak_rss"] = min(row["wall_s"], wall), max(row["peak_rss"], rss)
        with open(out, "rb") as a, open(new, "rb") as b, open(node_out, "rb") as c, open(out + ".buffered", "rb") as f:
            target = hashlib.sha256(b.read()).digest()
            exact = hashlib.sha256(a.read()).digest() == target == hashlib.sha256(c.read()).digest()
            exact = exact and hashlib.sha256(f.read()).digest() == target
        with open(d / "node-anchor.safetensors", "rb") as e:
            exact = exact and hashlib.sha256(e.read()).digest() == target
        if not args.no_baseline:
            exact = exact and Path(delta).read_bytes() == Path(delta + ".mem").read_bytes()
        delta_bytes = os.path.getsize(delta)
    control = rows["control read+hash"]["wall_s"]
    start_up = rows["control imports"]["wall_s"]
    for label, row in rows.items():
        row["gbps"] = size / row["wall_s"] / 1e9
        row["rss_pct_of_pair"] = 100 * row["peak_rss"] / (2 * size)
        row["vs_control"] = row["wall_s"] / control
        if not label.startswith("control"):  # the interpreter's start (imports) is a fixed cost, not per byte
            row["work_gbps"] = size / max(row["wall_s"] - start_up, 1e-9) / 1e9
    result = {"elements": elements, "file_bytes": size, "largest_tensor_bytes": largest, "changed": changed,
              "fraction_changed": changed / elements, "delta_bytes": delta_bytes,
              "delta_pct": 100 * delta_bytes / size, "bit_exact": exact, "generate_s": generated,
              "load_avg_1m": os.getloadavg()[0], "primed": not args.no_prime, "rows": rows}
    print(f"pair: 2 x {size / 1e9:.2f} GB bf16 ({elements / 1e9:.2f}B elements, largest tensor "
          f"{largest / 1e6:.0f} MB), {100 * changed / elements:.2f}% changed; delta {delta_bytes:,} bytes "
          f"({result['delta_pct']:.3f}% of a file); output byte-identical to the target: {exact}")
    print(f"{'':<22} {'wall s':>8} {'GB/s':>7} {'after start':>12} {'x read+hash':>12} {'peak RSS':>10} "
          f"{'% of pair':>10}")
    for label, row in rows.items():
        work = f"{row['work_gbps']:.2f}" if "work_gbps" in row else "-"
        print(f"{label:<22} {row['wall_s']:>8.2f} {row['gbps']:>7.2f} {work:>12} {row['vs_control']:>12.2f} "
              f"{row['peak_rss'] / 2**20:>8.0f}Mi {row['rss_pct_of_pair']:>9.1f}%")
    print(f"(best of {args.repeats} wall, max peak RSS; load average {result['load_avg_1m']:.2f}; "
          f"{'primed' if result['primed'] else 'not primed'})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
