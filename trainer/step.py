"""One optimizer step over a batch of scored trajectories: micro-batching, token log-probabilities,
the clipped importance-sampled loss accumulated over micro-batches, clipping and the update.

The step's loss is a token mean over the whole step (every micro-batch divides by the step's
trainable-token count), so gradient accumulation equals one pass over the whole batch. Under
torchrun every rank calls :func:`train_step` with the whole batch and trains its share
(trainer/distributed.py has the rules); ``train()`` (trainer/train.py) and the distributed
selftest (trainer/selftest.py) are its callers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from statistics import fmean
from typing import Any

import torch

from flywheel.events import ScoredTrajectory
from flywheel.logprobs import history, processed_logprobs
from flywheel.settings import TrainerSettings
from trainer.buffer import ProcessedTurn, behaviour_version, collate, sample_tokens
from trainer.distributed import SINGLE, Dist, placeholder_batch
from trainer.loss import policy_loss, turn_values

MAX_GRAD_NORM = 1.0


def micro_batches(samples: list[ScoredTrajectory], budget: int) -> list[list[int]]:
    """Consecutive groups of sample indices whose padded size (rows x longest row) stays within
    ``budget`` tokens; a sample larger than the budget goes alone."""
    groups: list[list[int]] = []
    rows = longest = 0
    for i, sample in enumerate(samples):
        segments = [len(s.tokens) for s in sample.segments if s.tokens]
        n, top = len(segments), max(segments, default=0)
        if groups and (rows + n) * max(longest, top) <= budget:
            groups[-1].append(i)
            rows, longest = rows + n, max(longest, top)
        else:
            groups.append([i])
            rows, longest = n, top
    return groups


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, attention: torch.Tensor,
                   processed: Sequence[ProcessedTurn] = ()) -> torch.Tensor:
    """``[B, T]``: position ``t`` is ``log p(tokens[:, t] | tokens[:, :t])``; position 0 (no context) is 0.

    ``p`` is the model's own distribution, except on the ``processed`` turns ``(row, start, end,
    processing)``: there it is the processed distribution the engine sampled from
    (``flywheel.sampling.processed_logprobs``, with the row's tokens before each position as the
    penalties' history), so the importance ratio compares like with like. A token that the
    processing drops under these weights gets ``-inf``."""
    logits = model(input_ids=tokens, attention_mask=attention).logits.float()  # [B, T, V]
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    for row, start, end, processing in processed:
        sampled = tokens[row, start:end]
        seen = counts = None
        if processing.penalised:
            seen, counts = history(tokens[row, :start], sampled, logits.shape[-1])
        logp = processed_logprobs(logits[row, start - 1 : end - 1], processing, seen=seen, output_counts=counts)
        out[row, start:end] = logp.gather(-1, sampled[:, None]).squeeze(-1)
    return out


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[ScoredTrajectory],
    current_version: int,
    cfg: TrainerSettings,
    *,
    reference: torch.nn.Module | None = None,
    measure_parity: bool = False,
    dist: Dist = SINGLE,
) -> dict[str, Any]:
    """One optimizer step on ``samples`` (micro-batched by ``cfg.micro_batch_tokens``, gradients
    accumulated, the loss a token mean over the whole step); returns its metrics: loss terms,
    ``staleness`` (samples by versions behind ``current_version``) and, when asked and measurable,
    ``parity``/``parity_p99``/``parity_max`` over the on-policy trainable tokens.

    Under torchrun every rank calls it with the whole batch and trains its share
    (trainer/distributed.py has the rules: placeholder passes, the global token count, the
    gradient scale); the result equals one process's up to the order of the sums."""
    values = turn_values(samples)  # on the whole batch: legacy baselines are batch-relative
    # collate() credits each turn ``turn_rewards[i] - baseline``: hand it the advantages that way.
    adjusted = [s.model_copy(update={"turn_rewards": v}) for s, (v, _) in zip(samples, values)]
    baselines = [baseline for _, baseline in values]
    mine = dist.shard(range(len(samples)), cost=lambda i: sample_tokens(samples[i]))
    local = [adjusted[i] for i in mine]
    batches = [(idx, collate([local[i] for i in idx], [baselines[mine[i]] for i in idx]))
               for idx in micro_batches(local, cfg.micro_batch_tokens)]
    batches += [([], placeholder_batch())] * (dist.all_reduce_max(len(batches)) - len(batches))
    step_tokens = dist.all_reduce_sum(sum(int((b.mask > 0).sum()) for _, b in batches))

    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "clip_frac": 0.0, "trunc_frac": 0.0, "mean_ratio": 0.0, "mean_abs_log_ratio": 0.0, "kl": 0.0}
    parity: list[float] = []
    completion_tokens, masked = 0, Counter[str]()
    for idx, batch in batches:
        batch = batch.to(dist.device)
        completion_tokens += batch.completion_tokens
        masked.update(batch.masked)
        with dist.autocast():
            logp_new = token_logprobs(model, batch.tokens, batch.attention, batch.processed)
            logp_ref = None
            if reference is not None and cfg.kl_coef > 0:
                with torch.no_grad():  # the reference under the same processing: the KL compares like with like
                    logp_ref = token_logprobs(reference, batch.tokens, batch.attention, batch.processed)
                # A token outside the reference's processed support adds no KL estimate (d = 0).
                logp_ref = torch.where(torch.isfinite(logp_ref), logp_ref, logp_new.detach())
        # A token the processing drops under the current weights (the behaviour kept it) has
        # probability 0 under the policy: ratio 0, no gradient; it is left out and counted.
        outside = (batch.mask > 0) & ~torch.isfinite(logp_new.detach())
        if bool(outside.any()):
            masked["outside_support"] += int(outside.sum())
            batch = replace(batch, mask=batch.mask.masked_fill(outside, 0.0))
        out = policy_loss(logp_new, batch.logp_behaviour, batch.advantages, batch.mask, cfg.clip_eps,
                          cfg.is_truncation, normalizer=step_tokens, logp_ref=logp_ref, kl_coef=cfg.kl_coef)
        (out.loss * dist.grad_scale).backward()
        sums["loss"] += float(out.loss.detach())
        for key in ("clip_frac", "trunc_frac", "mean_ratio", "mean_abs_log_ratio", "kl"):
            sums[key] += getattr(out, key) * out.tokens
        if measure_parity and idx:
            on_policy = torch.tensor([behaviour_version(local[idx[i]]) == current_version
                                      for i in batch.row_sample.tolist()], device=dist.device)
            keep = (batch.mask > 0) & on_policy[:, None]
            parity += (logp_new.detach() - batch.logp_behaviour)[keep].abs().tolist()
    grad_norm = dist.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)
    optimizer.step()

    metrics: dict[str, Any] = {"loss": dist.all_reduce_sum(sums.pop("loss"))}
    metrics.update({key: dist.all_reduce_sum(value) / max(step_tokens, 1) for key, value in sums.items()})
    # Tokens trained on: the step's trainable tokens less those found outside the policy's support.
    trained = step_tokens - dist.all_reduce_sum(masked.get("outside_support", 0))
    metrics.update(grad_norm=grad_norm, tokens=float(trained), samples=float(len(samples)),
                   mean_reward=fmean(s.total_reward for s in samples),
                   completion_tokens=float(dist.all_reduce_sum(completion_tokens)),
                   masked=dict(sorted(sum((Counter(part) for part in dist.all_gather_object(dict(masked))),
                                          Counter()).items())))
    metrics["staleness"] = dict(Counter(str(current_version - behaviour_version(s)) for s in samples))  # type: ignore[operator]
    if measure_parity:
        diffs = torch.tensor([d for part in dist.all_gather_object(parity) for d in part])
        if diffs.numel():
            metrics.update(parity=float(diffs.mean()), parity_p99=float(torch.quantile(diffs, 0.99)),
                           parity_max=float(diffs.max()))
    return metrics
