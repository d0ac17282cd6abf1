"""A node several versions behind: the chain rebuilt in one pass against a file written per version.

It builds a line of ``--elements`` bf16 weights in tensors of ``--tensor`` elements, publishes v0 as
an anchor and ``--behind`` deltas after it (each ``--changed`` of the elements moved by Adam-sized
steps) into a SQLite registry and a folder store in a temp folder, writes v0 as the node's file, and
then times, in this process and in the same run:

- ``one pass``: :func:`flywheel.weights.files.rebuild_file` from the v0 file to the last version, as
  a node runs it (every delta of the chain in one pass: one file written, and hashed once);
- ``one pass, every step hashed``: the same with every version's base and target hashes checked
  (``apply_chain(every_step=True)``, what a pass does after a failure, and did always before);
- ``a file per version``: the same with ``PASS_BYTES`` at 1, one pass per version, what the node did
  before (a file written and read back per version);
- ``control: copy``: the v0 file copied and fsynced (what writing one model costs this filesystem).

Each row's wall time is the best of ``--repeats``; ``vs per version`` is its ratio to the second row;
``written`` is what the row's last run handed to write calls (``wchar``: step files, the output,
the registry's reads leave it alone). Every output is checked against
the last version's sha256. Prints a table; ``--json PATH`` writes it.

    .venv/bin/python -m bench.chain_rebuild --json /tmp/chain-rebuild.json
    .venv/bin/python -m bench.chain_rebuild --elements 4000000 --behind 3 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.weights import files
from flywheel.weights.codec.state import encode_full
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore


def states(elements: int, tensor: int, behind: int, changed: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """v0 at the usual init scale and ``behind`` versions after it, each moving about ``changed``
    of the bf16 elements (an fp32 step rounded back, as an optimizer's update is)."""
    g = torch.Generator().manual_seed(seed)
    count = max(1, elements // tensor)
    chain = [{f"layer.{i}.weight": (torch.randn(tensor, generator=g) * 0.02).bfloat16() for i in range(count)}]
    for _ in range(behind):
        nxt = {}
        for name, t in chain[-1].items():
            moved = torch.rand(t.shape, generator=g) < changed
            step = torch.where(moved, t.float() * torch.where(torch.rand(t.shape, generator=g) < 0.5, 1.01, 0.99), t.float())
            nxt[name] = step.bfloat16()
        chain.append(nxt)
    return chain


def written() -> int:
    """Bytes this process has handed to write calls so far (``wchar`` in ``/proc/self/io``)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("wchar:"))


def timed(row: str, repeats: int, job: Any) -> dict[str, Any]:
    """``job``'s best wall time over ``repeats`` runs, and the bytes its last run wrote."""
    times = []
    for _ in range(repeats):
        before = written()
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
        wrote = written() - before
    return {"row": row, "wall_s": min(times), "written": wrote}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=200_000_000)
    parser.add_argument("--tensor", type=int, default=4_000_000)
    parser.add_argument("--behind", type=int, default=5)
    parser.add_argument("--changed", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="chain-rebuild-") as tmp:
        folder = Path(tmp)
        url = f"sqlite:///{folder / 'registry.db'}"
        upgrade(url)
        registry = Registry(make_session_factory(make_engine(url)), FolderStore(folder / "store"), "bench", full_every=1000)
        chain = states(args.elements, args.tensor, args.behind, args.changed, args.seed)
        registry.publish(chain[0], parent=None)
        for v in range(1, len(chain)):
            if registry.publish(chain[v], parent=v - 1, parent_state=chain[v - 1]).kind != "delta":
                raise RuntimeError(f"v{v} was not stored as a delta")
        base = folder / "v0.safetensors"
        base.write_bytes(encode_full(chain[0]))
        model = base.stat().st_size
        delta_bytes = sum(registry.get(v).bytes for v in range(1, len(chain)))
        last = registry.get(args.behind)
        del chain
        out = folder / "out.safetensors"

        def rebuild() -> None:
            if files.rebuild_file(registry, args.behind, out, base=(0, [base])) != last.sha256:
                raise RuntimeError("the rebuilt file does not have the last version's hash")

        def every_step() -> None:
            saved = files.apply_chain
            files.apply_chain = functools.partial(saved, every_step=True)
            try:
                rebuild()
            finally:
                files.apply_chain = saved

        def per_version() -> None:
            saved = files.PASS_BYTES
            files.PASS_BYTES = 1
            try:
                rebuild()
            finally:
                files.PASS_BYTES = saved

        def copy() -> None:
            shutil.copyfile(base, out)
            with open(out, "rb+") as fh:
                os.fsync(fh.fileno())

        rebuild()  # the kernels compiled and the pool started before anything is timed
        rows = [timed("one pass", args.repeats, rebuild), timed("one pass, every step hashed", args.repeats, every_step),
                timed("a file per version", args.repeats, per_version), timed("control: copy", args.repeats, copy)]
    baseline = rows[2]["wall_s"]
    for row in rows:
        row["vs_per_version"] = row["wall_s"] / baseline
    report = {"elements": args.elements, "behind": args.behind, "changed": args.changed, "model_bytes": model,
              "delta_bytes": delta_bytes, "load_average": os.getloadavg()[0], "rows": rows}
    print(f"{args.behind} versions behind on {model / 1e9:.2f} GB bf16 ({delta_bytes / 1e6:.1f} MB of deltas), "
          f"load average {report['load_average']:.2f}")
    print(f"| {'':<28} | wall s | vs per version | written |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['row']:<28} | {row['wall_s']:6.2f} | {row['vs_per_version']:5.2f} | {row['written'] / 1e9:.2f} GB |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
