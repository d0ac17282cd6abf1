"""Advantages and the policy-gradient loss: pure tensor maths, no model, no IO.

Shapes: ``B`` rows (one row per segment of a trajectory), ``T`` positions (padded). Position ``t``
of every ``[B, T]`` tensor refers to token ``t`` of the row; ``mask`` is 1.0 on trainable tokens
(completion tokens of real turns) and 0.0 on prompts and padding.

The objective (per trainable token, ``A`` its advantage, ``r = exp(logp_new - logp_behaviour)``
the importance ratio between the policy being trained and the version that served the token)::

    surrogate = min(r * A, clip(r, 1 - eps, 1 + eps) * A)           # PPO-clip, against behaviour
    gradient  = min(r, cap) * A * grad(logp_new)  where the min picks the unclipped branch,
                0                                  where it picks the clipped branch
    loss      = -sum(mask * surrogate) / N  +  kl_coef * sum(mask * k3) / N

``N`` is the number of trainable tokens of the whole optimizer step (``normalizer``): a step split
into micro-batches (gradient accumulation) or across ranks sums to exactly the loss and gradient of
the step computed at once. ``k3 = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1`` is the
non-negative, unbiased-in-expectation estimator of KL(policy || reference) per sampled token
(:func:`kl_k3`), the optional pull towards a frozen reference model.

i.e. PPO-clip whose importance weight is truncated at ``cap`` (truncated importance sampling,
the weight detached). Without the truncation, a negative-advantage token whose ratio has grown far
above ``1 + eps`` keeps the unbounded gradient ``r * A`` (the min selects ``r * A`` there); the
cap bounds it by ``cap * |A|``, so stale or mismatched tokens cannot dominate a step. Where
``r <= cap`` the gradient is exactly PPO's. The reported loss value equals the PPO surrogate
except on truncated tokens, where it is ``cap * A``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flywheel.events import ScoredTrajectory, Segment


def group_baselines(samples: Sequence[tuple[str | None, Sequence[float]]]) -> list[float]:
    """One baseline per sample of a batch, given ``(prompt_key, turn_rewards)`` pairs.

    Samples sharing a prompt key with at least one other sample of the batch get their group's mean
    turn reward (group-relative, as in GRPO); the others get the mean turn reward of the whole batch.
    Turn rewards rather than totals, so multi-turn samples are compared with single-turn ones on the
    scale their tokens are credited on.
    """
    all_rewards = [r for _, rewards in samples for r in rewards]
    batch_mean = sum(all_rewards) / len(all_rewards) if all_rewards else 0.0
    groups: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for key, rewards in samples:
        if key is not None:
            groups.setdefault(key, []).extend(rewards)
            counts[key] = counts.get(key, 0) + 1
    out = []
    for key, _ in samples:
        if key is not None and counts[key] >= 2 and groups[key]:
            out.append(sum(groups[key]) / len(groups[key]))
        else:
            out.append(batch_mean)
    return out


def turn_values(samples: Sequence[ScoredTrajectory]) -> list[tuple[list[float], float]]:
    """Per sample, ``(per-turn values, baseline)`` whose difference is each turn's advantage.

    A sample carrying ``turn_advantages`` (the rewards stage normalised it: group-relative per
    prompt or against running statistics, see rewards/normalise.py) gives them with baseline 0.
    The others (payloads from before the stage provided advantages) fall back to their turn
    rewards and :func:`group_baselines` computed among themselves.
    """
    legacy = [i for i, s in enumerate(samples) if s.turn_advantages is None]
    baselines = dict(zip(legacy, group_baselines([(samples[i].prompt_key, samples[i].turn_rewards) for i in legacy])))
    return [
        (list(s.turn_rewards), baselines[i]) if s.turn_advantages is None else (list(s.turn_advantages), 0.0)
        for i, s in enumerate(samples)
    ]


def token_advantages(turn_rewards: Sequence[float], segments: Sequence[Segment], baseline: float) -> list[torch.Tensor]:
    """Per-token advantages, one float32 tensor ``[len(segment.tokens)]`` per segment.

    Turn ``i`` (in turn order across segments) gives its completion tokens ``turn_rewards[i] -
    baseline``; every other position is 0.
    """
    turns = [turn for segment in segments for turn in segment.turns]
    if len(turns) != len(turn_rewards):
        raise ValueError(f"{len(turn_rewards)} turn rewards for {len(turns)} turns")
    out: list[torch.Tensor] = []
    i = 0
    for segment in segments:
        adv = torch.zeros(len(segment.tokens), dtype=torch.float32)
        for turn in segment.turns:
            adv[turn.start : turn.end] = float(turn_rewards[i]) - baseline
            i += 1
        out.append(adv)
    return out


@dataclass(frozen=True)
class LossOutput:
    #: Scalar to minimise (carries the gradient).
    loss: torch.Tensor
    #: Fraction of trainable tokens where the clipped branch was selected (no gradient).
    clip_frac: float
    #: Fraction of trainable tokens whose ratio exceeded the truncation cap.
    trunc_frac: float
    #: Mean importance ratio over trainable tokens.
    mean_ratio: float
    #: Mean ``|logp_new - logp_behaviour|`` over trainable tokens (train/serve mismatch + staleness).
    mean_abs_log_ratio: float
    #: Number of trainable tokens.
    tokens: int
    #: Mean ``k3`` KL estimate against the reference over trainable tokens (0.0 without one).
    kl: float = 0.0


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token ``k3`` estimate of KL(policy || reference) at the sampled tokens: ``exp(d) - d - 1``
    with ``d = logp_ref - logp_new``; >= 0, 0 where the two agree, gradient towards the reference."""
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1.0


