"""Offline proof that reinforcement learning on the tiny task works within flywheel's budget.

A plain in-process policy-gradient loop that mimics the trainer, without the bus or HTTP:

- the *served* policy is a bf16 export of the fp32 master, refreshed every ``steps_per_version``
  optimizer steps (as a node would hot-swap versions), and it samples every batch at T=1;
- reward is 1 when the answer is right, else 0; advantage = reward - batch mean;
- loss per sequence = - sum over completion tokens of min(ratio * A, clip(ratio) * A), with
  ratio = exp(logp_master - logp_served) (PPO-style clipping; ratios differ from 1 only by the
  bf16 rounding and version lag), averaged over the batch; Adam on the fp32 master;
- at each version it measures the fraction of bf16 elements that changed since the previous
  version, which bounds what a delta codec has to ship.

It prints a table (step, held-out success, changed fraction, wall time) per learning rate and,
with ``--json PATH``, writes every measurement. ``lr=0`` is the control: success must stay flat.

    .venv/bin/python -m bench.learnability --lrs 0 1e-5 2e-5 --steps-per-version 2 --json /tmp/learn.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from demo.tinymodel import task
from demo.tinymodel.build import ensure_default_model
from demo.tinymodel.evaluate import evaluate
from flywheel.lm import (
    chat_prompt_ids,
    completion_text,
    export_state,
    generate,
    load_model,
    load_state,
)
from flywheel.weights.codec.delta import encode_delta
from flywheel.weights.codec.state import encode_full


def changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Fraction of bf16 elements whose bit pattern differs between two exports."""
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    return changed / sum(t.numel() for t in old.values())


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """Per-sequence tensors of log p(completion token | prefix) under ``model`` (with grad)."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        out.append(logp[i, positions, torch.tensor(c)])
    return out


def run(model_path: Path, *, lr: float, batch_size: int, steps: int, steps_per_version: int,
        eval_every: int, max_new_tokens: int, clip_eps: float, seed: int, heldout_n: int, eps: float = 1e-8,
        log=print) -> dict:
    torch.manual_seed(seed)
    master, tokenizer = load_model(model_path)
    master.train()
    served, _ = load_model(model_path)
    opt = torch.optim.Adam(master.parameters(), lr=lr, eps=eps)
    heldout = task.heldout_problems(heldout_n)
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    version_state = export_state(master)
    load_state(served, version_state)
    rows: list[dict] = []
    fractions: list[float] = []
    delta_ratios: list[float] = []
    started = time.monotonic()
    rewards_window: list[float] = []

    def record(step: int, fraction: float | None) -> None:
        success = evaluate(served, tokenizer, heldout, seed=10_000)
        row = {"step": step, "heldout": success, "changed_fraction": fraction,
               "train_reward": sum(rewards_window) / max(1, len(rewards_window)),
               "wall_s": round(time.monotonic() - started, 1)}
        rewards_window.clear()
        rows.append(row)
        frac = "" if fraction is None else f"{fraction:.4f}"
        log(f"lr={lr:<8g} eps={eps:<6g} step {step:4d}  heldout {success:.3f}  train_reward {row['train_reward']:.3f}  "
            f"changed {frac:>7}  {row['wall_s']:6.1f}s")

    record(0, None)
    for step in range(1, steps + 1):
        problems = [task.traffic_problem(rng) for _ in range(batch_size)]
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": task.user_message(p)}]) for p in problems]
        samples = generate(served, prompts, max_new_tokens=max_new_tokens,
                           seed=rng.randrange(2**31), eos_token_id=eos)
        rewards = torch.tensor([float(task.is_correct(p, completion_text(tokenizer, s.token_ids)))
                                for p, s in zip(problems, samples, strict=True)])
        rewards_window.extend(rewards.tolist())
        advantages = rewards - rewards.mean()
        new_logps = completion_logprobs(master, prompts, [s.token_ids for s in samples])
        losses = []
        for s, a, new in zip(samples, advantages, new_logps, strict=True):
            ratio = torch.exp(new - torch.tensor(s.logprobs))
            per_token = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
            losses.append(-per_token.sum())
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        fraction = None
        if step % steps_per_version == 0:
            new_state = export_state(master)
            fraction = changed_fraction(version_state, new_state)
            fractions.append(fraction)
            delta_ratios.append(len(encode_delta(version_state, new_state)) / len(encode_full(new_state)))
            version_state = new_state
            load_state(served, version_state)
        if step % eval_every == 0:
            record(step, fraction)
    return {
        "lr": lr, "eps": eps, "batch_size": batch_size, "steps": steps, "steps_per_version": steps_per_version,
        "max_new_tokens": max_new_tokens, "rows": rows,
        "start": rows[0]["heldout"], "end": rows[-1]["heldout"], "best": max(r["heldout"] for r in rows),
        "mean_changed_fraction": sum(fractions) / max(1, len(fractions)),
        "max_changed_fraction": max(fractions, default=0.0),
        "mean_delta_bytes_ratio": sum(delta_ratios) / len(delta_ratios) if delta_ratios else None,
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: build/reuse the default model)")
    parser.add_argument("--cache", type=Path, default=Path(".flywheel/models"))
    parser.add_argument("--quick", action="store_true", help="use the quick build")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.0, 1e-5, 2e-5])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--steps-per-version", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--heldout-n", type=int, default=200)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-8], help="Adam eps values to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write all measurements here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model or ensure_default_model(args.cache, quick=args.quick)
    results = []
    for lr, eps in [(lr, eps) for eps in args.eps for lr in args.lrs]:
        results.append(run(model_path, lr=lr, eps=eps, batch_size=args.batch_size, steps=args.steps,
                           steps_per_version=args.steps_per_version, eval_every=args.eval_every,
                           max_new_tokens=args.max_new_tokens, clip_eps=args.clip_eps, seed=args.seed,
                           heldout_n=args.heldout_n))
    print(f"\n{'lr':>8} {'eps':>6} {'batch':>5} {'start':>6} {'end':>6} {'best':>6} {'gain':>6} {'changed(mean)':>13} "
          f"{'changed(max)':>12} {'delta/full':>10} {'wall_s':>7}")
    for r in results:
        print(f"{r['lr']:>8g} {r['eps']:>6g} {r['batch_size']:>5} {r['start']:>6.3f} {r['end']:>6.3f} {r['best']:>6.3f} "
              f"{r['end'] - r['start']:>+6.3f} {r['mean_changed_fraction']:>13.4f} {r['max_changed_fraction']:>12.4f} "
              f"{(r['mean_delta_bytes_ratio'] or float('nan')):>10.4f} {r['wall_s']:>7.1f}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model_path), "results": results}, indent=2))


if __name__ == "__main__":
    main()
