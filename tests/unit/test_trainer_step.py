"""The trainer's step: KL term, token-budget batching, micro-batches with gradient accumulation,
staleness and parity metrics, sync mode's buffer, and the LoRA policy's export."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from flywheel.events import ScoredTrajectory, Segment, Turn
from flywheel.settings import TrainerSettings
from tests.unit.test_loss import scored
from trainer.loss import kl_k3, policy_loss


def test_kl_k3_hand_computed() -> None:
    # d = log(0.25) - log(0.5) = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1
    value = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert value.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-7)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_kl_term_is_added_with_its_coefficient_and_pulls_towards_the_reference() -> None:
    logp = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]], requires_grad=True)
    behaviour = logp.detach().clone()
    ref = torch.tensor([[0.0, math.log(0.25), math.log(0.2)]])
    adv = torch.zeros(1, 3)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = policy_loss(logp, behaviour, adv, mask, 0.2, 2.0, logp_ref=ref, kl_coef=0.5)
    expected_kl = (0.5 + math.log(2) - 1 + 0.0) / 2
    assert out.kl == pytest.approx(expected_kl, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.5 * expected_kl, abs=1e-6)  # advantages are zero
    out.loss.backward()
    # d/dlogp_new of exp(ref - new) - (ref - new) - 1 = 1 - exp(ref - new) = 1 - 0.5 on token 1: > 0,
    # so gradient descent lowers logp_new towards the reference's lower probability.
    assert logp.grad[0, 1].item() == pytest.approx(0.5 * (1 - 0.5) / 2, abs=1e-6)
    assert logp.grad[0, 2].item() == pytest.approx(0.0, abs=1e-7)


def test_normalizer_makes_split_batches_sum_to_the_whole() -> None:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g) * 0.3 - 1
    behaviour = logp + torch.randn(4, 6, generator=g) * 0.2
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    whole_in = logp.clone().requires_grad_(True)
    whole = policy_loss(whole_in, behaviour, adv, mask, 0.2, 2.0)
    whole.loss.backward()
    parts_in = logp.clone().requires_grad_(True)
    n = float(mask.sum())
    total = sum(policy_loss(parts_in[rows], behaviour[rows], adv[rows], mask[rows], 0.2, 2.0, normalizer=n).loss
                for rows in (slice(0, 1), slice(1, 4)))
    total.backward()
    assert total.item() == pytest.approx(whole.loss.item(), abs=1e-6)
    assert torch.allclose(parts_in.grad, whole_in.grad, atol=1e-7)


def _tokens(sample: ScoredTrajectory) -> int:
    return sum(len(s.tokens) for s in sample.segments)


def test_take_by_token_budget() -> None:
    from trainer.buffer import SampleBuffer

    buf = SampleBuffer(max_staleness=4)
    for i in range(5):
        buf.add(scored(f"s{i}", [1, 1]), None, current_version=1)  # 5 tokens each
    assert _tokens(scored("x", [1, 1])) == 5
    assert buf.take(10, max_tokens=30) == []  # 25 tokens buffered, fewer than 10 samples: wait
    buf.add(scored("s5", [1, 1]), None, current_version=1)
    batch = buf.take(10, max_tokens=12)  # budget reached: the oldest samples within 12 tokens
    assert [e.sample.event_id for e in batch] == ["s0", "s1"]
    assert [e.sample.event_id for e in buf.take(2, max_tokens=100)] == ["s2", "s3"]  # count bound
    assert [e.sample.event_id for e in buf.take(8, max_tokens=3)] == ["s4"]  # one sample even over budget
    assert buf.take(8, max_tokens=100) == []


def test_sync_mode_buffer_drops_every_off_policy_sample() -> None:
    from trainer.buffer import SampleBuffer

    buf = SampleBuffer(max_staleness=0)  # what trainer.mode = "sync" uses
    assert buf.add(scored("a", [7]), None, current_version=7) is None
    assert buf.add(scored("b", [6]), None, current_version=7) == "stale"
    assert buf.add(scored("c", [7, 6]), None, current_version=7) == "stale"
    assert [e.sample.event_id for e in buf.purge_stale(8)] == ["a"]


def test_micro_batches_respect_the_padded_budget() -> None:
    from trainer.batch import micro_batches

    samples = [scored(f"s{i}", [1] * k) for i, k in enumerate([1, 1, 3, 1, 6])]  # 3, 3, 7, 3, 13 tokens
    assert micro_batches(samples, 1000, packed=False) == [[0, 1, 2, 3, 4]]
    assert micro_batches(samples, 14, packed=False) == [[0, 1], [2, 3], [4]]  # [0, 1, 2] would pad to 3 x 7 = 21
    assert micro_batches(samples, 1, packed=False) == [[0], [1], [2], [3], [4]]


def test_packed_micro_batches_fill_the_budget_largest_first() -> None:
    from trainer.batch import micro_batches

    samples = [scored(f"s{i}", [1] * k) for i, k in enumerate([1, 1, 3, 1, 6])]  # 3, 3, 7, 3, 13 tokens
    assert micro_batches(samples, 1000) == [[0, 1, 2, 3, 4]]
    # First-fit decreasing: 13 alone (13 + 3 > 14), then 7 + 3 + 3, then the last 3.
    assert micro_batches(samples, 14) == [[4], [0, 1, 2], [3]]
    assert micro_batches(samples, 16) == [[0, 4], [1, 2, 3]]
    assert sorted(len(g) for g in micro_batches(samples, 1)) == [1] * 5


def _task_samples(tokenizer_vocab: int, n: int, seed: int, version: int = 0) -> list[ScoredTrajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(6, 14)
        tokens = [rng.randrange(3, tokenizer_vocab) for _ in range(length)]
        start = rng.randint(2, length - 2)
        seg = Segment(tokens=tokens, mask=[0] * start + [1] * (length - start),
                      logprobs=[0.0] * start + [rng.uniform(-4, -1) for _ in range(length - start)],
                      turns=[Turn(generation_id=f"g{seed}-{i}", start=start, end=length, behaviour_version=version)])
        reward = rng.choice([-1.0, 1.0])
        out.append(ScoredTrajectory(event_id=f"e{seed}-{i}", tenant="t", session_id=f"s{i}", trajectory_id=f"t{seed}-{i}",
                                    model_line="m", segments=[seg], turn_rewards=[reward], total_reward=reward,
                                    reward_spec_version="x"))
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from flywheel.lm import load_model

    torch.manual_seed(0)
    model, _ = load_model(tiny_model_dir)
    return model


def _step(model, samples, **cfg):
    from trainer.step import train_step

    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = train_step(model, opt, samples, 0, TrainerSettings(**cfg), measure_parity=True)
    return model, metrics


def test_gradient_accumulation_over_micro_batches_equals_one_pass(tiny) -> None:
    samples = _task_samples(tiny.config.vocab_size, 6, seed=1)
    one, m1 = _step(tiny, samples, micro_batch_tokens=100_000)
    many, m2 = _step(tiny, samples, micro_batch_tokens=16)  # one sample per pass
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-6)
    assert m1["tokens"] == m2["tokens"] > 0
    for (name, a), (_, b) in zip(one.named_parameters(), many.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert m1["staleness"] == {"0": 6}
    # every sample is on-policy for version 0: parity is measured, p99 between mean and max
    assert 0 <= m1["parity"] <= m1["parity_p99"] <= m1["parity_max"]


def test_kl_reference_at_the_start_adds_nothing_but_the_metric(tiny) -> None:
    from trainer.step import train_step

    samples = _task_samples(tiny.config.vocab_size, 4, seed=2)
    model = copy.deepcopy(tiny).requires_grad_(True)
    reference = copy.deepcopy(tiny).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = TrainerSettings(kl_coef=0.1)
    first = train_step(model, opt, samples, 0, cfg, reference=reference)
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    moved = train_step(model, opt, samples, 0, cfg, reference=reference)
    assert moved["kl"] > 1e-4


def test_lora_policy_exports_base_names_and_starts_equal(tiny) -> None:
    from flywheel.lm import export_state
    from trainer.policy import Policy

    plain = export_state(tiny)
    policy = Policy(copy.deepcopy(tiny), TrainerSettings(lora_rank=4))
    exported = policy.export()
    assert exported.keys() == plain.keys()
    assert all(torch.equal(exported[k], plain[k]) for k in plain)  # B starts at zero
    trainable = policy.trainable()
    assert trainable and all(".lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in trainable) < 0.2 * sum(p.numel() for p in tiny.parameters())
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    moved = policy.export()
    changed = [k for k in plain if not torch.equal(moved[k], plain[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed)
    # the export is the function the wrapped model computes
    from flywheel.lm import load_state

    merged = copy.deepcopy(tiny)
    load_state(merged, {k: v.float() for k, v in moved.items()})
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        a = policy.model(input_ids=ids).logits
        b = merged(input_ids=ids).logits
    assert torch.allclose(a, b, atol=0.05)  # bf16 rounding of the export only
    # a master state round-trips exactly; a published state restarts with zero adapters
    state = policy.master_state()
    other = Policy(copy.deepcopy(tiny), TrainerSettings(lora_rank=4))
    other.load_master(state)
    assert all(torch.equal(other.export()[k], moved[k]) for k in moved)
    other.load_published(plain)
    assert all(torch.equal(other.export()[k], plain[k]) for k in plain)


def test_lora_adapter_versions_are_the_peft_adapter_state(tiny, tmp_path) -> None:
    """``trainer.lora_publish = "adapter"``: a version is the adapter state under the names PEFT saves
    (and vLLM loads), B = 0 at the start; a published version loads back into the LoRA parameters on
    the unchanged base; full weights are refused; the checkpoint master reproduces the export."""
    import safetensors.torch
    from pydantic import ValidationError

    from flywheel.lm import export_state
    from flywheel.weights.codec.state import state_sha256
    from trainer.policy import Policy

    with pytest.raises(ValidationError, match="lora_rank"):
        TrainerSettings(lora_publish="adapter")
    cfg = TrainerSettings(lora_rank=4, lora_publish="adapter")
    policy = Policy(copy.deepcopy(tiny), cfg)
    v0 = policy.export()
    policy.model.save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    saved = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert v0.keys() == saved.keys()  # PEFT's own file format, which vLLM's LoRA loader reads
    weights = dict(tiny.named_parameters())
    targets = [n.removesuffix(".weight") for n in weights if n.endswith(tuple(f"{t}.weight" for t in cfg.lora_targets))]
    assert targets and v0.keys() == {f"base_model.model.{m}.lora_{x}.weight" for m in targets for x in "AB"}
    for m in targets:
        out_features, in_features = weights[f"{m}.weight"].shape
        a, b = v0[f"base_model.model.{m}.lora_A.weight"], v0[f"base_model.model.{m}.lora_B.weight"]
        assert a.shape == (4, in_features) and b.shape == (out_features, 4)
        assert a.dtype == b.dtype == torch.bfloat16 and not b.any() and a.any()

    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    v1 = policy.export()
    assert all(torch.equal(v1[k], v0[k]) for k in v1 if ".lora_A." in k) and any(v1[k].any() for k in v1)

    other = Policy(copy.deepcopy(tiny), cfg)  # other random A: loading replaces both A and B
    other.load_published(v1)
    assert all(torch.equal(other.export()[k], v1[k]) for k in v1)
    base = {n: p for n, p in other.model.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(p, weights[n.removeprefix("base_model.model.").replace(".base_layer.", ".")])
               for n, p in base.items())  # the base is still model.path's
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(other.model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=0.05)
        assert not torch.allclose(other.model(input_ids=ids).logits, tiny(input_ids=ids).logits, atol=1e-3)

    with pytest.raises(ValueError, match="full model weights"):
        other.load_published(export_state(tiny))
    with pytest.raises(ValueError, match="shapes"):
        other.load_published({k: torch.zeros(8, *v.shape[1:]) if ".lora_A." in k else v for k, v in v1.items()})
    resumed = Policy(copy.deepcopy(tiny), cfg)
    resumed.load_master(policy.master_state())
    assert state_sha256(resumed.export()) == state_sha256(v1)  # the resume hash check holds


def test_tokens_outside_the_policys_truncated_support_are_left_out_and_counted(tiny) -> None:
    # Random tokens under top_k = 1: almost none is the model's argmax, so their probability under
    # the policy's processed distribution is 0. They must be counted, not turn the step into NaN.
    samples = [s.model_copy(update={"segments": [seg.model_copy(update={"turns": [
        t.model_copy(update={"top_k": 1}) for t in seg.turns]}) for seg in s.segments]})
        for s in _task_samples(tiny.config.vocab_size, 4, seed=3)]
    model, metrics = _step(tiny, samples)
    completion = sum(sum(seg.mask) for s in samples for seg in s.segments)
    assert metrics["completion_tokens"] == completion
    outside = metrics["masked"]["outside_support"]
    assert 0 < outside <= completion and metrics["tokens"] == completion - outside
    assert math.isfinite(metrics["loss"]) and all(torch.isfinite(p).all() for p in model.parameters())
