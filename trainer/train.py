"""The trainer recipe: scored trajectories in, published model versions out, continuously.

``train(settings, stop)`` reads top to bottom: setup (resume from the newest checkpoint) ->
loop (consume -> buffer -> step) -> every ``trainer.steps_per_version`` steps: checkpoint ->
publish -> commit offsets -> cleanup.

- Durability (``trainer.checkpoint``, whose docstring walks through every crash window): the
  checkpoint written before each publish holds the fp32 master, Adam moments, LR schedule, step,
  buffer, de-dup memories and offsets, and a token that the version published from it carries.
  A restart restores it exactly, adopts the version carrying its token (or publishes it if the
  crash came first) and skips redelivered records whose fate it already holds: after ``kill -9``
  no sample is lost or trained into two versions and no version number is reused. Each version's
  metrics list the ``trajectory_ids`` trained into it.
- Without a checkpoint, training starts from the newest published version of the model line,
  whatever its status; an empty registry is seeded with the base model as a full version (by the
  node or ``flywheel up``). Master weights are fp32; versions are the bf16 export
  (``tinymodel.export_state``), published as a delta against the previous version when that is
  smaller.
- Off-policy data is explicit: every sample carries its behaviour versions, the buffer drops (and
  counts) samples more than ``trainer.max_staleness`` versions old, and the loss corrects for the
  rest with a clipped, truncated importance ratio against the served logprobs (``trainer.loss``).
- Advantages come from the rewards stage: each sample's per-turn ``turn_advantages`` (group-relative
  per prompt, else against running statistics per tenant and model line; rewards/normalise.py).
  Samples without them (older payloads) fall back to baselines that are group-relative per
  ``prompt_key`` when the batch holds two or more samples of one prompt, else the batch mean
  (``trainer.loss.turn_values``).
- Offsets are committed only when a version is published (after its checkpoint), and only the
  prefix of records that are done, so a crash never skips a buffered sample.
- Parity (reported with each version): mean ``|logp_train - logp_served|`` over trainable tokens of
  samples served by the version being trained, measured on the first step after that version was
  loaded or published, where the fp32 master still equals it (up to bf16 rounding, itself part of
  the train/inference mismatch this measures); later steps have moved the master away.
- Position ``t`` of ``logp_new`` is ``log p(token t | tokens < t)`` at temperature 1, which is what
  the served logprobs are when the engine samples at temperature 1 and top_p 1; turns sampled
  otherwise (each turn records its sampling) are masked out of the loss (``trainer.buffer``).
"""

from __future__ import annotations

import logging
import secrets
import threading
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from flywheel.bus import make_bus
from flywheel.db.session import make_session_factory, open_database
from flywheel.events import ScoredTrajectory
from flywheel.settings import Settings, TrainerSettings
from flywheel.tinymodel.build import ensure_default_model
from flywheel.tinymodel.sampling import export_state, load_model, load_state
from flywheel.weights.codec import state_sha256
from flywheel.weights.registry import Registry, State, VersionInfo
from flywheel.weights.store import make_store
from trainer import checkpoint
from trainer.buffer import OffsetTracker, SampleBuffer, behaviour_version, collate
from trainer.loss import policy_loss, turn_values

log = logging.getLogger("flywheel.trainer")

POLL_TIMEOUT_S = 0.5
MAX_RECORDS = 200
MAX_GRAD_NORM = 1.0


