"""Builds the default tiny model from nothing: noisy task corpus -> tokenizer -> pretraining -> bf16 HF dir.

:func:`ensure_default_model` builds once per recipe into ``cache_dir/<fingerprint>/`` and reuses it
afterwards. The fingerprint hashes the recipe (every hyperparameter plus :data:`CODE_VERSION`;
bump it whenever the task, tokenizer or training code changes what gets built). A build happens
in a temporary sibling directory that is renamed into place, under a file lock, so a reader
never sees a half-written model and two racing processes build it once.

The corpus is noisy on purpose: an answer is right with probability ``p_correct`` and otherwise a
plausible mistake (:func:`demo.tinymodel.task.mistake`); after a wrong first answer, some
conversations go on with the user's retry message and a second (equally noisy) attempt. The
pretrained model therefore puts substantial but minority probability on the right answer, which
is the headroom reinforcement learning from feedback is meant to claim. Held-out problems never
appear in the corpus. Nothing is downloaded; seeds are fixed.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from demo.tinymodel import task
from demo.tinymodel.tokenizer import ASSISTANT, END, USER, train_tokenizer

#: Bump when the code changes what a given recipe builds.
CODE_VERSION = "tiny-sort-v2"


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the built model."""

    seed: int = 0
    p_correct: float = 0.35
    p_retry: float = 0.4  # chance that a wrong first answer is followed by a retry turn
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 3
    num_heads: int = 4
    max_positions: int = 128
    steps: int = 320
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    code_version: str = CODE_VERSION

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


FULL = Recipe()
QUICK = dataclasses.replace(FULL, steps=180, batch_size=32, lr=4e-3)


def recipe_for(quick: bool) -> Recipe:
    return QUICK if quick else FULL


def conversation(rng: random.Random, recipe: Recipe) -> list[dict]:
    """One pretraining conversation: a request, a noisy answer, maybe a retry and a second answer."""
    problem = task.traffic_problem(rng)
    first = task.noisy_answer(problem, rng, recipe.p_correct)
    messages = [
        {"role": "user", "content": task.user_message(problem)},
        {"role": "assistant", "content": first},
    ]
    if first != problem.answer and rng.random() < recipe.p_retry:
        messages.append({"role": "user", "content": task.RETRY_MESSAGE})
        messages.append({"role": "assistant", "content": task.noisy_answer(problem, rng, recipe.p_correct)})
    return messages


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) in the chat format; the mask is 1 on assistant content and its ``<|end|>``."""
    special = {name: tokenizer.convert_tokens_to_ids(name) for name in (USER, ASSISTANT, END)}
    bodies = tokenizer([m["content"] for m in messages], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    mask: list[int] = []
    for message, body in zip(messages, bodies, strict=True):
        role = USER if message["role"] == "user" else ASSISTANT
        trained = int(role == ASSISTANT)
        ids += [special[role]] + body + [special[END]]
        mask += [0] + [trained] * (len(body) + 1)
    return ids, mask


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(examples):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask, strict=True)])
    return ids, attn, labels


def _length_bucketed(examples: list, batch_size: int, rng: random.Random, block: int = 8) -> list[list]:
    """Batches of similar lengths (less padding): sort each block of ``block`` batches, shuffle batch order."""
    batches = []
    span = batch_size * block
    for start in range(0, len(examples), span):
        group = sorted(examples[start : start + span], key=lambda e: len(e[0]))
        batches += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


def train_model(recipe: Recipe, out_dir: Path, log=print) -> dict:
    """Build the tokenizer and pretrain the model into ``out_dir``; returns build info."""
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same arithmetic on every machine; >1 thread is slower when cores are shared
    try:
        return _train(recipe, out_dir, log, started)
    finally:
        torch.set_num_threads(threads)


def _train(recipe: Recipe, out_dir: Path, log, started: float) -> dict:
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    n_convs = recipe.steps * recipe.batch_size
    convs = [conversation(rng, recipe) for _ in range(n_convs)]
    tokenizer = train_tokenizer(m["content"] for c in convs[:2000] for m in c)
    for c in convs[:8]:  # the fast path must agree with the chat template
        expected = tokenizer.apply_chat_template(c, tokenize=True, return_dict=False)
        if encode_conversation(tokenizer, c)[0] != list(expected):
            raise AssertionError("encode_conversation disagrees with the chat template")
    examples = [encode_conversation(tokenizer, c) for c in convs]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    pad_id = tokenizer.pad_token_id
    for step, chunk in enumerate(_length_bucketed(examples, recipe.batch_size, rng)):
        ids, attn, labels = _batch(chunk, pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == recipe.steps - 1:
            log(f"step {step:5d} loss {loss.item():.4f} ({time.monotonic() - started:.1f}s)")
    train_s = time.monotonic() - started

    model = model.eval().to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    from demo.tinymodel.evaluate import evaluate  # the saved bf16 model, as served
    from flywheel.lm import load_model

    served, served_tokenizer = load_model(out_dir)
    info = {
        "recipe": dataclasses.asdict(recipe),
        "fingerprint": recipe.fingerprint(),
        "train_s": round(train_s, 2),
        "parameters": sum(p.numel() for p in served.parameters()),
        "heldout_success": evaluate(served, served_tokenizer, task.heldout_problems(), seed=0),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


def ensure_default_model(cache_dir: Path, quick: bool = False) -> Path:
    """The default tiny model's directory under ``cache_dir``, building it first if needed."""
    recipe = recipe_for(quick)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / recipe.fingerprint()
    if (final / "config.json").exists():
        return final
    with open(cache_dir / f"{recipe.fingerprint()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.fingerprint()}-", dir=cache_dir))
        try:
            train_model(recipe, tmp, log=lambda _msg: None)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the default tiny model and report its held-out success.")
    parser.add_argument("--out", type=Path, required=True, help="cache directory")
    parser.add_argument("--quick", action="store_true", help="the small test build")
    args = parser.parse_args(argv)
    from demo.tinymodel.evaluate import evaluate
    from flywheel.lm import load_model

    started = time.monotonic()
    path = ensure_default_model(args.out, quick=args.quick)
    built_s = time.monotonic() - started
    model, tokenizer = load_model(path)
    success = evaluate(model, tokenizer, task.heldout_problems())
    print(path)
    print(f"build_or_load_s={built_s:.1f} heldout_success={success:.3f}")


if __name__ == "__main__":
    main()
