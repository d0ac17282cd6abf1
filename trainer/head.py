"""Token log-probabilities of a batch under the model, computed only where trained, in chunks.

:func:`token_logprobs` gives ``[B, T]``: position ``t`` is ``log p(tokens[t] | the segment's tokens
before t)`` at the batch's trainable positions (``mask > 0``) and 0 elsewhere (the loss, the KL
and the parity only read trainable positions). ``p`` is the model's own distribution, except on
the batch's processed turns, where it is the processed distribution the engine sampled from
(``flywheel.logprobs.processed_logprobs``, the segment's tokens before each position being the
penalties' history), so the importance ratio compares like with like; a token the processing drops
under these weights gets ``-inf``.

How, without the ``[tokens x vocab]`` fp32 wall a plain ``model(...).logits.float().log_softmax()``
builds (8k tokens x 32k vocab is 1 GiB, and autograd keeps several):

1. The forward stops at the final hidden states: the output embedding (lm-head) passes its input
   through for the duration of the call, so it runs under the model's own forward (FSDP2 gathers
   the root's parameters there) but computes nothing.
2. A packed batch (trainer/batch.py) attends segment by segment (:func:`varlen_attention`, the
   ``flywheel_varlen`` attention implementation registered with transformers): flash varlen
   attention (``torch.nn.attention.varlen``) on CUDA in bf16/fp16; else exact causal SDPA: short
   segments of similar lengths as the right-padded rows of one call (:data:`BATCHED_UP_TO`),
   others one slice at a time. No segment sees another.
3. The lm-head, log-softmax and gather run over the trainable positions only, ``chunk`` positions
   at a time, each chunk under ``torch.utils.checkpoint``: its logits exist only while it is
   computed, forward and backward, so memory is ``O(chunk x vocab)`` whatever the batch.

Models whose causal-LM head does more than the linear layer (logit soft-capping or scaling) take
the plain full-logits path, which gives the same values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flywheel.logprobs import history, processed_logprobs
from flywheel.sampling import Processing
from trainer.batch import Batch

try:  # torch >= 2.10: flash attention over packed variable-length sequences (CUDA)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: SDPA per segment
    varlen_attn = None

#: The attention implementation packed batches run (registered with transformers on import).
VARLEN = "flywheel_varlen"
#: On the CPU path, segments up to this long whose padding would at most double the attention's
#: work attend as the rows of one call; longer ones one at a time (their per-call cost is nothing
#: beside their attention, and padding them would add to it).
BATCHED_UP_TO = 512
#: Config attributes of heads that transform the logits after the linear layer.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query`` ``[B, H, T, D]`` in, ``[B, T, H, D]``
    out): causal attention within each segment ``cu_seq_lens_q`` bounds (one packed row), or
    transformers' SDPA where the call is not packed (right-padded rows: causal, so real tokens
    never see padding)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    if varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        out = varlen_attn(q, k, v, cu, cu, kwargs["max_length_q"], kwargs["max_length_q"], scale=scaling,
                          **_causal_varlen_kwargs(gqa))
        return out[None], None
    bounds = kwargs.get("segment_bounds") or cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
    if 1 < len(lengths) and max(lengths) <= BATCHED_UP_TO and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths):
        return _batched_segments(query, key, value, bounds, max(lengths), scaling, gqa), None
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                            scale=scaling, enable_gqa=gqa)
             for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
    return torch.cat(parts, dim=2).transpose(1, 2), None


def _batched_segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], longest: int,
                      scaling: float | None, gqa: bool) -> torch.Tensor:
    """Segments of similar lengths as the rows of one causal SDPA call, right-padded to the longest
    (exact: causal attention never lets a real position see the padding after it); ``[1, T, H, D]``."""
    device = query.device
    starts = torch.tensor(bounds[:-1], device=device)
    lengths = torch.tensor(bounds, device=device).diff()
    offsets = torch.arange(longest, device=device)
    index = (starts[:, None] + offsets[None, :]).clamp(max=bounds[-1] - 1)  # [segments, longest]
    real = offsets[None, :] < lengths[:, None]
    rows = [x[0][:, index].transpose(0, 1) for x in (query, key, value)]  # [segments, H, longest, D]
    out = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)[real][None]  # the real positions, in order: [1, T, H, D]


def _causal_varlen_kwargs(gqa: bool) -> dict[str, Any]:
    """``varlen_attn``'s causal flag: ``is_causal`` (torch 2.10) or ``window_size=(-1, 0)`` (later)."""
    params = inspect.signature(varlen_attn).parameters
    out: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if gqa:
        out["enable_gqa"] = True
    return out


