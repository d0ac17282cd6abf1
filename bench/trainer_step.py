"""What flywheel's trainer step costs: ``trainer.step.train_step`` vs a plain Hugging Face loop.

Both loops train the same model from the same initial weights on the same samples, with the same
loss (``trainer.loss.policy_loss``, normalised by the step's trainable tokens), AdamW on fp32
master weights at the same lr, gradient clipping at 1.0 and gradient accumulation over
micro-batches of ``micro_batch_tokens`` (on CUDA the forward runs under bf16 autocast, as
``trainer.distributed.Dist.autocast`` does):

- ``reference``: the loop a team would write: consecutive samples, one right-padded row per
  segment, rows x longest row <= ``micro_batch_tokens`` (a longer sample alone),
  ``model(input_ids, attention_mask).logits.float()``, ``log_softmax`` over the whole vocabulary,
  gather. SDPA attention; no packing, no chunking, no checkpointing;
- ``flywheel``: ``train_step(model, optimizer, samples, version, TrainerSettings(...))`` with the
  settings' defaults plus ``--set key=value`` (e.g. ``--set activation_checkpointing=block``).

The model is Qwen3-shaped (``transformers.Qwen3Config``, random init, fixed seed, never
downloaded; ``attn_implementation="sdpa"``): about 50M parameters on CPU (hidden 512, 10 layers,
8 heads, 4 KV heads, head_dim 64, intermediate 1536, vocabulary 32,768, tied embeddings), about
0.5B with ``--device cuda`` (hidden 1024, 28 layers, 16/8 heads, head_dim 128, intermediate 3072),
about 7B with ``--shape 7b`` (hidden 4096, 32 layers, 32/8 heads, intermediate 13,824, untied; one
step of ~32k tokens: with ``--set lora_rank=16`` the check that LoRA trains it on one 80 GB GPU),
or a local Hugging Face directory (``--model DIR``). The traffic is bench/rl_traffic.py's seeded
multi-turn sessions, lengths around a median of 800 tokens clipped to [50, 8000]: the 9 timed
sessions of the CPU run span 86 to 7,444 tokens. The JSON reports the distribution.

Each loop runs in its own fresh subprocess (this module's hidden ``_phase`` command), so that peak
memory compares: on CPU the peak RSS above the interpreter's own (``VmHWM`` at the end minus
``VmRSS`` after the imports, before the model is built), on CUDA ``torch.cuda.max_memory_allocated``.
A warm-up step on its own samples comes first and is not timed; trained tokens/s is the trainable
tokens of the timed steps over their wall time. ``mfu`` (CUDA only) is ``6 N`` x the real (unpadded)
tokens processed per second over the device's dense bf16 peak (``mfu_trainable``: the same with
trainable tokens only).

The publish stall (``publish_stall_s_per_version``): a third subprocess trains as the flywheel loop
with one version per step and publishes each step through ``trainer.publisher.Publisher`` into a
real registry (SQLite and a weight folder in a temporary directory, version 0 the model's bf16
export). Per version, the stall is the time of the cut: ``snapshot`` of master, optimizer and
export, and ``Publisher.submit`` (which blocks only while the previous version is still being
written). It is run with ``background=True`` and once more with ``background=False`` (inline
publishing, the same-run baseline); the JSON has both, with each run's wall time (the timed steps
and cuts; the last version's drain apart) and the stall as a fraction of it. The warm-up step's
version is written before the timing starts. The stall's share of wall depends on the step's
length: a bigger step hides the same publish better.

Every phase also records the machine's 1-minute load average before and after it: other work on a
shared machine slows a phase, and with it the ratio. The flywheel phases set the model up as
trainer/train.py does (``trainer.policy.Policy``, then ``trainer.compute.prepare``).

Targets: on CPU, flywheel >= 1.5x the reference's trained tokens/s at <= 0.5x its peak memory, and
a publish stall <= 5% of wall at one version per step; on a GPU, >= 2x, <= 1/3 of the memory and
MFU >= 25%.

    .venv/bin/python -m bench.trainer_step --json out/trainer-step.json
    .venv/bin/python -m bench.trainer_step --quick --json /tmp/trainer-step.json
    .venv/bin/python -m bench.trainer_step --device cuda --json out/step-gpu.json
    .venv/bin/python -m bench.trainer_step --device cuda --shape 7b --loops flywheel --set lora_rank=16 --json out/7b.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.rl_traffic import LINE, make_traffic, traffic_stats, trainable_tokens
from flywheel.events import ScoredTrajectory
from flywheel.settings import TrainerSettings

#: Qwen3-shaped models built from a config: about 50M parameters (CPU), about 0.5B (CUDA), tiny (--quick).
MODELS: dict[str, dict[str, int]] = {
    "cpu": {"hidden_size": 512, "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 64, "intermediate_size": 1536, "vocab_size": 32768, "max_position_embeddings": 8192},
    "cuda": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 32768, "max_position_embeddings": 8192},
    "quick": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512},
    # About 7B parameters (Llama-2-7B's width and depth, Qwen3's attention), untied: for LoRA on one GPU.
    "7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 13824, "vocab_size": 32768, "max_position_embeddings": 8192,
           "tie_word_embeddings": False},
}
#: Workload per mode: samples per timed step, timed steps, warm-up samples, session lengths.
WORKLOADS: dict[str, dict[str, Any]] = {
    "cpu": {"steps": 3, "samples_per_step": 3, "warmup_samples": 2, "median_len": 800, "min_len": 50, "max_len": 8000},
    "cuda": {"steps": 3, "samples_per_step": 16, "warmup_samples": 4, "median_len": 800, "min_len": 50, "max_len": 8000},
    # One step of ~32k tokens (15 sessions at these quantiles).
    "7b": {"steps": 1, "samples_per_step": 15, "warmup_samples": 1, "median_len": 800, "min_len": 50, "max_len": 8000},
    "quick": {"steps": 2, "samples_per_step": 4, "warmup_samples": 2, "median_len": 120, "min_len": 20, "max_len": 300},
}
#: Dense bf16 peak FLOP/s by device name (first match wins).
BF16_PEAK = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
MAX_GRAD_NORM = 1.0
#: The TrainerSettings fields the reference loop honours too (``--set`` passes the others to flywheel only).
SHARED = ("micro_batch_tokens", "lr", "weight_decay", "clip_eps", "is_truncation")


# --- the reference loop -------------------------------------------------------------------------


def padded_groups(samples: list[ScoredTrajectory], budget: int) -> list[list[int]]:
    """Consecutive samples whose padded size (rows x longest row) stays within ``budget``; a sample
    larger than the budget goes alone."""
    groups: list[list[int]] = []
    rows = longest = 0
    for i, sample in enumerate(samples):
        lens = [len(s.tokens) for s in sample.segments if s.tokens]
        if groups and (rows + len(lens)) * max(longest, *lens) <= budget:
            groups[-1].append(i)
            rows, longest = rows + len(lens), max(longest, *lens)
        else:
            groups.append([i])
            rows, longest = len(lens), max(lens)
    return groups


def pad(samples: list[ScoredTrajectory]) -> dict[str, Any]:
    """One right-padded row per segment: tokens, attention, behaviour logprobs, mask, advantages."""
    import torch

    from trainer.loss import token_advantages

    rows = []
    for sample in samples:
        assert sample.turn_advantages is not None  # the bench's traffic carries them
        advantages = token_advantages(sample.turn_advantages, sample.segments, 0.0)
        rows += [(seg, adv) for seg, adv in zip(sample.segments, advantages, strict=True) if seg.tokens]
    B, T = len(rows), max(len(seg.tokens) for seg, _ in rows)
    out = {"tokens": torch.zeros(B, T, dtype=torch.long), "attention": torch.zeros(B, T, dtype=torch.long),
           "logp": torch.zeros(B, T), "mask": torch.zeros(B, T), "adv": torch.zeros(B, T)}
    for b, (seg, adv) in enumerate(rows):
        n = len(seg.tokens)
        out["tokens"][b, :n] = torch.tensor(seg.tokens)
        out["attention"][b, :n] = 1
        out["logp"][b, :n] = torch.tensor(seg.logprobs)
        out["mask"][b, :n] = torch.tensor(seg.mask, dtype=torch.float32)
        out["adv"][b, :n] = adv
    out["mask"][:, 0] = 0.0
    return out


def reference_step(model: Any, optimizer: Any, samples: list[ScoredTrajectory], cfg: TrainerSettings,
                   dist: Any) -> dict[str, Any]:
    """The plain loop's optimizer step (module docstring)."""
    import torch

    from trainer.loss import policy_loss

    groups = padded_groups(samples, cfg.micro_batch_tokens)
    step_tokens = sum(trainable_tokens(s) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    loss, padded = 0.0, 0
    for group in groups:
        batch = {k: v.to(dist.device) for k, v in pad([samples[i] for i in group]).items()}
        tokens = batch["tokens"]
        padded += tokens.numel()
        with dist.autocast():
            logits = model(input_ids=tokens, attention_mask=batch["attention"]).logits.float()
            picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
        out = policy_loss(logp, batch["logp"], batch["adv"], batch["mask"], cfg.clip_eps, cfg.is_truncation,
                          normalizer=step_tokens)
        out.loss.backward()
        loss += float(out.loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return {"loss": loss, "grad_norm": float(grad_norm), "tokens": step_tokens, "padded_tokens": padded,
            "micro_batches": len(groups)}


# --- one phase, in its own process ----------------------------------------------------------------


def _proc_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({len(os.sched_getaffinity(0))} cores)"


def bf16_peak(name: str) -> float | None:
    """Dense bf16 FLOP/s of a device by its name, or None when unknown."""
    return next((peak for key, peak in BF16_PEAK if key in name), None)


def build_model(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(spec["seed"])
    if spec["model_dir"]:
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    else:
        config = Qwen3Config(**{"tie_word_embeddings": True, **MODELS[spec["shape"]]})
        with torch.device(spec["device"]):  # a 7B random init on the CPU alone would take minutes
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.float().eval()  # fp32 master; eval like flywheel.lm.load_model (no dropout)


def model_vocab(spec: dict[str, Any]) -> tuple[int, int]:
    """(vocabulary size, max positions) of the model the phase will build."""
    if not spec["model_dir"]:
        shape = MODELS[spec["shape"]]
        return shape["vocab_size"], shape["max_position_embeddings"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec["model_dir"], local_files_only=True)
    return config.vocab_size, config.max_position_embeddings


def phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one loop (``reference``, ``flywheel``, ``publish``) as ``spec`` says; its figures."""
    import torch

    from trainer.distributed import Dist
    from trainer.step import train_step

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dist = Dist.from_env(spec["device"])
    cfg = TrainerSettings(**spec["trainer"])
    vocab, positions = model_vocab(spec)
    work = spec["workload"]
    shape = {"vocab": vocab, "median_len": work["median_len"], "min_len": work["min_len"],
             "max_len": min(work["max_len"], positions)}
    warmup = make_traffic(work["warmup_samples"], seed=spec["seed"] + 1, **shape)
    timed = make_traffic(work["steps"] * work["samples_per_step"], seed=spec["seed"], **shape)
    steps = [timed[i:i + work["samples_per_step"]] for i in range(0, len(timed), work["samples_per_step"])]
    cuda = dist.device.type == "cuda"
    baseline_kb = _proc_kb("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats(dist.device)

    model = build_model(spec)
    params = sum(p.numel() for p in model.parameters())
    policy = None
    if spec["loop"] != "reference":  # as trainer/train.py sets the model up
        from trainer.compute import prepare
        from trainer.policy import Policy

        policy = Policy(model, cfg)
        model = prepare(policy.model, cfg)
    model = dist.wrap(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)

    def step(batch: list[ScoredTrajectory], version: int = 0) -> dict[str, Any]:
        if spec["loop"] == "reference":
            return reference_step(model, optimizer, batch, cfg, dist)
        return train_step(model, optimizer, batch, version, cfg, dist=dist)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dist.device)

    result: dict[str, Any] = {"loop": spec["loop"], "device": _device_name(dist.device), "params": params,
                              "traffic": traffic_stats(timed), "warmup_traffic": traffic_stats(warmup)}
    if spec["loop"] == "publish":
        result["publish"] = publish_run(spec, model, optimizer, policy, cfg, dist, step, sync, warmup, steps)
        return result
    started = time.perf_counter()
    warm = step(warmup)
    sync()
    result["warmup_s"] = time.perf_counter() - started
    per_step, seconds = [], []
    for batch in steps:
        t0 = time.perf_counter()
        per_step.append(step(batch))
        sync()
        seconds.append(time.perf_counter() - t0)
    wall = sum(seconds)
    trained = int(sum(m["tokens"] for m in per_step))
    real = result["traffic"]["total_tokens"]
    result.update(
        steps=len(steps), trained_tokens=trained, real_tokens=real, wall_s=wall, step_s=seconds,
        trained_tokens_per_s=trained / wall, real_tokens_per_s=real / wall,
        losses=[warm["loss"]] + [m["loss"] for m in per_step],
        grad_norms=[float(warm["grad_norm"])] + [float(m["grad_norm"]) for m in per_step],
        peak_bytes=(torch.cuda.max_memory_allocated(dist.device) if cuda
                    else (_proc_kb("VmHWM") - baseline_kb) * 1024),
        baseline_rss_bytes=baseline_kb * 1024,
    )
    if "padded_tokens" in per_step[0]:
        padded = sum(m["padded_tokens"] for m in per_step)
        result.update(padded_tokens=padded, padding_share=round(1 - real / padded, 4),
                      micro_batches=sum(m["micro_batches"] for m in per_step))
    peak = bf16_peak(result["device"]) if cuda else None
    result["mfu"] = 6 * params * result["real_tokens_per_s"] / peak if peak else None
    result["mfu_trainable"] = 6 * params * result["trained_tokens_per_s"] / peak if peak else None
    return result


def publish_run(spec: dict[str, Any], model: Any, optimizer: Any, policy: Any, cfg: TrainerSettings, dist: Any,
                step: Any, sync: Any, warmup: list[ScoredTrajectory], steps: list[list[ScoredTrajectory]]) -> dict[str, Any]:
    """Train with one version per step, each published through ``trainer.publisher`` into a fresh
    registry, the cut done as trainer/train.py's publish point does it; the cut's seconds per
    version (module docstring)."""
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.settings import load_settings
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store
    from trainer import checkpoint
    from trainer import publisher as publishing
    from trainer.buffer import OffsetTracker, SampleBuffer

    background = spec["background"]
    with tempfile.TemporaryDirectory(prefix="bench-trainer-step-") as tmp:
        settings = load_settings(data_dir=tmp, db={"url": f"sqlite:///{tmp}/flywheel.db"},
                                 store={"kind": "folder", "path": f"{tmp}/weights", "cache_path": ""},
                                 model={"line": LINE})
        engine = open_database(settings.database_url, 30.0)
        try:
            registry = Registry(make_session_factory(engine), make_store(settings), LINE, full_every=cfg.full_every)
            published = policy.export()
            base = registry.ensure_base(published, reason="bench.trainer_step base")
            current = base.version
            publisher = publishing.Publisher(registry, Path(tmp) / "checkpoints", cfg.keep_checkpoints,
                                             background=background)
            buffer, offsets = SampleBuffer(cfg.max_staleness), OffsetTracker()
            pending: Any = None  # the export of the point being written
            parts = {"snapshot_s": 0.0, "wait_s": 0.0, "submit_s": 0.0}

            def settle(info: Any) -> None:
                nonlocal current, published, pending
                if info is not None:
                    current, published, pending = info.version, pending, None

            def point(batch: list[ScoredTrajectory], number: int) -> float:
                """A step, then its publish point cut as trainer/train.py cuts it; the cut's seconds."""
                nonlocal pending
                metrics = step(batch, current)
                sync()
                t0 = time.perf_counter()
                master, optimizer_state = dist.full_state_dict(model), dist.optimizer_state_dict(model, optimizer)
                snap = publishing.snapshot(master, optimizer_state, policy.export(),
                                           live=(model, optimizer, policy.model))
                t1 = time.perf_counter()
                settle(publisher.wait())  # the previous point's version is this one's parent
                t2 = time.perf_counter()
                ckpt = checkpoint.Checkpoint(
                    model_line=LINE, step=number, parent=current, parent_sha256=registry.get(current).sha256,
                    publish_token=secrets.token_hex(16), metrics={"loss": metrics["loss"], "steps": 1},
                    model=snap.master, optimizer=snap.optimizer, scheduler={}, buffer=buffer.state_dict(),
                    offsets=offsets.state_dict())
                pending = snap.export
                publisher.submit(ckpt, snap.export, published)
                settle(publisher.done())  # inline: written already
                t3 = time.perf_counter()
                for key, seconds in (("snapshot_s", t1 - t0), ("wait_s", t2 - t1), ("submit_s", t3 - t2)):
                    parts[key] += seconds
                return t3 - t0

            # The warm-up point, written before the timing starts: first-call costs (the codec's
            # JIT, the registry's first rows) are start-up costs, not per-version ones.
            first = time.perf_counter()
            point(warmup, 1)
            settle(publisher.wait())
            first_point = time.perf_counter() - first
            parts = dict.fromkeys(parts, 0.0)
            started = time.perf_counter()
            cuts = [point(batch, i + 2) for i, batch in enumerate(steps)]
            wall = time.perf_counter() - started
            drained = time.perf_counter()
            settle(publisher.wait())
            drain = time.perf_counter() - drained
            publisher.close()
            versions = registry.versions()
        finally:
            engine.dispose()
    n = len(cuts)
    return {
        "background": background, "versions": n, "wall_s": wall, "cut_s": cuts, "first_point_s": first_point,
        "stall_s_per_version": sum(cuts) / n, "stall_fraction": sum(cuts) / wall,
        **{f"{k.removesuffix('_s')}_s_per_version": v / n for k, v in parts.items()},
        "publisher_stall_s": publisher.stall_s, "publisher_versions": publisher.versions, "drain_s": drain,
        "last_version": current, "expected_last_version": base.version + n + 1,
        "published": [{"version": v.version, "kind": v.kind, "bytes": v.bytes, "full_bytes": v.full_bytes}
                      for v in versions],
    }


# --- the driver: one subprocess per phase -----------------------------------------------------------


def run_phase(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``spec``'s phase in a fresh interpreter; its result, or ``{"error": ...}`` when it failed."""
    with tempfile.TemporaryDirectory(prefix="bench-trainer-step-") as tmp:
        out = Path(tmp) / "result.json"
        started = time.monotonic()
        load_before = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-m", "bench.trainer_step", "_phase", json.dumps(spec), str(out)],
                              stderr=subprocess.PIPE, text=True, timeout=timeout_s,
                              cwd=Path(__file__).resolve().parents[1])
        if proc.returncode != 0 or not out.exists():
            return {"error": f"phase {spec['loop']} exited {proc.returncode}:\n{proc.stderr[-4000:]}"}
        result = json.loads(out.read_text())
    # Other work on a shared machine slows a phase: the 1-minute load average before and after it.
    result.update(process_s=round(time.monotonic() - started, 1), load_avg_1m=[load_before, os.getloadavg()[0]])
    return result


def _parse_sets(pairs: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in TrainerSettings.model_fields:
            parser.error(f"--set takes KEY=VALUE with KEY a TrainerSettings field, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def print_table(summary: dict[str, Any]) -> None:
    t = summary["traffic"]
    if t is None or summary["params"] is None:  # no phase got as far as building the model
        print("\nbench.trainer_step: no phase ran; the JSON has each one's error")
        return
    print(f"\nbench.trainer_step: {summary['device']}, {summary['params'] / 1e6:.1f}M params; "
          f"{t['samples']} timed sessions, lengths min/median/p90/max {t['min_len']}/{t['median_len']:g}/"
          f"{t['p90_len']}/{t['max_len']}, {t['total_tokens']} tokens, {t['trainable_tokens']} trainable")
    print(f"{'loop':10s} {'steps':>5s} {'trained tokens':>14s} {'tokens/s':>9s} {'peak memory':>12s} "
          f"{'speed vs ref':>12s} {'memory vs ref':>13s}")
    ref = summary["loops"].get("reference", {})
    for name, r in summary["loops"].items():
        if "error" in r:
            print(f"{name:10s} failed: {r['error'].splitlines()[0]}")
            continue
        speed = r["trained_tokens_per_s"] / ref["trained_tokens_per_s"] if "trained_tokens_per_s" in ref else None
        memory = r["peak_bytes"] / ref["peak_bytes"] if "peak_bytes" in ref else None
        print(f"{name:10s} {r['steps']:>5d} {r['trained_tokens']:>14d} {r['trained_tokens_per_s']:>9.1f} "
              f"{_mib(r['peak_bytes']):>12s} {'-' if speed is None else f'{speed:.2f}x':>12s} "
              f"{'-' if memory is None else f'{memory:.2f}x':>13s}")
    for name, p in summary["publish"].items():
        if "stall_s_per_version" in p:
            print(f"publish {name:10s}: stall {p['stall_s_per_version']:.3f} s/version ({p['stall_fraction']:.1%} of "
                  f"{p['wall_s']:.1f} s wall, {p['versions']} versions; drain {p['drain_s']:.2f} s)")
        else:
            print(f"publish {name:10s}: {p.get('error', '').splitlines()[0]}")
    if summary["mfu"] is not None:
        print(f"MFU: reference {summary['reference_mfu']:.1%}, flywheel {summary['mfu']:.1%}")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_phase"]:  # hidden: one loop in this fresh process
        Path(argv[2]).write_text(json.dumps(phase(json.loads(argv[1]))))
        return None
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", type=Path, help="a local Hugging Face model directory (default: built from a config)")
    parser.add_argument("--quick", action="store_true", help="seconds: a tiny model and short sessions (the test)")
    parser.add_argument("--shape", choices=tuple(MODELS), help="the built model and its workload (default: the device's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a TrainerSettings field for the flywheel loop (repeatable); {', '.join(SHARED)} "
                             "apply to both loops")
    parser.add_argument("--steps", type=int, help="timed steps per loop")
    parser.add_argument("--samples-per-step", type=int)
    parser.add_argument("--warmup-samples", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", default="reference,flywheel,publish", help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else args.shape or args.device
    workload = dict(WORKLOADS[mode])
    for key in ("steps", "samples_per_step", "warmup_samples"):
        if getattr(args, key) is not None:
            workload[key] = getattr(args, key)
    if workload["steps"] < 1 or workload["samples_per_step"] < 1 or workload["warmup_samples"] < 1:
        parser.error("--steps, --samples-per-step and --warmup-samples must be at least 1")
    trainer = {"micro_batch_tokens": 512} if args.quick else {}
    trainer.update(_parse_sets(args.set, parser))
    try:
        cfg = TrainerSettings(**trainer)
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    if not loops or set(loops) - {"reference", "flywheel", "publish"}:
        parser.error("--loops takes a subset of reference,flywheel,publish")
    spec = {"device": args.device, "shape": mode, "model_dir": str(args.model) if args.model else None,
            "seed": args.seed, "workload": workload, "trainer": trainer}
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    publish: dict[str, dict[str, Any]] = {}
    raw: list[dict[str, Any]] = []  # every phase's whole result
    for loop in ("reference", "flywheel"):
        if loop in loops:
            print(f"bench.trainer_step: {loop} loop ...", flush=True)
            shared = {k: v for k, v in trainer.items() if k in SHARED}  # all the reference takes from the settings
            results[loop] = r = run_phase({**spec, "loop": loop, "trainer": shared if loop == "reference" else trainer},
                                          args.timeout)
            raw.append(r)
            if "error" not in r:
                print(f"  {r['trained_tokens_per_s']:.1f} trained tokens/s, peak {_mib(r['peak_bytes'])} "
                      f"({r['process_s']:.0f} s)", flush=True)
    if "publish" in loops:
        for name, background in (("background", True), ("inline", False)):
            print(f"bench.trainer_step: publish ({name}) ...", flush=True)
            r = run_phase({**spec, "loop": "publish", "background": background}, args.timeout)
            publish[name] = {**r.get("publish", r), "load_avg_1m": r.get("load_avg_1m")}
            raw.append(r)
    described = next((r for r in raw if "device" in r), {})  # names the device, the model and the traffic
    summary = report(results, publish, described, cfg, spec, argv)
    summary["bench_wall_s"] = round(time.monotonic() - started, 1)
    print_table(summary)
    print(f"bench.trainer_step: {summary['bench_wall_s']:.0f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    failed = [k for k, r in [*summary["loops"].items(), *publish.items()] if "error" in r]
    if failed:
        raise SystemExit(f"bench.trainer_step: {', '.join(failed)} failed (the summary says why)")
    return summary


def report(loops: dict[str, dict[str, Any]], publish: dict[str, dict[str, Any]], described: dict[str, Any],
           cfg: TrainerSettings, spec: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The summary: headline figures first, then everything each phase measured."""
    ref, fly = loops.get("reference", {}), loops.get("flywheel", {})
    bg, inline = publish.get("background", {}), publish.get("inline", {})

    def get(r: dict[str, Any], key: str) -> Any:
        return r.get(key)

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a is not None and b else None

    return {
        "reference_trained_tokens_per_s": get(ref, "trained_tokens_per_s"),
        "flywheel_trained_tokens_per_s": get(fly, "trained_tokens_per_s"),
        "reference_peak_bytes": get(ref, "peak_bytes"),
        "flywheel_peak_bytes": get(fly, "peak_bytes"),
        "speedup": ratio(get(fly, "trained_tokens_per_s"), get(ref, "trained_tokens_per_s")),
        "peak_ratio": ratio(get(fly, "peak_bytes"), get(ref, "peak_bytes")),
        "device": described.get("device"),
        "params": described.get("params"),
        "mfu": get(fly, "mfu"),
        "reference_mfu": get(ref, "mfu"),
        "publish_stall_s_per_version": bg.get("stall_s_per_version"),
        "publish_stall_fraction": bg.get("stall_fraction"),
        "publish_wall_s": bg.get("wall_s"),
        "publish_inline_stall_s_per_version": inline.get("stall_s_per_version"),
        "publish_inline_stall_fraction": inline.get("stall_fraction"),
        "publish_inline_wall_s": inline.get("wall_s"),
        "settings": {"trainer": cfg.model_dump(mode="json"), "trainer_overrides": spec["trainer"],
                     "workload": spec["workload"], "model": spec["model_dir"] or MODELS[spec["shape"]],
                     "seed": spec["seed"], "max_grad_norm": MAX_GRAD_NORM},
        "traffic": described.get("traffic"),
        "warmup_traffic": described.get("warmup_traffic"),
        "loops": loops,
        "publish": publish,
        "command": shlex.join([sys.executable, "-m", "bench.trainer_step", *argv]),
    }


if __name__ == "__main__":
    main()
