"""A local Hugging Face causal LM: load, sample with token ids and logprobs, export/load its weights.

- :func:`load_model` reads a local Hugging Face directory; weights are bf16 values, computed in
  fp32, in eval mode. Thread counts are left to the caller. :func:`skeleton_model` builds the
  same model without its weights (parameters on ``meta``; buffers computed from the config, the
  persistent ones read from the directory's files).
- :func:`generate` samples a batch (left padding, attention mask, KV cache) and returns, per
  prompt, the sampled token ids and the log-probability of each under the distribution it was
  drawn from (the processed distribution of ``flywheel.sampling``: logit bias, penalties,
  temperature, min-p, top-k, top-p), which is what importance-sampling corrections need.
  Generation stops after ``eos_token_id`` (included) or ``max_new_tokens``. A temperature
  below 1e-5 means greedy decoding, with log-probability 0 (the distribution is a point mass).
- :func:`export_state` / :func:`load_state`: the model's weights as a flat name -> tensor dict,
  the thing versions are made of. Parameters as bf16, under ``model.named_parameters()`` names, so
  tied weights appear once, under their first name (``model.embed_tokens.weight``;
  ``lm_head.weight`` is left out when tied); and the buffers a checkpoint holds
  (:func:`persistent_buffers`) as the model holds them. Computed buffers (rotary frequencies) are
  not exported. Where transformers lays a checkpoint out otherwise in the model (a mixture of
  experts' fused experts), the names and shapes are the checkpoint's (``flywheel.weightnames``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from flywheel.logprobs import processed_logprobs
from flywheel.sampling import NEUTRAL, Processing
from flywheel.weightnames import to_checkpoint, to_model

hf_logging.disable_progress_bar()  # a server's log is no place for progress bars


@dataclass(frozen=True)
class Sample:
    """One completion: sampled ids (eos included when it stopped), their logprobs, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


