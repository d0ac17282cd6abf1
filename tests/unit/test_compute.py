"""Activation checkpointing and torch.compile (trainer/compute.py): the same step, less kept, and a
compiler failure falls back to eager."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from flywheel.settings import TrainerSettings
from tests.unit.test_packing import samples
from trainer import compute
from trainer.batch import collate
from trainer.head import token_logprobs
from trainer.step import train_step


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float().eval()


def step(model: torch.nn.Module, **settings) -> tuple[dict, dict[str, torch.Tensor]]:
    m = copy.deepcopy(model)
    cfg = TrainerSettings(**{"micro_batch_tokens": 128, "activation_checkpointing": "none", **settings})
    compute.prepare(m, cfg)
    metrics = train_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3), samples(), 0, cfg)
    return metrics, {n: p.detach().clone() for n, p in m.named_parameters()}


def same(a: tuple[dict, dict], b: tuple[dict, dict], tol: float) -> None:
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=tol)
    for name in a[1]:
        assert (a[1][name] - b[1][name]).abs().max().item() <= tol, name


def saved_bytes(model: torch.nn.Module) -> int:
    batch = collate(samples(), [0.0] * 5, packed=True)
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, batch)
    return total[0]


def test_activation_checkpointing_trains_the_same_and_keeps_less(model) -> None:
    plain = step(model, activation_checkpointing="none")
    same(plain, step(model, activation_checkpointing="mlp"), tol=0.0)
    same(plain, step(model, activation_checkpointing="block"), tol=0.0)
    kept = {mode: saved_bytes(compute.prepare(copy.deepcopy(model), TrainerSettings(activation_checkpointing=mode)))
            for mode in ("none", "mlp", "block")}
    assert kept["block"] < kept["mlp"] < 0.75 * kept["none"]
    assert kept["block"] < 0.5 * kept["none"]


def test_compiled_blocks_train_the_same(model) -> None:
    same(step(model), step(model, compile=True), tol=1e-6)


def test_a_compiler_failure_falls_back_to_eager(model, monkeypatch, caplog) -> None:
    def broken(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("no backend here")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="flywheel.trainer"):
        same(step(model), step(model, compile=True), tol=0.0)
    assert sum("torch.compile failed (RuntimeError: no backend here)" in r.message for r in caplog.records) == 3