AttentionInterface.register(VARLEN, varlen_attention)


def hf_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside ``model`` (itself, or wrapped by peft or DDP)."""
    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


@contextlib.contextmanager
def passthrough(head: torch.nn.Module) -> Iterator[None]:
    """``head`` returns its input for the duration (the model's forward then yields hidden states)."""
    head.forward = lambda hidden, *args, **kwargs: hidden  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def token_logprobs(model: torch.nn.Module, batch: Batch, chunk: int = 1024) -> torch.Tensor:
    """``[B, T]`` log-probabilities at ``batch``'s trainable positions, 0 elsewhere (module docstring)."""
    inner = hf_model(model)
    kwargs: dict[str, Any] = {"input_ids": batch.tokens, "position_ids": batch.positions}
    if batch.packed:
        if inner.config._attn_implementation != VARLEN:
            inner.set_attn_implementation(VARLEN)
        cu = batch.cu_seqlens.to(batch.tokens.device)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen,
                      segment_bounds=batch.cu_seqlens.tolist())
    else:
        kwargs["attention_mask"] = batch.attention
    rows, cols = torch.nonzero(batch.mask > 0, as_tuple=True)
    in_turn = torch.zeros_like(batch.mask, dtype=torch.bool)
    for row, _, start, end, _ in batch.processed:
        in_turn[row, start:end] = True
    plain = ~in_turn[rows, cols]
    rows, cols = rows[plain], cols[plain]
    head = inner.get_output_embeddings()
    if any(getattr(inner.config, name, None) for name in _LOGIT_TRANSFORMS):
        return _full_logits_path(model, kwargs, batch, rows, cols)

    with passthrough(head):
        hidden = model(**kwargs).logits  # [B, T, hidden]
    out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=hidden.device)
    if len(rows):
        picked = torch.cat([checkpoint(_plain_chunk, head, hidden[rows[i:i + chunk], cols[i:i + chunk] - 1],
                                       batch.tokens[rows[i:i + chunk], cols[i:i + chunk]], use_reentrant=False)
                            for i in range(0, len(rows), chunk)])
        out = out.index_put((rows, cols), picked)
    elif not batch.processed:  # nothing trains: still a pass through every parameter (zero gradient),
        out = out + 0.0 * hidden.sum()  # so the backward runs, and FSDP2's collectives with it
    vocab = head.weight.shape[0]
    for row, begin, start, end, processing in batch.processed:
        for a in range(start, end, chunk):
            b = min(a + chunk, end)
            logp = checkpoint(_processed_chunk, head, hidden[row, a - 1 : b - 1], batch.tokens[row, begin:start],
                              batch.tokens[row, start:a], batch.tokens[row, a:b], processing, vocab, use_reentrant=False)
            out = out.index_put((torch.full((b - a,), row, device=out.device), torch.arange(a, b, device=out.device)), logp)
    return out


def _plain_chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def _processed_chunk(head: torch.nn.Module, hidden: torch.Tensor, prompt: torch.Tensor, earlier: torch.Tensor,
                     sampled: torch.Tensor, processing: Processing, vocab: int) -> torch.Tensor:
    seen = counts = None
    if processing.penalised:
        seen, counts = history(prompt, sampled, vocab, earlier=earlier)
    logp = processed_logprobs(head(hidden), processing, seen=seen, output_counts=counts)
    return logp.gather(-1, sampled[:, None]).squeeze(-1)


def _full_logits_path(model: torch.nn.Module, kwargs: dict[str, Any], batch: Batch, rows: torch.Tensor,
                      cols: torch.Tensor) -> torch.Tensor:
    """Heads that transform their logits: the model's own logits, then the same gathers."""
    logits = model(**kwargs).logits.float()
    out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=logits.device)
    picked = torch.log_softmax(logits[rows, cols - 1], dim=-1).gather(-1, batch.tokens[rows, cols][:, None]).squeeze(-1)
    out = out.index_put((rows, cols), picked)
    vocab = logits.shape[-1]
    for row, begin, start, end, processing in batch.processed:
        sampled = batch.tokens[row, start:end]
        seen = counts = None
        if processing.penalised:
            seen, counts = history(batch.tokens[row, begin:start], sampled, vocab)
        logp = processed_logprobs(logits[row, start - 1 : end - 1], processing, seen=seen, output_counts=counts)
        out = out.index_put((torch.full((end - start,), row, device=out.device), torch.arange(start, end, device=out.device)),
                            logp.gather(-1, sampled[:, None]).squeeze(-1))
    return out