def train(settings: Settings, stop: threading.Event | None = None) -> None:
    """Train until ``stop`` is set (see the module docstring)."""
    stop = stop or threading.Event()
    cfg = settings.trainer

    # --- setup -----------------------------------------------------------------------------------
    torch.set_num_threads(settings.torch_threads)
    engine = open_database(settings.database_url, settings.db.wait_s)
    registry = Registry(make_session_factory(engine), make_store(settings), settings.model.line, full_every=cfg.full_every)
    torch.manual_seed(cfg.seed)
    model_path = Path(settings.model.path) if settings.model.path else ensure_default_model(settings.data_path / "models")
    model, _tokenizer = load_model(model_path)  # fp32 master; eval: no dropout, the function the engine served
    vocab_size = model.get_input_embeddings().num_embeddings
    ckpt_dir = checkpoint.checkpoint_dir(settings)
    resumed = checkpoint.load_latest(ckpt_dir, settings.model.line)
    if resumed is None:
        latest = registry.latest()
        while latest is None:  # the node (or `flywheel up`) registers the base model as version 0
            log.info("waiting for a first version of %s in the registry", settings.model.line)
            if stop.wait(2.0):
                engine.dispose()
                return
            latest = registry.latest()
        current, step = latest.version, latest.train_step or 0
        published = registry.load(current)  # the bf16 weights of the version being trained
        load_state(model, published)
    else:
        load_state(model, resumed.model)
        step = resumed.step
    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # Adam's first steps move every weight by a full lr (its moment estimates are fresh), which
    # would flip most bf16 elements at once; a linear warm-up keeps the first deltas small too.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / cfg.warmup_steps))
    buffer = SampleBuffer(cfg.max_staleness)
    offsets = OffsetTracker()
    if resumed is not None:
        optimizer.load_state_dict(resumed.optimizer)
        scheduler.load_state_dict(resumed.scheduler)
        buffer.load_state_dict(resumed.buffer)
        offsets.load_state_dict(resumed.offsets)
        info = checkpoint.find_published(registry, resumed)
        if info is None:  # the crash came between checkpoint and publish: publish it now
            info = publish(registry, model, resumed, registry.load(resumed.parent))
        elif info.sha256 != state_sha256(export_state(model)):
            raise checkpoint.CheckpointError(f"v{info.version} carries the checkpoint's token but not its weights")
        current, published = info.version, export_state(model)
        log.info("resumed from checkpoint at step %d as v%d (%d samples buffered)", step, current, len(buffer))
    window: list[dict[str, float]] = []  # per-step metrics since the last published version
    trained_ids: list[str] = []  # trajectories trained since the last published version

    bus = make_bus(settings)
    topic = settings.topic("scored")
    bus.ensure_topics([topic])
    consumer = bus.consumer(settings.group("trainer"), [topic])
    log.info("training %s from v%d (step %d), lr=%g, batch %d", settings.model.line, current, step, cfg.lr, cfg.batch_size)

    # --- loop ------------------------------------------------------------------------------------
    try:
        while not stop.is_set():
            for record in consumer.poll(timeout_s=POLL_TIMEOUT_S, max_records=MAX_RECORDS):
                if not offsets.track(record):
                    continue  # redelivered after a restart; the checkpoint holds its fate
                try:
                    sample = ScoredTrajectory.from_bytes(record.value)
                except ValueError as exc:
                    consumer.dead_letter(record, f"undecodable ScoredTrajectory: {exc}"[:1000])
                    offsets.done(record)
                    continue
                if (problem := untrainable(sample, settings.model.line, vocab_size)) is not None:
                    consumer.dead_letter(record, problem)
                    offsets.done(record)
                    continue
                if buffer.add(sample, record, current) is not None:
                    offsets.done(record)
            for entry in buffer.purge_stale(current):
                offsets.done(entry.record)

            while not stop.is_set() and (batch := buffer.take(cfg.batch_size)):
                samples = [e.sample for e in batch]
                window.append(train_step(model, optimizer, samples, current, cfg, measure_parity=not window))
                scheduler.step()
                step += 1
                trained_ids += [s.trajectory_id for s in samples]
                for entry in batch:
                    offsets.done(entry.record)
                if step % cfg.steps_per_version:
                    continue
                # --- checkpoint -> publish -> commit (crash windows: trainer.checkpoint) ---------
                done = offsets.committable()
                ckpt = checkpoint.Checkpoint(
                    model_line=settings.model.line, step=step, parent=current,
                    parent_sha256=registry.get(current).sha256, publish_token=secrets.token_hex(16),
                    metrics={**summarise(window, buffer.counters()), "trajectory_ids": trained_ids},
                    model=master_state(model), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                    buffer=buffer.state_dict(), offsets=offsets.state_dict(),
                )
                checkpoint.save(ckpt_dir, ckpt, keep=cfg.keep_checkpoints)
                info = publish(registry, model, ckpt, published)
                current, published, window, trained_ids = info.version, export_state(model), [], []
                if done:
                    consumer.commit(done)
                for entry in buffer.purge_stale(current):
                    offsets.done(entry.record)
    finally:
        # --- cleanup -----------------------------------------------------------------------------
        log.info("trainer stopping at step %d, v%d: %s", step, current, buffer.counters())
        consumer.close()
        bus.close()
        engine.dispose()