def policy_loss(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    is_cap: float,
    *,
    normalizer: float | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossOutput:
    """Clipped, truncated-IS policy-gradient loss, plus ``kl_coef`` x KL to ``logp_ref`` when given
    (module docstring). All inputs ``[B, T]``; only ``logp_new`` needs a gradient. ``normalizer``:
    the step's trainable token count (default: this batch's). No trainable tokens: a zero loss."""
    if not (logp_new.shape == logp_behaviour.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"shape mismatch: {tuple(logp_new.shape)} {tuple(logp_behaviour.shape)} "
            f"{tuple(advantages.shape)} {tuple(mask.shape)}"
        )
    on = mask > 0
    mask = on.to(logp_new.dtype)
    # Zero every input off the mask, so junk on padding (even -inf) never reaches a value or a gradient.
    zero = torch.zeros((), dtype=logp_new.dtype, device=logp_new.device)
    logp_new = torch.where(on, logp_new, zero)
    logp_behaviour = torch.where(on, logp_behaviour.to(logp_new.dtype), zero)
    advantages = torch.where(on, advantages.to(logp_new.dtype), zero)
    log_ratio = logp_new - logp_behaviour
    ratio = torch.exp(log_ratio)
    ratio_d = ratio.detach()
    clipped_ratio = ratio_d.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    # The min of PPO picks the clipped branch when it is strictly smaller.
    clipped = (clipped_ratio * advantages) < (ratio_d * advantages)
    weight = ratio_d.clamp(max=is_cap)
    # Value: weight * A; gradient: weight * A * grad(logp_new) (exp(x - x.detach()) is 1 with grad 1).
    unclipped_term = weight * torch.exp(logp_new - logp_new.detach()) * advantages
    surrogate = torch.where(clipped, clipped_ratio * advantages, unclipped_term)
    denominator = mask.sum().clamp(min=1.0) if normalizer is None else max(float(normalizer), 1.0)
    loss = -(surrogate * mask).sum() / denominator
    kl_mean = 0.0
    if logp_ref is not None and kl_coef > 0:
        if logp_ref.shape != logp_new.shape:
            raise ValueError(f"shape mismatch: reference {tuple(logp_ref.shape)}, policy {tuple(logp_new.shape)}")
        kl = kl_k3(logp_new, torch.where(on, logp_ref.to(logp_new.dtype), zero)) * mask
        loss = loss + kl_coef * kl.sum() / denominator
        kl_mean = float(kl.detach().sum().item()) / max(int(on.sum().item()), 1)
    with torch.no_grad():
        count = int(on.sum().item())
        safe = max(count, 1)
        clip_frac = float((clipped & on).sum().item()) / safe
        trunc_frac = float(((ratio_d > is_cap) & on).sum().item()) / safe
        mean_ratio = float((ratio_d * mask).sum().item()) / safe
        mean_abs = float((log_ratio.abs()).sum().item()) / safe
    return LossOutput(
        loss=loss,
        clip_frac=clip_frac,
        trunc_frac=trunc_frac,
        mean_ratio=mean_ratio,
        mean_abs_log_ratio=mean_abs,
        tokens=count,
        kl=kl_mean,
    )
