"""Two CPU ranks over gloo train exactly as one process (trainer/distributed.py).

``python -m trainer.selftest`` trains the quick tiny model for 4 optimizer steps on
fixed synthetic ScoredTrajectory batches (5, 4, 1 and 6 samples; 64-token micro-batches, so the
ranks run different numbers of passes and, on the 1-sample step, one rank has no data at all)
through ``trainer.step.train_step``, rebuilding model and optimizer from their full states after
step 2. It runs once alone (no torchrun: the single-process no-op path) and
once under ``torchrun --nproc_per_node 2``, there with FSDP2 and then DDP. Compared: per-step
losses, the step-1 gradients, the final full parameters and the full optimizer state, which must
have the single-process ``optimizer.state_dict()`` layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WRAPPERS = ("fsdp2", "ddp")


def selftest(model_dir: Path, out: Path, *launcher: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, *launcher, "-m", "trainer.selftest", "--model", str(model_dir), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text())


def assert_tensors_close(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], atol: float, what: str) -> None:
    assert one.keys() == two.keys(), f"{what}: names differ: {sorted(one.keys() ^ two.keys())}"
    for name in one:
        assert two[name].dtype == one[name].dtype and two[name].shape == one[name].shape, f"{what} {name}"
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def test_two_gloo_ranks_train_like_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    one = selftest(tiny_model_dir, tmp_path / "one")
    two = selftest(tiny_model_dir, tmp_path / "two", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    assert one["world_size"] == 1 and list(one["runs"]) == ["none"]
    assert two["world_size"] == 2 and list(two["runs"]) == list(WRAPPERS)

    reference = one["runs"]["none"]["steps"]
    losses = [s["loss"] for s in reference]
    # Ranks ran different numbers of micro-batches, and on step 3 one rank had no data at all: the
    # shorter ones ran placeholder passes (the passes are the same on every rank, or it would hang).
    placeholders = [s["placeholder_passes"] for s in two["runs"]["fsdp2"]["steps"]]
    assert placeholders[2] == 1 and sum(placeholders) >= 2, placeholders
    for step, size in zip(two["runs"]["fsdp2"]["steps"], (5, 4, 1, 6)):  # the shares partition each batch
        assert len(step["shards"]) == 2 and sorted(step["shards"][0] + step["shards"][1]) == list(range(size))
    base = torch.load(tmp_path / "one" / "state-none.pt")
    for wrapper in WRAPPERS:
        steps = two["runs"][wrapper]["steps"]
        assert [s["tokens"] for s in steps] == [s["tokens"] for s in reference]
        assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-5), wrapper
        assert [s["grad_norm"] for s in steps] == pytest.approx([s["grad_norm"] for s in reference], rel=1e-5), wrapper
        state = torch.load(tmp_path / "two" / f"state-{wrapper}.pt")
        assert_tensors_close(base["grads"], state["grads"], atol=1e-7, what=f"{wrapper} step-1 gradient")
        # Full state gathered on rank 0 == the single process's parameters (same names, fp32).
        assert_tensors_close(base["params"], state["params"], atol=1e-5, what=f"{wrapper} parameter")
        optim, optim_base = state["optimizer"], base["optimizer"]
        assert optim["param_groups"] == optim_base["param_groups"], wrapper
        assert optim["state"].keys() == optim_base["state"].keys()
        for i, moments in optim_base["state"].items():
            assert_tensors_close(moments, optim["state"][i], atol=1e-6, what=f"{wrapper} optimizer state {i}")


def test_shards_partition_a_batch_deterministically() -> None:
    from trainer.distributed import Dist

    items = [f"s{i}" for i in range(7)]
    cost = dict(zip(items, [5, 1, 9, 3, 3, 0, 2])).__getitem__
    for world in (1, 2, 3, 8):
        ranks = [Dist(rank=r, world_size=world) for r in range(world)]
        for by_cost in (None, cost):
            shares = [d.shard(items, by_cost) for d in ranks]
            assert sorted(sum(shares, [])) == sorted(items)  # a partition
            assert all(share == [x for x in items if x in share] for share in shares)  # batch order kept
            assert shares == [d.shard(items, by_cost) for d in ranks]  # deterministic
            assert all(shares) or world > len(items)  # nobody idle while there are enough items
    # Greedy by cost: 12 and 11 (every other item would be 19 and 4).
    assert [Dist(rank=r, world_size=2).shard(items, cost) for r in range(2)] == [["s1", "s2", "s6"], ["s0", "s3", "s4", "s5"]]
    assert [Dist(rank=r, world_size=3).shard(items[:2]) for r in range(3)] == [["s0"], ["s1"], []]


def run_trainer(root: Path, launcher: list[str], registry: Any, samples: int) -> None:
    """``flywheel trainer`` on ``root/settings.json`` (in one process, or under ``launcher``), until
    it has trained ``samples`` trajectories; then SIGTERM, and a clean stop after step
    ``samples / BATCH``."""
    import signal
    import time

    from tests.integration.test_trainer_durability import BATCH, trained_ids

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    log_path = root / "trainer.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, *launcher, "-m", "launch.cli", "--config", str(root / "settings.json"),
                                 "trainer"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while len(trained_ids(registry)) < samples and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    log = log_path.read_text()
    # torchrun answers SIGTERM by passing it to the ranks and exiting 1 itself; rank 0 stops
    # the loop, tells the other rank to stop, and both leave the process group cleanly.
    assert code == (1 if launcher else 0), log[-5000:]
    assert f"trainer stopping at step {samples // BATCH}" in log, log[-5000:]


def test_the_trainer_loop_under_torchrun_trains_like_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``flywheel trainer`` launched by torchrun with 2 gloo ranks (FSDP2) against the same trainer
    as one process, on the same 16 scored trajectories: the same 4 versions, with the same losses,
    nearly the same weights (bf16 exports of fp32 masters whose sums ran in another order), every
    trajectory trained once, and a clean stop on SIGTERM; the 2-rank versions are sharded. Both
    pull towards a KL reference, which the 2-rank trainer shards as it does the policy."""
    from tests.integration.test_trainer_durability import (
        make_settings,
        registry_for,
        scored_trajectories,
        send,
        trained_ids,
    )

    samples = scored_trajectories(tiny_model_dir, 16, seed=3)
    runs = {}
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])):
        root = tmp_path / name
        root.mkdir()
        settings = make_settings(root, f"sqlite:///{root / 'flywheel.db'}", tiny_model_dir, micro_batch_tokens=96,
                                 kl_coef=0.1)
        # One partition: both trainers read the samples in the same order, so form the same batches.
        settings = settings.model_copy(update={"bus": settings.bus.model_copy(update={"partitions": 1})})
        (root / "settings.json").write_text(json.dumps(settings.model_dump(mode="json")))
        registry = registry_for(settings)
        send(settings, [s.to_bytes() for s in samples])
        run_trainer(root, launcher, registry, len(samples))
        runs[name] = registry
    one, two = runs["one"].versions(), runs["two"].versions()
    assert one[-1].metrics["kl"] > 0  # the policy has moved away from the reference
    assert [v.version for v in two] == [v.version for v in one] == [0, 1, 2, 3, 4]
    # Under FSDP2 each rank checkpointed and published its own shard (trainer.sharded_versions);
    # one process publishes whole. A node loads either (Registry.load below) with every hash checked.
    assert all(v.store_key.endswith(".manifest") for v in two[1:]) and not any(v.store_key.endswith(".manifest") for v in one)
    assert sorted(trained_ids(runs["two"])) == sorted(s.trajectory_id for s in samples)
    for a, b in zip(one[1:], two[1:]):
        assert b.metrics["trajectory_ids"] == a.metrics["trajectory_ids"]
        for key in ("loss", "mean_ratio", "clip_frac", "grad_norm", "kl"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), (b.version, key)
        assert b.metrics["tokens"] == a.metrics["tokens"]
        wa, wb = runs["one"].load(a.version), runs["two"].load(b.version)
        differing = sum(int((wa[k] != wb[k]).sum()) for k in wa)
        total = sum(t.numel() for t in wa.values())
        assert differing <= 1e-3 * total, (b.version, differing, total)


