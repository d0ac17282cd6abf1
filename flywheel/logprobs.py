"""The processed distribution's log-probabilities: what an engine samples from and the trainer recomputes.

:func:`processed_logprobs` applies a :class:`~flywheel.sampling.Processing` to a model's logits in
vLLM's order (``flywheel/sampling.py`` says which steps, from which of vLLM's sources); :func:`history`
builds the token history the penalties look at.
"""

from __future__ import annotations

import torch

from flywheel.sampling import Processing


def processed_logprobs(
    logits: torch.Tensor,
    p: Processing,
    *,
    seen: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[N, V]`` of the processed distribution of each row of ``logits`` ``[N, V]``
    (module docstring, steps 1-7); dropped tokens get ``-inf``. Differentiable in ``logits``.

    ``seen`` ``[N, V]`` (bool): the tokens of the prompt and of the output before each row's position;
    ``output_counts`` ``[N, V]``: how often each token occurs in that output. Both are needed when
    ``p.penalised``. A greedy ``p`` gives the log-softmax after bias and penalties (what vLLM returns
    for greedy requests); its samples are never trained on.
    """
    logits = logits.float()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(-1, ids, bias.expand(logits.shape[0], -1))
    if p.penalised:
        if seen is None or output_counts is None:
            raise ValueError("penalties need the token history (seen, output_counts)")
        counts = output_counts.to(logits.dtype)
        if p.repetition_penalty != 1.0:
            scale = torch.where(logits > 0, 1.0 / p.repetition_penalty, p.repetition_penalty)
            logits = torch.where(seen, logits * scale, logits)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / p.temperature
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        drop |= probs < probs.amax(dim=-1, keepdim=True) * p.min_p
        logits = logits.masked_fill(drop, float("-inf"))
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        kth = logits.detach().topk(p.top_k, dim=-1).values[:, -1:]
        drop |= logits < kth
        logits = logits.masked_fill(drop, float("-inf"))
    if p.top_p < 1.0:
        ascending, order = logits.detach().sort(dim=-1, descending=False)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        cut_sorted = cumulative <= 1.0 - p.top_p
        cut_sorted[:, -1] = False  # the most likely token always stays
        drop |= torch.zeros_like(drop).scatter(-1, order, cut_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def history(prompt: list[int] | torch.Tensor, output: torch.Tensor, vocab: int,
            earlier: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, output_counts)`` ``[L, V]`` for the ``L`` positions that sample ``output`` ``[L]``
    after ``prompt``: row ``j`` is the history before ``output[j]`` (the prompt and ``output[:j]``).
    ``earlier``: output tokens sampled before ``output`` (the rows of one output, a chunk at a time)."""
    device = output.device
    prompt_t = torch.as_tensor(prompt, dtype=torch.long, device=device)
    in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
    in_prompt[prompt_t] = True
    one_hot = torch.zeros(len(output), vocab, dtype=torch.int32, device=device)
    one_hot[torch.arange(len(output), device=device), output] = 1
    counts = one_hot.cumsum(dim=0) - one_hot  # tokens strictly before each position
    if earlier is not None and len(earlier):
        counts += torch.bincount(earlier, minlength=vocab).to(torch.int32)[None, :]
    return in_prompt[None, :] | (counts > 0), counts
