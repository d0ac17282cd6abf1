"""Each rank's peak RSS while a torchrun trainer starts: every rank reading the model against rank 0 alone.

The driver saves a locally built Llama (``--size`` as bench/sharded_publish.py's, built from a
config with a fixed seed, never downloaded) as a Hugging Face directory, then runs each mode as its
own ``torchrun --nproc_per_node N`` job on CPU (gloo, FSDP2), in the same run. Every rank builds
its model and wraps it (``Dist.wrap``), as ``trainer/train.py`` starts:

- ``every rank reads``: the model read on every rank (``lm.load_weights``: what the trainer did
  before, less the tokenizer), then
  ``Dist.wrap`` (each rank receives rank 0's weights in place, then shards them);
- ``rank 0 reads``: ``Dist.start_model`` (rank 0 reads the directory, the others build the model
  without weights, ``lm.skeleton_model``), then ``Dist.wrap``, which sends each whole tensor and
  lets every other rank keep its shard of it;
- ``each rank reads its rows``: every rank, rank 0 included, builds the model without weights and
  ``Dist.wrap(model, files)`` reads its own rows of each tensor from the directory's safetensors
  files (what a sharded trainer does: trainer/train.py).

Each rank reports its peak RSS (``VmHWM``) from start to the wrapped model and its RSS after; the
driver checks that both modes end with the same shards (a hash of every rank's local tensors).
Prints a table; writes JSON (``--json``).

    .venv/bin/python -m bench.trainer_start --size medium --json /tmp/trainer_start.json
    .venv/bin/python -m bench.trainer_start --size tiny            # quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.sharded_publish import SIZES, build_model, rss_mb, torchrun

MODES = ("every rank reads", "rank 0 reads", "each rank reads its rows")


def worker(args: argparse.Namespace) -> None:
    from flywheel.lm import load_weights, skeleton_model
    from flywheel.weights.codec.tensorfile import weight_files
    from trainer.distributed import Dist

    dist = Dist.from_env("cpu", wrapper="fsdp2")
    if args.mode == MODES[2]:
        model = dist.wrap(skeleton_model(args.model), weight_files(args.model))
    else:
        model = dist.wrap(load_weights(args.model) if args.mode == MODES[0] else dist.start_model(args.model))
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(name.encode() + local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    shards = dist.all_gather_object(digest.hexdigest())
    result = {"rank": dist.rank, "peak_mb": rss_mb("VmHWM"), "after_mb": rss_mb("VmRSS"), "shards": shards}
    (Path(args.root) / f"rank{dist.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # Every rank's result is on disk and past the barrier: leave without tearing gloo down. Its
    # teardown at exit aborted rank 0 once under a loaded suite (SIGABRT, "terminate called without
    # an active exception", 2026-11-29), which failed the run after its measurement was complete.
    os._exit(0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trainer-start-") as tmp:
        model_dir = Path(tmp) / "model"
        model = build_model(args.size)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(model_dir)
        del model
        for i, mode in enumerate(MODES):
            root = Path(tmp) / f"mode{i}"
            root.mkdir()
            proc = torchrun("bench.trainer_start", args.ranks,
                            ["--mode", mode, "--model", str(model_dir), "--root", str(root)], timeout_s=900)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            rows[mode] = [json.loads((root / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    same = len({tuple(ranks[0]["shards"]) for ranks in rows.values()}) == 1
    if not same:
        raise SystemExit("the ways of starting left different shards")
    fp32_mb = params * 4 / 2**20
    print(f"{args.ranks} gloo ranks, {params / 1e6:.1f}M parameters ({fp32_mb:,.0f} MB in fp32); "
          f"peak RSS per rank from start to the wrapped model; same shards: {same}")
    print(f"| {'mode':<24} | rank | peak MB | after MB | peak vs every rank reads |")
    print("|---|---|---|---|---|")
    for mode, ranks in rows.items():
        for r in ranks:
            r["peak_vs_every_rank_reads"] = r["peak_mb"] / rows[MODES[0]][r["rank"]]["peak_mb"]
            print(f"| {mode:<24} | {r['rank']:>4} | {r['peak_mb']:>7,.0f} | {r['after_mb']:>8,.0f} | "
                  f"{r['peak_vs_every_rank_reads']:>24.2f} |")
    out = {"size": args.size, "ranks": args.ranks, "params": params, "fp32_mb": fp32_mb, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
