"""One optimizer step over a batch of scored trajectories: micro-batches (packed, trainer/batch.py),
token log-probabilities (trainer/head.py), the clipped importance-sampled loss accumulated over
micro-batches, clipping and the update.

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
from flywheel.settings import TrainerSettings
from trainer.batch import collate, micro_batches, sample_tokens
from trainer.buffer import behaviour_version
from trainer.distributed import SINGLE, Dist, placeholder_batch
from trainer.head import token_logprobs
from trainer.loss import policy_loss, turn_values

MAX_GRAD_NORM = 1.0


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
    ``staleness`` (samples by versions behind ``current_version``) and, when asked, parity:
    ``parity_by_version`` (behaviour version as a string -> ``parity``/``parity_p99``/``parity_max``
    over its samples' trainable tokens) and those three at top level for ``current_version``'s
    samples, when there are any. (A loop that publishes in the background may not know yet which
    version the master equals: it picks that version's entry once the publish has said.)

    Under torchrun every rank calls it with the whole batch and trains its share
    (trainer/distributed.py has the rules: placeholder passes, the global token count, the
    gradient scale); the result equals one process's up to the order of the sums."""
    values = turn_values(samples)  # on the whole batch: legacy baselines are batch-relative
    # collate() credits each turn ``turn_rewards[i] - baseline``: hand it the advantages that way.
    adjusted = [s.model_copy(update={"turn_rewards": v}) for s, (v, _) in zip(samples, values)]
    baselines = [baseline for _, baseline in values]
    mine = dist.shard(range(len(samples)), cost=lambda i: sample_tokens(samples[i]))
    local = [adjusted[i] for i in mine]
    batches = [(idx, collate([local[i] for i in idx], [baselines[mine[i]] for i in idx], packed=cfg.packing))
               for idx in micro_batches(local, cfg.micro_batch_tokens, packed=cfg.packing)]
    batches += [([], placeholder_batch())] * (dist.all_reduce_max(len(batches)) - len(batches))
    step_tokens = dist.all_reduce_sum(sum(int((b.mask > 0).sum()) for _, b in batches))

    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "clip_frac": 0.0, "trunc_frac": 0.0, "mean_ratio": 0.0, "mean_abs_log_ratio": 0.0, "kl": 0.0}
    parity: dict[int, list[float]] = {}  # behaviour version -> |logp_new - logp_served| per trainable token
    completion_tokens, masked = 0, Counter[str]()
    for idx, batch in batches:
        batch = batch.to(dist.device)
        completion_tokens += batch.completion_tokens
        masked.update(batch.masked)
        with dist.autocast():
            logp_new = token_logprobs(model, batch, cfg.logprob_chunk_tokens)
            logp_ref = None
            if reference is not None and cfg.kl_coef > 0:
                with torch.no_grad():  # the reference under the same processing: the KL compares like with like
                    logp_ref = token_logprobs(reference, batch, cfg.logprob_chunk_tokens)
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
            trained = batch.mask > 0
            diffs, owners = (logp_new.detach() - batch.logp_behaviour).abs()[trained], batch.sample_index[trained]
            for i in owners.unique().tolist():
                version = behaviour_version(local[idx[i]])
                if version is not None:
                    parity.setdefault(version, []).extend(diffs[owners == i].tolist())
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
        gathered: dict[int, list[float]] = {}
        for part in dist.all_gather_object(parity):
            for version, values in part.items():
                gathered.setdefault(version, []).extend(values)
        by_version = {str(v): parity_stats(d) for v, d in sorted(gathered.items()) if d}
        metrics["parity_by_version"] = by_version
        metrics.update(by_version.get(str(current_version), {}))
    return metrics


def parity_stats(diffs: Sequence[float]) -> dict[str, float]:
    """``parity`` (mean), ``parity_p99`` and ``parity_max`` of absolute logprob differences."""
    t = torch.tensor(diffs, dtype=torch.float64)
    return {"parity": float(t.mean()), "parity_p99": float(torch.quantile(t, 0.99)), "parity_max": float(t.max())}
