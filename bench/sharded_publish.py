"""Rank 0's peak RSS during a delta publish under torchrun: sharded (trainer/shard_publish.py) vs a full gather.

Each mode is its own ``torchrun --nproc_per_node N`` job on CPU (gloo, FSDP2), in the same run,
or with ``--ranks 1`` its own plain process, as a single-process trainer runs (its sharded modes
are the trainer's inline publish point in one process). The model is the same locally built Llama
(``--size``: ``small`` ~106M parameters, ``medium`` ~0.44B, ``tiny`` for tests, ``moe`` a tiny
Qwen3-MoE; built from a config with a fixed seed, never downloaded). Every rank wraps the model,
allocates AdamW's moments (what a training rank holds), and the job publishes v0 (a full version)
and then, after a deterministic elementwise change of about one weight in eight (the same whatever
the sharding), v1 as a delta on v0, into its own SQLite registry and folder store:

- ``gather``: what the trainer does today: ``Dist.full_state_dict`` (the fp32 master on rank 0),
  its bf16 export, ``Registry.publish`` against the parent's export rank 0 keeps (the trainer's
  ``published``). The trainer's exporter replica (another fp32 model on rank 0) is left out, so
  this baseline understates today's cost.
- ``gather+adam``: the same plus ``Dist.optimizer_state_dict``, the Adam gather the checkpoint at
  a publish point needs today (checkpoints are not sharded yet).
- ``gather+ckpt``: the whole gathered publish point: the same, with the checkpoint written
  (``checkpoint.save``: the master and Adam state) before the publish.
- ``sharded``: ``ShardedPublisher.publish``: each rank codes and uploads its own shard, rank 0
  writes the manifest.
- ``sharded+ckpt``: the trainer's publish point with ``trainer.sharded_versions``:
  ``checkpoint.save_sharded`` (each rank writes its shards of the fp32 master and the Adam moments,
  torch DCP; rank 0 the checkpoint file) and then the sharded publish.

Rank 0 measures its peak: before v1's publish it frees what it can (``gc``, ``malloc_trim``) and
resets the kernel's high-water mark (``/proc/self/clear_refs``), after it reads ``VmHWM``. Ranks run
with ``MALLOC_MMAP_THRESHOLD_`` fixed, so freed big buffers go back to the system at once. The
driver then loads v1 from the sharded run's registry, as a node does (``Registry.load``), and
checks that it rebuilds the gather run's v1 hash. Prints a table; writes JSON (``--json``).

    .venv/bin/python -m bench.sharded_publish --json /tmp/sharded_publish.json
    .venv/bin/python -m bench.sharded_publish --size tiny            # quick
    .venv/bin/python -m bench.sharded_publish --ranks 1 --modes gather+ckpt,sharded+ckpt

``--worker`` is one rank's side (the driver starts it under torchrun); ``--check`` also gathers v1
whole and hashes it; ``--fault drop|kill`` then publishes v2 with rank 1 losing its shard upload
or dying after it (the tests' chaos: no v2 may appear).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("gather", "gather+adam", "gather+ckpt", "sharded", "sharded+ckpt")
SIZES = {
    "medium": {"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12,
               "num_attention_heads": 12},
    "small": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
              "num_attention_heads": 12},
    # Many small tensors: a shard dwarfs its largest tensor, so what a publish holds per tensor
    # and what it holds per shard separate (the tests' size).
    "deep": {"vocab_size": 512, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 24,
             "num_attention_heads": 8},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4},
    # A mixture of experts (Qwen3-MoE) whose fused experts a version holds one per expert, as its
    # checkpoint does (flywheel/weightnames.py): the tests' check that the names survive sharding.
    "moe": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "moe_intermediate_size": 32, "num_experts": 6, "num_experts_per_tok": 2},
}


def build_model(size: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = SIZES[size]
    if "num_experts" in cfg:
        moe = AutoConfig.for_model("qwen3_moe", **cfg, num_key_value_heads=cfg["num_attention_heads"], head_dim=16,
                                   tie_word_embeddings=False, max_position_embeddings=256)
        return AutoModelForCausalLM.from_config(moe).float().eval()
    config = LlamaConfig(**cfg, num_key_value_heads=cfg["num_attention_heads"], tie_word_embeddings=False,
                         max_position_embeddings=256)
    return LlamaForCausalLM(config).float().eval()


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Move about one fp32 weight in eight by 2^-5 of itself, chosen by the weight's own low bits:
    elementwise, so every sharding of the model changes the same weights."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        moved = (local.view(torch.int32) & 7) == 0
        local.add_(torch.where(moved, local * 2.0**-5, torch.zeros_like(local)))


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the measurement is only less tight
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mb("VmRSS")


class FaultyStore:
    """The run's store, with rank 1's shard uploads of the faulted publish dropped or fatal."""

    def __init__(self, store: Any, fault: str) -> None:
        self.inner, self.fault, self.armed = store, fault, False

    def put(self, key: str, data: bytes) -> None:
        if self.armed and self.fault == "drop":
            return  # lost on the way: the read-back finds nothing
        self.inner.put(key, data)
        if self.armed and self.fault == "kill":
            os._exit(3)  # dies mid-publish, its shard uploaded, before the gather

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def worker(args: argparse.Namespace) -> None:
    from flywheel.db.session import make_engine, make_session_factory, upgrade
    from flywheel.weightnames import to_checkpoint
    from flywheel.weights.codec.delta import encode_delta
    from flywheel.weights.codec.state import state_sha256
    from flywheel.weights.registry import Registry, WeightsError
    from flywheel.weights.store import FolderStore
    from trainer import checkpoint
    from trainer.distributed import Dist, unwrap
    from trainer.shard_publish import ShardedPublisher

    root = Path(args.root)
    dist = Dist.from_env("cpu", wrapper="fsdp2")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = None
    if dist.is_main:
        upgrade(url)
        registry = Registry(make_session_factory(make_engine(url)), FolderStore(root / "store"), "bench", full_every=50)
    store: Any = FolderStore(root / "store")
    if args.fault and dist.rank == 1:
        store = FaultyStore(store, args.fault)
    model = dist.wrap(build_model(args.size))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # allocates the moments (lr 0: no change)
    optimizer.zero_grad(set_to_none=True)

    sharded = (ShardedPublisher(dist, model, store, "bench", registry, workdir=root / "publish-shards")
               if args.mode.startswith("sharded") else None)
    published: dict[str, torch.Tensor] | None = None

    def gather_publish(parent: int | None) -> Any:
        nonlocal published
        master = dist.full_state_dict(model)
        adam = dist.optimizer_state_dict(model, optimizer) if args.mode in ("gather+adam", "gather+ckpt") else None
        info = None
        if dist.is_main:
            if args.mode == "gather+ckpt":  # the gathered publish point: checkpoint, then publish
                checkpoint.save(root / "checkpoints", checkpoint.Checkpoint(
                    model_line="bench", step=0 if parent is None else parent + 1, parent=parent or 0,
                    parent_sha256="", publish_token="bench", metrics={}, model=master, optimizer=adam or {},
                    scheduler={}, buffer={}, offsets={}))
            export = {k: v.contiguous() for k, v in to_checkpoint(unwrap(model), {
                k: v.to(torch.bfloat16) for k, v in master.items()}).items()}  # export_state's names
            del master
            assert registry is not None
            info = registry.publish(export, parent=parent, parent_state=published)
            published = export
        del adam
        return dist.broadcast_object(info)

    def publish(parent: int | None) -> Any:
        if args.mode == "sharded+ckpt":  # the trainer's sharded publish point: checkpoint, then publish
            step = 0 if parent is None else parent + 1
            point = None if not dist.is_main else checkpoint.Checkpoint(
                model_line="bench", step=step, parent=parent or 0, parent_sha256="", publish_token="bench",
                metrics={}, model={}, optimizer={}, scheduler={}, buffer={}, offsets={})
            checkpoint.save_sharded(dist, root / "checkpoints", model, optimizer, point)
        return sharded.publish(model, parent=parent) if sharded is not None else gather_publish(parent)

    publish(None)
    perturb(model)
    encode_delta({"w": torch.zeros(4)}, {"w": torch.ones(4)})  # the compiled codec loaded before measuring
    dist.barrier()
    before = reset_peak()
    started = time.perf_counter()
    info = publish(0)
    result: dict[str, Any] = {
        "mode": args.mode, "rank": dist.rank, "world_size": dist.world_size, "params": params,
        "version": info.version, "kind": info.kind, "sha256": info.sha256, "bytes": info.bytes,
        "publish_s": time.perf_counter() - started, "rss_before_mb": before, "peak_mb": rss_mb("VmHWM")}
    if sharded is not None:  # this rank's share of the bf16 export
        result["shard_mb"] = sum(p.numel() * 2 for n, p in unwrap(model).named_parameters()
                                 if sharded.owner[n] == dist.rank) / 2**20
    if args.check:  # the same weights gathered and hashed whole: what the unsharded path publishes
        master = dist.full_state_dict(model)
        if dist.is_main:
            result["gathered_sha256"] = state_sha256(to_checkpoint(unwrap(model), {
                k: v.to(torch.bfloat16) for k, v in master.items()}))
        del master
    (root / f"rank{dist.rank}.json").write_text(json.dumps(result))
    if args.fault:  # v2: rank 1 loses its upload, or dies after it
        perturb(model)
        if isinstance(store, FaultyStore):
            store.armed = True
        try:
            publish(1)
            outcome = "published"
        except WeightsError as exc:
            outcome = f"refused: {exc}"
        (root / f"rank{dist.rank}-fault.json").write_text(json.dumps({"outcome": outcome}))
    dist.barrier()
    dist.close()


def run_job(root: Path, mode: str, size: str, ranks: int, *extra: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """One torchrun job of ``ranks`` gloo ranks in ``root`` (created)."""
    root.mkdir(parents=True, exist_ok=True)
    return torchrun("bench.sharded_publish", ranks, ["--mode", mode, "--size", size, "--root", str(root), *extra],
                    timeout_s)


def torchrun(module: str, ranks: int, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``module --worker args`` as a ``torchrun`` job of ``ranks`` CPU processes from the repository
    (one rank: the plain process, no torchrun, as a single-process trainer runs), one thread each,
    with big frees returned to the system at once (so ``VmHWM`` measures what is held), outside
    any torchrun environment this process may have."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    cmd = [sys.executable, *launcher, "-m", module, "--worker", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def node_load(root: Path, version: int) -> str:
    """The hash of ``version`` rebuilt from ``root``'s registry as a node does (every hash checked)."""
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.weights.codec.state import state_sha256
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import FolderStore

    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(make_session_factory(make_engine(url)), FolderStore(root / "store"), "bench")
    return state_sha256(registry.load(version))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--fault", choices=("drop", "kill"), help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sharded-publish-") as tmp:
        for mode in args.modes.split(","):
            proc = run_job(Path(tmp) / mode.replace("+", "-"), mode, args.size, args.ranks)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            rows[mode] = json.loads((Path(tmp) / mode.replace("+", "-") / "rank0.json").read_text())
        if "sharded" in rows and "gather" in rows:
            rows["sharded"]["node_sha256"] = node_load(Path(tmp) / "sharded", 1)
            assert rows["sharded"]["node_sha256"] == rows["sharded"]["sha256"] == rows["gather"]["sha256"], rows
    base = rows.get("gather", {}).get("peak_mb")
    with_adam = rows.get("gather+adam", {}).get("peak_mb")
    who = f"{args.ranks} gloo ranks" if args.ranks > 1 else "one process (no torchrun)"
    print(f"{who}, {next(iter(rows.values()))['params'] / 1e6:.1f}M parameters; rank 0 during v1's publish")
    print(f"{'mode':<13} {'kind':<6} {'MB before':>10} {'peak MB':>9} {'growth MB':>10} {'vs gather':>10} "
          f"{'vs +adam':>9} {'seconds':>8}")
    for mode, r in rows.items():
        r["peak_vs_gather"] = r["peak_mb"] / base if base else float("nan")
        r["peak_vs_gather_adam"] = r["peak_mb"] / with_adam if with_adam else float("nan")
        print(f"{mode:<13} {r['kind']:<6} {r['rss_before_mb']:>10.0f} {r['peak_mb']:>9.0f} "
              f"{r['peak_mb'] - r['rss_before_mb']:>10.0f} {r['peak_vs_gather']:>10.2f} {r['peak_vs_gather_adam']:>9.2f} "
              f"{r['publish_s']:>8.2f}")
    if "sharded" in rows:
        print(f"node rebuilds v1 from the shards: sha256 {rows['sharded']['node_sha256'][:16]} (= gather's)")
    out = {"size": args.size, "ranks": args.ranks, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