def master_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the model's parameters (tied weights once), for the checkpoint."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


def publish(registry: Registry, model: torch.nn.Module, ckpt: checkpoint.Checkpoint, parent_state: State) -> VersionInfo:
    """Publish the model's bf16 export as the version made from ``ckpt`` (its metrics carry the token)."""
    info = registry.publish(
        export_state(model), parent=ckpt.parent, parent_state=parent_state, train_step=ckpt.step,
        metrics={**ckpt.metrics, "publish_token": ckpt.publish_token},
    )
    log.info(
        "published v%d (%s, %d bytes, %.1f%% of full) at step %d: %s",
        info.version, info.kind, info.bytes, 100.0 * info.bytes / max(info.full_bytes, 1), ckpt.step,
        {k: round(v, 4) for k, v in info.metrics.items() if isinstance(v, float)},
    )
    return info


def untrainable(sample: ScoredTrajectory, model_line: str, vocab_size: int) -> str | None:
    """Why this model can never train on ``sample`` (it would fail on every replay), or None."""
    if sample.model_line != model_line:
        return f"sample is for model line {sample.model_line!r}, this trainer trains {model_line!r}"
    top = max((max(s.tokens) for s in sample.segments if s.tokens), default=-1)
    if top >= vocab_size:
        return f"token id {top} is outside the vocabulary of {vocab_size}"
    return None


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[ScoredTrajectory],
    current_version: int,
    cfg: TrainerSettings,
    *,
    measure_parity: bool = False,
) -> dict[str, float]:
    """One optimizer step on ``samples``; returns its metrics (``parity`` when asked and measurable)."""
    values = turn_values(samples)
    # collate() credits each turn ``turn_rewards[i] - baseline``: hand it the advantages that way.
    batch = collate([s.model_copy(update={"turn_rewards": v}) for s, (v, _) in zip(samples, values)],
                    [baseline for _, baseline in values])
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits.float()  # [B, T, V]
    # logp_new[:, t] = log p(tokens[:, t] | tokens[:, :t]); position 0 has no context (never trainable).
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    logp_new = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # [B, T]
    out = policy_loss(logp_new, batch.logp_behaviour, batch.advantages, batch.mask, cfg.clip_eps, cfg.is_truncation)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
    optimizer.step()

    metrics = {
        "loss": float(out.loss.detach()),
        "mean_reward": fmean(s.total_reward for s in samples),
        "clip_frac": out.clip_frac,
        "trunc_frac": out.trunc_frac,
        "mean_ratio": out.mean_ratio,
        "grad_norm": grad_norm,
        "mean_abs_log_ratio": out.mean_abs_log_ratio,
        "tokens": float(out.tokens),
        "samples": float(len(samples)),
    }
    if not measure_parity:
        return metrics
    on_policy = torch.tensor([behaviour_version(samples[i]) == current_version for i in batch.row_sample.tolist()])
    parity_mask = batch.mask * on_policy[:, None].float()
    if parity_mask.sum() > 0:
        diff = (logp_new.detach() - batch.logp_behaviour).abs() * parity_mask
        metrics["parity"] = float(diff.sum() / parity_mask.sum())
    return metrics


def summarise(window: list[dict[str, float]], counters: dict[str, int]) -> dict[str, Any]:
    """The metrics recorded with a version: step means (sums for counts) plus the buffer counters."""
    out: dict[str, Any] = {}
    for key in ("loss", "mean_reward", "clip_frac", "trunc_frac", "mean_ratio", "mean_abs_log_ratio", "grad_norm", "parity"):
        values = [m[key] for m in window if key in m]
        if values:
            out[key] = fmean(values)
    out["samples"] = int(sum(m["samples"] for m in window))
    out["tokens"] = int(sum(m["tokens"] for m in window))
    out["steps"] = len(window)
    out.update(counters)
    return out
