"""The tiny model end to end: quick build and cache, sampling, logprob parity, chat prefixes, weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from demo.tinymodel import task
from demo.tinymodel.build import QUICK, ensure_default_model
from demo.tinymodel.evaluate import evaluate
from flywheel.lm import (
    chat_prompt_ids,
    completion_text,
    export_state,
    generate,
    load_model,
    load_state,
    token_logprobs,
)
from flywheel.sampling import Processing

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    cache = tmp_path_factory.mktemp("tinymodel-cache")
    started = time.monotonic()
    path = ensure_default_model(cache, quick=True)
    return cache, path, time.monotonic() - started


@pytest.fixture(scope="module")
def loaded(built):
    torch.set_num_threads(1)
    return load_model(built[1])


def test_build_layout_and_cache_reuse(built) -> None:
    cache, path, _ = built
    assert path.parent == cache and path.name == QUICK.fingerprint()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "build_info.json"):
        assert (path / name).is_file(), name
    assert json.loads((path / "build_info.json").read_text())["fingerprint"] == QUICK.fingerprint()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "temporary build dirs left behind"
    started = time.monotonic()
    assert ensure_default_model(cache, quick=True) == path
    assert time.monotonic() - started < 0.5


def test_weights_are_bf16_values_computed_in_fp32(built, loaded) -> None:
    from safetensors import safe_open

    with safe_open(built[1] / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    model, _ = loaded
    assert not model.training
    for p in model.parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, p.to(torch.bfloat16).float())
    assert sum(p.numel() for p in model.parameters()) < 3_000_000


def test_generation_is_seeded_and_stops_at_eos(loaded) -> None:
    model, tok = loaded
    problems = task.heldout_problems(6)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": task.user_message(p)}]) for p in problems]
    a = generate(model, prompts, max_new_tokens=16, seed=123, eos_token_id=tok.eos_token_id)
    b = generate(model, prompts, max_new_tokens=16, seed=123, eos_token_id=tok.eos_token_id)
    assert a == b
    for s in a:
        assert len(s.token_ids) == len(s.logprobs) >= 1
        assert all(lp <= 0 for lp in s.logprobs)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in s.token_ids[:-1]
        else:
            assert len(s.token_ids) == 16
    short = generate(model, prompts, max_new_tokens=2, seed=1, eos_token_id=tok.eos_token_id)
    assert all(len(s.token_ids) <= 2 for s in short)
    greedy = generate(model, prompts, max_new_tokens=16, processing=Processing(temperature=0.0), eos_token_id=tok.eos_token_id)
    assert greedy == generate(model, prompts[:3], max_new_tokens=16, processing=Processing(temperature=0.0),
                              eos_token_id=tok.eos_token_id) + greedy[3:]


def test_sampled_logprobs_match_a_full_forward_pass(loaded) -> None:
    model, tok = loaded
    problems = task.heldout_problems(8, seed=5)
    # different prompt lengths in one batch exercise left padding with the KV cache
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": task.user_message(p)}]) for p in problems]
    prompts[0] = chat_prompt_ids(
        tok,
        [
            {"role": "user", "content": task.user_message(problems[0])},
            {"role": "assistant", "content": "a b"},
            {"role": "user", "content": task.RETRY_MESSAGE},
        ],
    )
    samples = generate(model, prompts, max_new_tokens=12, seed=7, eos_token_id=tok.eos_token_id)
    for prompt, s in zip(prompts, samples, strict=True):
        full = token_logprobs(model, prompt + s.token_ids)[len(prompt) - 1 :]
        assert len(full) == len(s.logprobs)
        assert max(abs(x - y) for x, y in zip(full, s.logprobs, strict=True)) < 1e-4
    # top-p renormalises: every sampled token's logprob is >= its full-distribution logprob
    nucleus = generate(model, prompts, max_new_tokens=12, seed=7, processing=Processing(top_p=0.5), eos_token_id=tok.eos_token_id)
    for prompt, s in zip(prompts, nucleus, strict=True):
        full = token_logprobs(model, prompt + s.token_ids)[len(prompt) - 1 :]
        assert all(lp >= f - 1e-5 for lp, f in zip(s.logprobs, full, strict=True))


def test_two_turn_prompt_extends_turn_one(loaded) -> None:
    model, tok = loaded
    problem = task.heldout_problems(1, seed=11)[0]
    turn1 = [{"role": "user", "content": task.user_message(problem)}]
    prompt1 = chat_prompt_ids(tok, turn1)
    for seed in range(5):
        (s,) = generate(model, [prompt1], max_new_tokens=16, seed=seed, eos_token_id=tok.eos_token_id)
        if s.finish_reason != "stop":
            continue
        text = completion_text(tok, s.token_ids)
        turn2 = turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": task.RETRY_MESSAGE}]
        prompt2 = chat_prompt_ids(tok, turn2)
        assert prompt2[: len(prompt1) + len(s.token_ids)] == prompt1 + s.token_ids
        assert prompt2[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_export_and_load_state_round_trip_bit_exact(loaded, built) -> None:
    model, _ = loaded
    state = export_state(model)
    assert "lm_head.weight" not in state  # tied to the embedding, exported once
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in state.values())
    other, _ = load_model(built[1])
    gen = torch.Generator().manual_seed(torch.seed())
    noisy = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16) for k, v in state.items()}
    load_state(other, noisy)
    back = export_state(other)
    assert all(torch.equal(back[k].view(torch.int16), noisy[k].view(torch.int16)) for k in noisy)
    assert torch.equal(other.lm_head.weight, other.model.embed_tokens.weight)
    with pytest.raises(KeyError):
        load_state(other, {k: v for k, v in state.items() if k != "model.norm.weight"})


def test_quick_model_is_usable(loaded) -> None:
    model, tok = loaded
    success = evaluate(model, tok, task.heldout_problems(100), seed=0)
    assert 0.05 <= success <= 0.6