def load_model(path: str | Path) -> tuple[PreTrainedModel, object]:
    """Load a local model directory as (fp32 model in eval mode, tokenizer). Nothing downloaded."""
    return load_weights(path), AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def load_weights(path: str | Path) -> PreTrainedModel:
    """:func:`load_model`'s model alone (a trainer needs no tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True, dtype=torch.float32)
    return model.float().eval()


def skeleton_model(path: str | Path) -> PreTrainedModel:
    """The model of a local directory as :func:`load_model` builds it (fp32, eval mode), with no
    weights: every parameter on the ``meta`` device. Buffers are real: computed from the config
    (rotary frequencies), and the persistent ones the directory's safetensors files hold read
    from them, as loading the directory would (a MoE router's ``e_score_correction_bias``, a
    layer's scalar: trained values, not the config's initial ones). Nothing else is read. What a
    training rank starts from when it takes its weights from rank 0 or its own slices of a file
    (``trainer.distributed``)."""
    config = AutoConfig.from_pretrained(Path(path), local_files_only=True)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _read_persistent_buffers(model, Path(path))
    return model.float().eval()


def _read_persistent_buffers(model: torch.nn.Module, path: Path) -> None:
    """Copy into ``model`` the :func:`persistent_buffers` that the ``*.safetensors`` files of
    ``path`` hold, cast to each buffer's dtype; a shape that differs is a ``ValueError``. A folder
    without safetensors files leaves them as computed (rank 0's are sent to the others then)."""
    from flywheel.weights.codec.tensorfile import TensorFiles, weight_files

    buffers = persistent_buffers(model)
    if not buffers:
        return
    try:
        paths = weight_files(path)
    except ValueError:
        return
    with TensorFiles(paths) as files, torch.no_grad():
        for name in buffers.keys() & files.index.keys():
            with files.view(name) as value:
                if tuple(value.shape) != tuple(buffers[name].shape):
                    raise ValueError(f"{name}: shape {tuple(value.shape)} in {path}, {tuple(buffers[name].shape)} in the model")
                buffers[name].copy_(value)


_ON_META = threading.Lock()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers on this thread inside the block moves to ``meta`` as it
    is registered (one layer's weights exist at a time, and only while it is built); buffers stay
    where they are. ``Module.register_parameter`` is patched for the block, so one block runs at a
    time, and other threads' modules are left alone."""
    with _ON_META:
        register = torch.nn.Module.register_parameter
        owner = threading.get_ident()

        def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and threading.get_ident() == owner:
                module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

        torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` in the chat format, ending with the assistant generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def completion_text(tokenizer, token_ids: list[int]) -> str:
    """The text of a completion, special tokens (eos) dropped."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def _pick(logits: torch.Tensor, p: Processing, gen: torch.Generator | None, seen: torch.Tensor | None,
          counts: torch.Tensor | None):
    """Sample one token per row from ``logits`` [B, V] under ``p``; returns (ids [B], logprobs [B])."""
    logp = processed_logprobs(logits, p, seen=seen, output_counts=counts)
    if p.greedy:
        return logp.argmax(dim=-1), torch.zeros(logits.shape[0])
    ids = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    processing: Processing = NEUTRAL,
    seed: int | None = None,
    eos_token_id: int,
) -> list[Sample]:
    """Sample one completion per prompt under ``processing`` (default: the model's own
    distribution). Deterministic for a given ``seed`` and batch."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not 0.0 < processing.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    n = len(prompts)
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # Without padding the causal mask is implicit; building an explicit one costs more than the
    # model itself at this size (a single request, the serving common case, has no padding).
    padded = any(len(p) != width for p in prompts)
    out = model(input_ids=input_ids, attention_mask=mask if padded else None, position_ids=positions, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    next_pos = positions[:, -1] + 1
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    seen = counts = None
    if processing.penalised:  # the history penalties look at: the prompt, then each sampled token
        vocab = logits.shape[-1]
        seen = torch.zeros((n, vocab), dtype=torch.bool)
        counts = torch.zeros((n, vocab), dtype=torch.int32)
        for i, p in enumerate(prompts):
            seen[i, torch.tensor(p, dtype=torch.long)] = True
    for step in range(max_new_tokens):
        ids, lps = _pick(logits.float(), processing, gen, seen, counts)
        if seen is not None and counts is not None:
            rows = torch.arange(n)
            seen[rows, ids] = True
            counts[rows, ids] += 1
        for i in range(n):
            if not done[i]:
                tokens[i].append(int(ids[i]))
                logprobs[i].append(float(lps[i]))
        done |= ids == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        out = model(
            input_ids=ids[:, None],
            attention_mask=mask if padded else None,
            position_ids=next_pos[:, None],
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return [
        Sample(t, lp, "stop" if t and t[-1] == eos_token_id else "length")
        for t, lp in zip(tokens, logprobs, strict=True)
    ]


@torch.no_grad()
def token_logprobs(model: PreTrainedModel, tokens: list[int]) -> list[float]:
    """``log p(tokens[i] | tokens[:i])`` for ``i >= 1`` at temperature 1, from one full forward pass."""
    ids = torch.tensor([tokens], dtype=torch.long)
    logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds (in the ``state_dict``, not parameters): trained values some
    models keep outside their parameters (Gemma 4's ``layer_scalar``, a MoE router's
    ``e_score_correction_bias``); not the computed ones (rotary frequencies)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names = set(model.state_dict(keep_vars=True)) - params
    return {name: b for name, b in model.named_buffers() if name in names}


def export_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the model's parameters as bf16 (tied weights once) and of its
    :func:`persistent_buffers` as it holds them (never trained: kept exactly, as the checkpoint a
    node serves has them, so a version loads where its base did), under the checkpoint's names
    (``flywheel.weightnames.to_checkpoint``: one tensor per expert where the model fuses them)."""
    state = {name: p.detach().to(device="cpu", dtype=torch.bfloat16) for name, p in model.named_parameters()}
    state.update(buffer_state(model))
    return {name: t.contiguous() for name, t in to_checkpoint(model, state).items()}


def buffer_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the model's :func:`persistent_buffers`, dtype kept: their part of
    :func:`export_state`."""
    return {name: b.detach().to("cpu", copy=True).contiguous() for name, b in persistent_buffers(model).items()}


@torch.no_grad()
def load_state(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (as produced by :func:`export_state`) into the model, in place: every
    parameter, and those of its :func:`persistent_buffers` the state holds (a state written before
    versions carried them has none; a model folder's files have them all). Names and shapes are
    the checkpoint's or the model's own (``flywheel.weightnames.to_model``: a trainer's fp32
    master state has the model's)."""
    for _, target, src in pair_state(dict(model.named_parameters()), persistent_buffers(model), to_model(model, state)):
        target.copy_(src)


def pair_state(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
               state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, the model's tensor, the state's)`` for every one of ``params`` and each of
    ``buffers`` that ``state`` holds, checked: a parameter missing or a name that is neither is a
    ``KeyError``, a shape that differs a ``ValueError``. What every loader of a version or a
    master state copies (:func:`load_state`, the merged-LoRA policy, ``Dist.load_full_state``)."""
    missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys() - buffers.keys()
    if missing or unexpected:
        raise KeyError(f"state does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    pairs = [(name, t, state[name]) for name, t in [*params.items(), *((n, b) for n, b in buffers.items() if n in state)]]
    for name, t, src in pairs:
        if tuple(src.shape) != tuple(t.shape):
            raise ValueError(f"{name}: shape {tuple(src.shape)} does not match the model's {tuple(t.shape)}")
    return pairs
