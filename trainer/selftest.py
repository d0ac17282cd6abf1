"""The distributed selftest: N ranks train exactly as one process.

``python -m trainer.selftest --model DIR --out DIR`` alone, or under
``torchrun --nproc_per_node N``: trains a few optimizer steps (trainer/step.py, the step ``train()``
runs) on fixed synthetic batches and writes per-step losses (result.json) and, from rank 0, the
step-1 gradients and the final full model and optimizer states (state-<wrapper>.pt). Comparing a
run of N ranks with a run of one process is tests/integration/test_trainer_distributed.py; on a
GPU machine it checks the CUDA path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from flywheel.events import ScoredTrajectory, Segment, Turn
from flywheel.lm import export_state
from flywheel.settings import TrainerSettings
from trainer.batch import micro_batches, sample_tokens
from trainer.distributed import Dist, unwrap
from trainer.step import train_step

SELFTEST_SIZES = (5, 4, 1, 6)  # samples per step: step 3 leaves a rank without data
SELFTEST_MICRO_TOKENS = 32  # packed tokens per micro-batch: ranks run different numbers of passes
SELFTEST_LR = 1e-3


def synthetic_batches(vocab_size: int, sizes: Sequence[int] = SELFTEST_SIZES, seed: int = 0) -> list[list[ScoredTrajectory]]:
    """Fixed, seeded ScoredTrajectory batches: one or two segments of one or two turns, random
    behaviour logprobs (ratios get clipped and truncated), some turns at temperature 0.7 (masked),
    half with rewards-stage advantages and half legacy (batch-relative baselines, prompt groups)."""
    rng = random.Random(seed)
    batches = []
    for step, size in enumerate(sizes):
        batch = []
        for k in range(size):
            sid = f"s{step}-{k}"
            segments, rewards = [], []
            for _ in range(rng.choice((1, 1, 2))):
                tokens, mask, logprobs, turns = [], [], [], []
                for _ in range(rng.choice((1, 2))):
                    prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(3, 10))]
                    completion = [rng.randrange(1, vocab_size) for _ in range(rng.randint(2, 12))]
                    start = len(tokens) + len(prompt)
                    tokens += prompt + completion
                    mask += [0] * len(prompt) + [1] * len(completion)
                    logprobs += [0.0] * len(prompt) + [rng.uniform(-6.0, -0.5) for _ in completion]
                    turns.append(Turn(generation_id=f"{sid}-{len(rewards)}", start=start, end=len(tokens), behaviour_version=0,
                                      temperature=0.7 if rng.random() < 0.15 else 1.0))
                    rewards.append(float(rng.random() < 0.5))
                segments.append(Segment(tokens=tokens, mask=mask, logprobs=logprobs, turns=turns))
            legacy = rng.random() < 0.5
            batch.append(ScoredTrajectory(
                event_id=sid, tenant="t", session_id=sid, trajectory_id=sid, model_line="m", segments=segments,
                turn_rewards=rewards, total_reward=sum(rewards), reward_spec_version="selftest",
                prompt_key=rng.choice(("p0", "p1", None)),
                turn_advantages=None if legacy else [rng.gauss(0.0, 1.0) for _ in rewards],
            ))
        batches.append(batch)
    return batches


def _full_grads(dist: Dist, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on rank 0 (every rank calls it: FSDP2 gathers shards)."""
    out = {}
    for name, p in unwrap(model).named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if dist.is_main and grad is not None:
            out[name] = grad.detach().to("cpu", dtype=torch.float32, copy=True)
    return out


def _selftest_run(dist: Dist, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Train :data:`SELFTEST_SIZES` steps; after the second, rebuild model and optimizer from the
    full states (as a restart from a checkpoint would) and go on with those."""
    def build(state: dict[str, torch.Tensor] | None = None, optim: dict[str, Any] | None = None):
        base = dist.start_model(model_dir).requires_grad_(True)  # weights on rank 0 only: wrap shares them
        published = export_state(base) if dist.is_main else {}  # bf16, as train() starts from a version
        model = dist.wrap(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=SELFTEST_LR, weight_decay=0.01)
        dist.load_full_state(model, published if state is None else state)
        if optim is not None:
            dist.load_optimizer_state(model, optimizer, optim)
        return model, optimizer

    started = time.monotonic()
    model, optimizer = build()
    vocab = unwrap(model).get_input_embeddings().num_embeddings
    batches = dist.broadcast_object(synthetic_batches(vocab) if dist.is_main else None)
    grads: dict[str, torch.Tensor] = {}
    steps = []
    cfg = TrainerSettings(micro_batch_tokens=SELFTEST_MICRO_TOKENS)
    for i, samples in enumerate(batches):
        metrics = train_step(model, optimizer, samples, 0, cfg, measure_parity=True, dist=dist)
        # What each rank trained, and its micro-batches (the others ran placeholders up to the maximum).
        mine = dist.shard(range(len(samples)), cost=lambda j: sample_tokens(samples[j]))
        passes = len(micro_batches([samples[j] for j in mine], cfg.micro_batch_tokens, packed=cfg.packing))
        shards, counts = dist.all_gather_object(mine), dist.all_gather_object(passes)
        steps.append({**metrics, "shards": shards, "placeholder_passes": sum(max(counts) - c for c in counts)})
        if i == 0:  # the step's gradients (clipped, as the optimizer used them)
            grads.update(_full_grads(dist, model))
        if i == 1:
            model, optimizer = build(dist.full_state_dict(model), dist.optimizer_state_dict(model, optimizer))
    params, optim = dist.full_state_dict(model), dist.optimizer_state_dict(model, optimizer)
    if dist.is_main:
        torch.save({"grads": grads, "params": params, "optimizer": optim}, out_dir / f"state-{dist.wrapper}.pt")
    return {"steps": steps, "seconds": time.monotonic() - started}


def selftest(model_dir: Path, out_dir: Path, wrappers: Sequence[Literal["fsdp2", "ddp"]], device: str) -> None:
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    first = Dist.from_env(device, wrapper=wrappers[0])
    runs: dict[str, Any] = {}
    try:
        for wrapper in wrappers if first.enabled else ["none"]:
            dist = dataclasses.replace(first, wrapper=wrapper) if first.enabled else first
            runs[dist.wrapper] = _selftest_run(dist, model_dir, out_dir)
            dist.barrier()
    finally:
        first.close()
    if not first.is_main:
        return
    result: dict[str, Any] = {"world_size": first.world_size, "device": str(first.device), "bf16": first.bf16,
                              "torch": torch.__version__, "runs": runs}
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({w: [round(s["loss"], 6) for s in r["steps"]] for w, r in runs.items()}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.selftest",
                                     description="train a few steps on synthetic batches; alone or under torchrun")
    parser.add_argument("--model", type=Path, required=True, help="a local Hugging Face model directory")
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json and state-<wrapper>.pt")
    parser.add_argument("--wrappers", default="fsdp2,ddp", help="comma-separated, run in turn under torchrun")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    wrappers = [w for w in args.wrappers.split(",") if w]
    if not wrappers or set(wrappers) - {"fsdp2", "ddp"}:
        parser.error(f"--wrappers takes fsdp2 and/or ddp, got {args.wrappers!r}")
    selftest(args.model, args.out, wrappers, args.device)


if __name__ == "__main__":
    main()