def moe_model_dir(tiny_model_dir: Path, path: Path) -> Path:
    """A tiny Qwen3-MoE (6 experts, top 2) with the quick model's tokenizer, saved in bf16 as a
    Hugging Face folder: one tensor per expert in its file, fused parameters in the model."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, path / name)
    tiny = AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=tiny.vocab_size, eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id,
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_a_mixture_of_experts_trains_under_torchrun_on_its_checkpoints_names(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """``flywheel trainer`` under torchrun (2 gloo ranks, FSDP2, sharded versions, a KL reference)
    on a mixture of experts whose v0 a node registered from its folder, one tensor per expert: each
    rank starts from its rows of the fused experts, and every version it publishes holds the
    folder's names and loads where the folder loads, to the version's hash."""
    from flywheel.db.session import make_engine, make_session_factory, upgrade
    from flywheel.lm import export_state, load_state, load_weights
    from flywheel.weights.codec.state import decode_full, state_sha256
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store
    from tests.integration.test_trainer_durability import make_settings, scored_trajectories, send

    model_dir = moe_model_dir(tiny_model_dir, tmp_path / "moe-model")
    samples = scored_trajectories(model_dir, 8, seed=3)
    rewards = [s.total_reward for s in samples]
    assert all(len(set(rewards[i:i + 4])) == 2 for i in (0, 4))  # each batch of 4 has advantages
    root = tmp_path / "run"
    root.mkdir()
    settings = make_settings(root, f"sqlite:///{root / 'flywheel.db'}", model_dir, micro_batch_tokens=96, kl_coef=0.1)
    # One partition: the batches are the samples in the order sent, so each holds a prompt whose two
    # samples were rewarded differently (advantages not all zero; two partitions could pair equals).
    settings = settings.model_copy(update={"bus": settings.bus.model_copy(update={"partitions": 1})})
    (root / "settings.json").write_text(json.dumps(settings.model_dump(mode="json")))
    upgrade(settings.database_url)
    registry = Registry(make_session_factory(make_engine(settings.database_url)), make_store(settings), settings.model.line)
    files = decode_full((model_dir / "model.safetensors").read_bytes())
    v0 = registry.ensure_base(files, reason="test: as a vLLM node registers its folder")
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in files
    assert v0.sha256 == state_sha256(export_state(load_weights(model_dir)))
    send(settings, [s.to_bytes() for s in samples])

    run_trainer(root, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], registry, len(samples))
    versions = registry.versions()
    assert [v.version for v in versions] == [0, 1, 2]
    assert all(v.store_key.endswith(".manifest") for v in versions[1:])
    # v1's first step scored the samples as v0 served them: the ranks started from v0's weights.
    assert versions[1].metrics["parity_max"] < 1e-4 and versions[1].metrics["kl"] == 0.0
    assert versions[-1].metrics["kl"] > 0
    last = registry.load(versions[-1].version)
    assert last.keys() == files.keys()
    moved = [n for n in files if not torch.equal(last[n], files[n])]
    assert any(".experts." in n for n in moved), moved  # the experts trained, not only the rest
    served = load_weights(model_dir)
    load_state(served, last)
    assert state_sha256(export_state(served)) == versions[-1].sha256


def test_a_model_without_weights_reads_them_from_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``lm.skeleton_model`` builds the model with its parameters on ``meta`` and its buffers
    computed (modules another thread builds meanwhile keep their weights); ``Dist.wrap(model,
    files)`` fills it from safetensors files (in one process, whole tensors: the rows path is the
    torchrun loop's, above) exactly as loading the folder does, tied weights tied; files that lack
    a parameter are refused by name."""
    import threading

    import safetensors.torch

    from flywheel.lm import load_weights, skeleton_model
    from flywheel.weights.codec.tensorfile import weight_files
    from trainer.distributed import SINGLE

    stop, seen = threading.Event(), []

    def build() -> None:
        while not stop.is_set():
            seen.append(torch.nn.Linear(8, 8).weight.is_meta)

    other = threading.Thread(target=build)
    other.start()
    try:
        skeleton = skeleton_model(tiny_model_dir)
    finally:
        stop.set()
        other.join()
    assert seen and not any(seen)
    assert all(p.is_meta for p in skeleton.parameters())
    whole = load_weights(tiny_model_dir)
    buffers = dict(whole.named_buffers())
    assert {n: torch.equal(b, buffers[n]) for n, b in skeleton.named_buffers()} == {n: True for n in buffers}

    model = SINGLE.wrap(skeleton, weight_files(tiny_model_dir))
    params = dict(whole.named_parameters())
    assert {n: torch.equal(p, params[n]) for n, p in model.named_parameters()} == {n: True for n in params}
    if whole.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    partial = tmp_path / "partial.safetensors"
    first = next(iter(params))
    safetensors.torch.save_file({first: params[first].detach().clone()}, partial)
    with pytest.raises(KeyError, match=r"is not in"):
        SINGLE.wrap(skeleton_model(tiny_model_dir), [partial])
    with pytest.raises(FileNotFoundError, match=r"filesystem they share"):
        SINGLE.wrap(skeleton_model(tiny_model_dir), [tmp_path / "on-another-host.safetensors"])

