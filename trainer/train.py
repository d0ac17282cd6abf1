"""The trainer recipe: scored trajectories in, published model versions out, continuously.

``train(settings, stop)`` reads top to bottom: setup (resume from the newest checkpoint) ->
loop (consume -> buffer -> step) -> every ``trainer.steps_per_version`` steps, or once
``trainer.publish_every_s`` passed since the last version, a publish point: checkpoint -> publish
-> commit offsets -> cleanup.

- Sharded (``trainer.sharded_versions``, the default under torchrun with FSDP2 and full-parameter
  training): no rank gathers the model or the Adam state. At a publish point every rank writes its
  own shards into the checkpoint (``checkpoint.save_sharded``, torch DCP) and codes, uploads and
  checks its own shard of the version (trainer/shard_publish.py); rank 0 writes the checkpoint file
  and the manifest. Inline, at the cut: the ranks' collectives cannot run beside training's. Nor
  does any rank read the whole model to start: every rank builds it without weights, and reads its
  own rows of what it starts from (``Dist.wrap``): the version rank 0 rebuilt into a file tensor by
  tensor (``flywheel.weights.files.rebuild_file``), or its own shards of a sharded checkpoint.
  In one process with ``trainer.publish_in_background`` off, the same path is the bounded-memory
  way to publish: the checkpoint (DCP, no process group) and the version (one shard) are written
  from the live model tensor by tensor, the previous version's shard is a file, and the start
  reads the version from a file: no copy of the master, the Adam state or an export, and no
  parent state, is ever held whole.
- Otherwise publishing runs off the critical path (``trainer.publish_in_background``, trainer/publisher.py).
  At the cut the loop gathers the full fp32 master and Adam state (a collective under torchrun:
  every rank, synchronously), takes the bf16 export (from rank 0's replica under torchrun), keeps
  snapshots that later steps cannot change, and hands them to the publisher; a worker thread
  writes the checkpoint and publishes while the next steps train. The loop polls it every turn
  and, once the version exists, makes it ``current``, commits the offsets that were committable at
  the cut (the consumer is not thread-safe: only the loop touches it) and purges stale samples. At
  most one point is pending: the next cut first waits for it, since its version is the next
  checkpoint's parent. So ``current`` (the version given to ``buffer.add``, ``purge_stale`` and
  the ``staleness`` metric) lags the master by at most that one pending publish: a sample may
  count as one version less stale than it is, for a few steps. Off: the same work inline, at the
  cut. A failure in the worker is re-raised in the loop and ends the trainer as before; on stop the
  loop waits for the pending point and commits it.

- Modes: ``async`` (the product setting) trains on whatever arrives within ``max_staleness``
  versions; ``sync`` (for comparison, bench/trainer.py) only on samples served by the version being
  trained, so after each publish it waits for the fleet to serve the new version and for that
  traffic to be scored. Full-parameter or LoRA (trainer/policy.py: a LoRA version is the merged
  weights, or with ``trainer.lora_publish = "adapter"`` the adapter state on the fixed base
  ``model.path``).
- A step takes the oldest ``batch_size`` samples (or fewer, within ``batch_tokens``), runs them in
  micro-batches of at most ``micro_batch_tokens`` tokens, each packed into one row without padding
  (trainer/batch.py), and accumulates their gradients; the loss is a token mean over the whole
  step, so the split never changes the result. Log-probabilities are computed only where trained,
  the lm-head in chunks (trainer/head.py); blocks may be checkpointed or compiled
  (trainer/compute.py). An optional KL term (``kl_coef``) pulls towards the frozen model the line
  started from.

- Durability (``trainer.checkpoint``, whose docstring walks through every crash window): the
  checkpoint written before each publish holds the fp32 master, Adam moments, LR schedule, step,
  buffer, de-dup memories and offsets, and a token that the version published from it carries.
  A restart restores it exactly, adopts the version carrying its token (or publishes it if the
  crash came first) and skips redelivered records whose fate it already holds: after ``kill -9``
  no sample is lost or trained into two versions and no version number is reused. Each version's
  metrics list the ``trajectory_ids`` trained into it.
- Without a checkpoint, training starts from the newest published version of the model line,
  whatever its status; an empty registry is seeded with the base model as a full version (by the
  node or ``flywheel up``), or for an adapter line with the zero adapter (by the trainer itself or
  a LoRA-mode vLLM node). Master weights are fp32; versions are the bf16 export
  (``flywheel.lm.export_state``), published as a delta against the previous version when that is
  smaller.
- Off-policy data is explicit: every sample carries its behaviour versions, the buffer drops (and
  counts) samples more than ``trainer.max_staleness`` versions old, and the loss corrects for the
  rest with a clipped, truncated importance ratio against the served logprobs (``trainer.loss``).
- Advantages come from the rewards stage: each sample's per-turn ``turn_advantages`` (group-relative
  per prompt, else against running statistics per tenant and model line; rewards/normalise.py).
  Samples without them (older payloads) fall back to baselines that are group-relative per
  ``prompt_key`` when the batch holds two or more samples of one prompt, else the batch mean
  (``trainer.loss.turn_values``).
- Erased subjects (flywheel/tombstones.py): a sample of a tombstoned session is dropped when it
  arrives and, when a tombstone is new to the trainer, taken out of the buffer (``dropped_erased``),
  so no later step trains on it and no later checkpoint holds it; the tombstones are re-read at
  most every second, before the buffer is used.
- Offsets are committed only when a version is published (after its checkpoint), and only the
  prefix of records that were done when its point was cut, so a crash never skips a buffered sample.
- Metrics of each version: the step means of the loss terms, the buffer's counters (drops by
  reason), ``staleness`` (trained samples by versions behind), and parity: mean, p99 and max of
  ``|logp_train - logp_served|`` over trainable tokens of samples served by the version being
  trained (a rollout gate: serving/rollout.py), measured on the first step after that version was
  loaded or cut, where the fp32 master still equals it (up to bf16 rounding, itself part of the
  train/inference mismatch this measures); later steps have moved the master away. That step may
  run before a background publish has said the version's number, so it measures every served
  version (``parity_by_version``) and ``summarise`` picks the entry of the window's starting
  version (the new version's parent) when the next point is cut.
- Position ``t`` of ``logp_new`` is ``log p(token t | tokens < t)`` under the distribution the
  turn was sampled from: each turn records its sampling (temperature, top-p, top-k, min-p,
  penalties, logit bias), and the trainer recomputes that processed distribution
  (``flywheel.sampling``, ``trainer.step.token_logprobs``), so the ratio and the parity are exact
  whatever the product's settings. Greedy turns and turns sampled with a knob it cannot recompute
  shape rewards but are masked out of the loss; the version's metrics count them by reason
  (``masked_tokens``) beside ``completion_tokens``.
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time
from collections import Counter
from pathlib import Path
from statistics import fmean
from typing import Any

import safetensors.torch
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from flywheel.bus import Record, make_bus
from flywheel.bus.base import route_to_dlq
from flywheel.db.models import ScoredTrajectoryRow
from flywheel.db.session import make_session_factory, open_database
from flywheel.events import ScoredTrajectory
from flywheel.health import Beat
from flywheel.lm import load_weights, skeleton_model
from flywheel.settings import Settings, TrainerSettings
from flywheel.tombstones import Tombstones
from flywheel.weights.codec.tensorfile import weight_files
from flywheel.weights.files import rebuild_file
from flywheel.weights.registry import Registry, State, VersionInfo
from flywheel.weights.store import make_store
from trainer import checkpoint, compute
from trainer.buffer import OffsetTracker, SampleBuffer
from trainer.distributed import Dist
from trainer.policy import Policy
from trainer.publisher import Publisher, Snapshot, publish, snapshot
from trainer.shard_publish import ShardedPublisher
from trainer.step import train_step

log = logging.getLogger("flywheel.trainer")

POLL_TIMEOUT_S = 0.5
#: Under ``ckpt_dir``: the weights every rank of a sharded trainer reads its rows of at start.
START_FILE = "start.safetensors"
MAX_RECORDS = 200


def train(settings: Settings, stop: threading.Event | None = None) -> None:
    """Train until ``stop`` is set (see the module docstring); under torchrun, every rank calls it."""
    stop = stop or threading.Event()
    cfg = settings.trainer
    torch.set_num_threads(settings.torch_threads)
    torch.manual_seed(cfg.seed)
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else cfg.device.replace("auto", "cpu")
    dist = Dist.from_env(device, wrapper=cfg.parallel)
    try:
        _train(settings, stop, dist)
    finally:
        dist.close()


def _train(settings: Settings, stop: threading.Event, dist: Dist) -> None:
    cfg = settings.trainer

    # --- setup: every rank builds the model; rank 0 finds its weights (checkpoint or registry) ----
    model_path = settings.model.local_dir()
    # Under FSDP2 a full-parameter trainer checkpoints and publishes each rank's own shard, and
    # every rank starts from its own rows of the weights; in one process, publishing inline, the
    # same path streams the whole model as one shard (module docstring).
    sharded = cfg.sharded_versions and cfg.lora_rank == 0 and (
        dist.wrapper == "fsdp2" if dist.enabled else not cfg.publish_in_background)
    # fp32 master; eval: no dropout, the function the engine served. Otherwise rank 0's weights
    # are every rank's (Dist.wrap): the others build the model without any and take their shards.
    model = skeleton_model(model_path) if sharded else dist.start_model(model_path)
    reference = _reference(dist, model_path) if cfg.kl_coef > 0 else None
    vocab_size = model.get_input_embeddings().num_embeddings
    policy = Policy(model, cfg)
    engine = registry = resumed = published = start_file = None
    current = step = 0
    # `flywheel health trainer`: rank 0 beats while it waits for a first version and on every turn
    # of the loop; one turn may hold a whole step and a publish point (checkpoint + publish).
    heartbeat = Beat(settings, "trainer")
    ckpt_dir = checkpoint.checkpoint_dir(settings)
    if dist.is_main:
        engine = open_database(settings.database_url, settings.db.wait_s)
        registry = Registry(make_session_factory(engine), make_store(settings), settings.model.line, full_every=cfg.full_every)
        resumed = checkpoint.load_latest(ckpt_dir, settings.model.line)
        if resumed is None:
            latest = registry.latest()
            if latest is None and policy.adapter:  # an adapter line starts from the zero adapter (B = 0)
                latest = registry.ensure_base(policy.export(), reason="trainer bootstrap: zero LoRA adapter")
                log.info("registered the zero LoRA adapter as %s v%d", settings.model.line, latest.version)
            while latest is None and not stop.is_set():  # the node (or `flywheel up`) registers version 0
                log.info("waiting for a first version of %s in the registry", settings.model.line)
                heartbeat.beat()
                stop.wait(2.0)
                latest = registry.latest()
            if latest is not None:
                current, step = latest.version, latest.train_step or 0
                if sharded:  # the bf16 weights of the version being trained, for every rank's rows
                    start_file = _start_file(ckpt_dir)
                    rebuild_file(registry, current, start_file)
                else:
                    published = registry.load(current)
                    policy.load_published(published)
        elif not resumed.sharded:  # a sharded checkpoint's weights are loaded once the model is wrapped
            if sharded:  # a gathered checkpoint's, read back by rows as well
                start_file = _start_file(ckpt_dir)
                safetensors.torch.save_file(resumed.model, start_file)
            else:
                policy.load_master(resumed.model)
        if resumed is not None:
            step = resumed.step
        if start_file is None:  # one a crash left behind
            (ckpt_dir / START_FILE).unlink(missing_ok=True)
    start = dist.broadcast_object(
        None if dist.is_main and resumed is None and published is None and start_file is None
        else {"step": step, "scheduler": None if resumed is None else resumed.scheduler,
              "resumed": resumed is not None, "sharded": resumed is not None and bool(resumed.sharded),
              "weights": None if start_file is None else str(start_file)})
    if start is None:  # stopped while waiting for a first version
        heartbeat.close()
        if engine is not None:
            engine.dispose()
        return
    step = start["step"]
    # Rank 0 exports versions from a plain replica (sharded parameters cannot be exported in place),
    # unless each rank publishes its own shard.
    exporter = copy.deepcopy(policy) if dist.enabled and dist.is_main and not sharded else policy
    # Checkpointed/compiled blocks (trainer.compute) on the trained model only, before wrapping.
    weights = [start["weights"]] if start["weights"] else None
    model = dist.wrap(compute.prepare(policy.model, cfg), weights, loaded_later=start["sharded"])
    if weights is not None:
        dist.barrier()  # every rank has read its rows
        if dist.is_main:
            Path(weights[0]).unlink()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    # Adam's first steps move every weight by a full lr (its moment estimates are fresh), which
    # would flip most bf16 elements at once; a linear warm-up keeps the first deltas small too.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / cfg.warmup_steps))
    if start["sharded"]:  # any number of ranks, this one included, reads its slices of the shards
        checkpoint.load_sharded(dist, ckpt_dir, model, optimizer, resumed)
        if not sharded and dist.enabled:  # gathered versions from here on: rank 0's export replica takes them
            master = dist.full_state_dict(model)  # a collective: every rank
            if exporter is not policy:
                exporter.load_master(master)
            del master
    elif start["scheduler"] is not None:
        dist.load_optimizer_state(model, optimizer, resumed.optimizer if resumed is not None else {})
    if start["scheduler"] is not None:
        scheduler.load_state_dict(start["scheduler"])
    shards = None
    if sharded:
        shards = ShardedPublisher(dist, model, make_store(settings), settings.model.line, registry,
                                  workdir=ckpt_dir / "publish-shards")  # on disk, beside the checkpoints
        shards.start(model)  # this rank's shard of the weights held now: the next delta's base
        adopted = _adopt_sharded(dist, shards, model, registry, resumed) if start["resumed"] else None
        published = None  # each rank holds its own shard of the parent instead

    if not dist.is_main:
        _follow(dist, model, optimizer, scheduler, reference, cfg, shards, ckpt_dir)
        return

    # --- rank 0 from here: the buffer, the bus, the registry -------------------------------------
    assert registry is not None and engine is not None
    # Sync mode trains on-policy only: anything not served by the version being trained is stale.
    buffer = SampleBuffer(0 if cfg.mode == "sync" else cfg.max_staleness)
    offsets = OffsetTracker()
    if resumed is not None:
        buffer.load_state_dict(resumed.buffer)
        offsets.load_state_dict(resumed.offsets)
        if shards is not None:
            assert adopted is not None
            info = adopted
        else:
            info = checkpoint.find_published(registry, resumed)
            published = exporter.export()
            if info is None:  # the crash came between checkpoint and publish: publish it now
                info = publish(registry, published, resumed, registry.load(resumed.parent))
            elif not exporter.is_version(published, info.sha256):
                raise checkpoint.CheckpointError(f"v{info.version} carries the checkpoint's token but not its weights")
        current = info.version
        log.info("resumed from checkpoint at step %d as v%d (%d samples buffered)", step, current, len(buffer))
    window: list[dict[str, Any]] = []  # per-step metrics since the last published version
    trained_ids: list[str] = []  # trajectories trained since the last published version
    last_publish = time.monotonic()

    bus = make_bus(settings)
    topics = settings.stage_topics("trainer")
    bus.ensure_topics(topics)
    consumer = bus.consumer(settings.group("trainer"), topics)
    scored_rows = make_session_factory(engine)  # what rewards stored: ``vet``'s provenance check
    tombstones = Tombstones(scored_rows)

    def erased(sample: ScoredTrajectory) -> bool:
        return tombstones.drops_session(sample.tenant, sample.session_id)

    def forget_erased(force: bool = False) -> None:
        """Read the tombstones when due (or ``force``); buffered samples of new ones go."""
        if tombstones.refresh(force=force):
            for entry in buffer.purge_erased(erased):
                offsets.done(entry.record)
    log.info("training %s (%s, %s, %d rank(s) %s on %s%s) from v%d (step %d), lr=%g, batch %d",
             settings.model.line, cfg.mode,
             f"LoRA r={cfg.lora_rank}, {cfg.lora_publish} versions" if policy.lora else "full", dist.world_size,
             dist.wrapper, dist.device, ", sharded versions" if shards else "", current, step, cfg.lr, cfg.batch_size)

    # Sharded points are collectives of every rank: inline, in the loop.
    publisher = Publisher(registry, ckpt_dir, cfg.keep_checkpoints, background=cfg.publish_in_background and shards is None)
    pending: tuple[State, list[Record]] | None = None  # the point being written: its export, its committable offsets
    waited_s = 0.0  # seconds publish points waited for the previous one (submit's waits: publisher.stall_s)

    def settle(info: VersionInfo | None) -> None:
        """The pending point's version exists: it is current; commit what was done at its cut."""
        nonlocal current, published, pending
        if info is None:
            return
        assert pending is not None
        (published, done), pending = pending, None
        current = info.version
        if done:
            consumer.commit(done)
        for entry in buffer.purge_stale(current):
            offsets.done(entry.record)

    def new_checkpoint(master: State, optimizer_state: dict[str, Any]) -> checkpoint.Checkpoint:
        return checkpoint.Checkpoint(
            model_line=settings.model.line, step=step, parent=current,
            parent_sha256=registry.get(current).sha256, publish_token=secrets.token_hex(16),
            metrics={**summarise(window, buffer.counters(), current), "trajectory_ids": trained_ids},
            model=master, optimizer=optimizer_state, scheduler=copy.deepcopy(scheduler.state_dict()),
            buffer=buffer.state_dict(), offsets=offsets.state_dict(),
        )

    def sharded_point() -> None:
        """A publish point where each rank writes and publishes its own shard: checkpoint -> publish
        -> commit, inline (collectives of every rank; crash windows: trainer.checkpoint)."""
        nonlocal pending, window, trained_ids, last_publish, waited_s
        assert shards is not None
        started = time.monotonic()
        done = offsets.committable()
        ckpt = new_checkpoint({}, {})
        checkpoint.save_sharded(dist, ckpt_dir, model, optimizer, ckpt, cfg.keep_checkpoints)
        info = shards.publish(model, parent=current, train_step=step,
                              metrics={**ckpt.metrics, "publish_token": ckpt.publish_token})
        log.info("published v%d (sharded %s, %d bytes, %.1f%% of full) at step %d", info.version, info.kind,
                 info.bytes, 100.0 * info.bytes / max(info.full_bytes, 1), step)
        pending = ({}, done)
        window, trained_ids, last_publish = [], [], time.monotonic()
        waited_s += time.monotonic() - started
        settle(info)

    def publish_point() -> None:
        """Cut a publish point: gather and snapshot the states, then checkpoint -> publish in the
        publisher (background or inline) and, once it says, commit (crash windows: trainer.checkpoint)."""
        nonlocal pending, window, trained_ids, last_publish, waited_s
        if shards is not None:
            sharded_point()
            return
        master, optimizer_state = _full_states(dist, model, optimizer)  # a collective: every rank, now
        if exporter is not policy:
            exporter.load_master(master)
        point = Snapshot(master, optimizer_state, exporter.export())  # inline: written before the next step
        if publisher.background:  # copies of whatever the next steps would change (the Adam moments in one process)
            point = snapshot(*point, live=(model, optimizer, exporter.model))
        waited = time.monotonic()
        settle(publisher.wait())  # the previous point's version is this one's parent
        waited_s += time.monotonic() - waited
        done = offsets.committable()  # as before: these records leave the tracker, the commit covers them
        ckpt = new_checkpoint(point.master, point.optimizer)
        pending = (point.export, done)
        publisher.submit(ckpt, point.export, published)
        window, trained_ids, last_publish = [], [], time.monotonic()
        settle(publisher.done())  # inline: written already

    # --- loop: consume -> buffer -> step (every rank) -> publish point ----------------------------
    # Each turn rank 0 tells the other ranks what to do (idle, step, publish, stop), so they never
    # wait in a collective for longer than a poll.
    busy = False
    try:
        while True:
            heartbeat.beat()
            settle(publisher.done())  # a version written in the background: current, commit
            if stop.is_set():
                dist.broadcast_object(("stop",))
                break
            forget_erased()
            polled = [r for r in consumer.poll(timeout_s=0.0 if busy else POLL_TIMEOUT_S, max_records=MAX_RECORDS)
                      if offsets.track(r)]  # not tracked: redelivered after a restart; the checkpoint holds its fate
            vetted = vet(polled, settings.model.line, vocab_size, scored_rows if cfg.require_stored else None)
            if any(sample is not None and problem is not None for _, sample, problem in vetted):
                forget_erased(force=True)  # an erasure may have deleted its row since the last read
            for record, sample, problem in vetted:
                if sample is not None and erased(sample):  # never dead-lettered: the letter would keep it
                    buffer.dropped["erased"] += 1
                    offsets.done(record)
                    continue
                if problem is not None:  # counted in the version's metrics as dropped_dead_lettered
                    route_to_dlq(consumer, record, problem, buffer.dropped, log)
                    offsets.done(record)
                    continue
                if buffer.add(sample, record, current) is not None:
                    offsets.done(record)
            for entry in buffer.purge_stale(current):
                offsets.done(entry.record)

            batch = buffer.take(cfg.batch_size, cfg.batch_tokens)
            busy = bool(batch)
            timed_out = cfg.publish_every_s > 0 and time.monotonic() - last_publish >= cfg.publish_every_s
            if batch:
                samples = [e.sample for e in batch]
                due = (step + 1) % cfg.steps_per_version == 0 or timed_out
                dist.broadcast_object(("step", [s.to_bytes() for s in samples], current, not window, due))
                window.append(train_step(model, optimizer, samples, current, cfg, reference=reference,
                                         measure_parity=not window, dist=dist))
                scheduler.step()
                step += 1
                trained_ids += [s.trajectory_id for s in samples]
                for entry in batch:
                    offsets.done(entry.record)
            elif window and timed_out:
                due = True
                dist.broadcast_object(("publish",))
            else:
                due = False
                dist.broadcast_object(("idle",))
            if due:
                publish_point()
    finally:
        # --- cleanup: the point being written is finished and committed (unless it failed) -----
        try:
            if publisher.error is None:
                settle(publisher.wait())
        finally:
            publisher.close()
            log.info("trainer stopping at step %d, v%d (publishing stalled the loop %.1fs): %s", step, current,
                     publisher.stall_s + waited_s, buffer.counters())
            heartbeat.close()
            consumer.close()
            bus.close()
            engine.dispose()


def _start_file(ckpt_dir: Path) -> Path:
    """Where rank 0 writes the weights a sharded trainer's ranks read their rows of at start."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return ckpt_dir / START_FILE


def _reference(dist: Dist, model_path: Path) -> torch.nn.Module:
    """The frozen KL reference (the weights ``model.path`` holds). Under FSDP2 it is sharded as the
    trained model is (:meth:`Dist.wrap`; each rank reads its own rows), so no rank holds it whole; its
    forward passes are collectives, run on every rank for every micro-batch, placeholders
    included, as the trained model's are (trainer/step.py). Otherwise every rank holds it whole.
    A collective under torchrun: every rank calls it at the same point."""
    if dist.enabled and dist.wrapper == "fsdp2":  # every rank reads its own rows of the model's files
        return dist.wrap(skeleton_model(model_path).requires_grad_(False), weight_files(model_path))
    return load_weights(model_path).requires_grad_(False).to(dist.device)


def _follow(dist: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
            reference: torch.nn.Module | None, cfg: TrainerSettings, shards: ShardedPublisher | None,
            ckpt_dir: Path) -> None:
    """Ranks other than 0: do what rank 0 says, until it says stop."""
    while True:
        command = dist.broadcast_object(None)
        if command[0] == "stop":
            return
        if command[0] == "step":
            _, raw, version, measure_parity, due = command
            samples = [ScoredTrajectory.from_bytes(b) for b in raw]
            train_step(model, optimizer, samples, version, cfg, reference=reference, measure_parity=measure_parity,
                       dist=dist)
            scheduler.step()
        if command[0] == "publish" or (command[0] == "step" and due):
            if shards is None:
                _full_states(dist, model, optimizer)
            else:  # this rank's part of rank 0's sharded_point
                checkpoint.save_sharded(dist, ckpt_dir, model, optimizer, None, cfg.keep_checkpoints)
                shards.publish(model, parent=None)


def _adopt_sharded(dist: Dist, shards: ShardedPublisher, model: torch.nn.Module, registry: Registry | None,
                   resumed: checkpoint.Checkpoint | None) -> VersionInfo:
    """After a restart from a checkpoint, with sharded versions: the version published from it (the
    hash of the ranks' shards checked against it), or, when the crash came between checkpoint and
    publish, that version published now. A collective; every rank returns the version."""
    found = dist.broadcast_object(
        checkpoint.find_published(registry, resumed) if dist.is_main and registry and resumed else None)
    if found is None:
        return shards.publish(model, parent=resumed.parent if resumed is not None else None,
                              train_step=resumed.step if resumed is not None else None,
                              metrics={**resumed.metrics, "publish_token": resumed.publish_token} if resumed else None)
    if shards.held_sha256() != found.sha256:
        raise checkpoint.CheckpointError(f"v{found.version} carries the checkpoint's token but not its weights")
    return found


def _full_states(dist: Dist, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole fp32 master and optimizer state on rank 0 (``{}`` elsewhere); every rank calls it."""
    return dist.full_state_dict(model), dist.optimizer_state_dict(model, optimizer)


def vet(records: list[Record], model_line: str, vocab_size: int,
        sessions: sessionmaker[Session] | None) -> list[tuple[Record, ScoredTrajectory | None, str | None]]:
    """Each record with its sample, or with why it must be dead-lettered: undecodable, untrainable,
    or (with ``sessions``: ``trainer.require_stored``) scored by no rewards worker, its event having
    no row in ``scored_trajectories`` (one query for the whole poll)."""
    out: list[tuple[Record, ScoredTrajectory | None, str | None]] = []
    for record in records:
        try:
            sample = ScoredTrajectory.from_bytes(record.value)
        except ValueError as exc:
            out.append((record, None, f"undecodable ScoredTrajectory: {exc}"))
            continue
        out.append((record, sample, untrainable(sample, model_line, vocab_size)))
    wanted = sorted({s.event_id for _, s, problem in out if s is not None and problem is None})
    if sessions is None or not wanted:
        return out
    with sessions() as db:
        known = set(db.scalars(select(ScoredTrajectoryRow.event_id).where(ScoredTrajectoryRow.event_id.in_(wanted))))
    for i, (record, sample, problem) in enumerate(out):
        if sample is not None and problem is None and sample.event_id not in known:
            out[i] = (record, sample, f"unknown ScoredTrajectory: no rewards worker stored {sample.trajectory_id!r} "
                                      f"revision {sample.revision} (event {sample.event_id}): not from rewards")
    return out


def untrainable(sample: ScoredTrajectory, model_line: str, vocab_size: int) -> str | None:
    """Why this model can never train on ``sample`` (it would fail on every replay), or None."""
    if sample.model_line != model_line:
        return f"sample is for model line {sample.model_line!r}, this trainer trains {model_line!r}"
    top = max((max(s.tokens) for s in sample.segments if s.tokens), default=-1)
    if top >= vocab_size:
        return f"token id {top} is outside the vocabulary of {vocab_size}"
    return None


def summarise(window: list[dict[str, Any]], counters: dict[str, int], version: int) -> dict[str, Any]:
    """The metrics recorded with a version: step means (sums for counts, maxima for ``parity_max``,
    a summed ``staleness`` histogram) plus the buffer counters.

    ``version`` is the one the window's master started from (the new version's parent): parity is
    its entry in the steps' ``parity_by_version``, i.e. over the samples that version served, not
    the step's top-level parity, which is for the version the loop knew at step time (one behind,
    right after a cut, while the previous point was still being published in the background)."""
    out: dict[str, Any] = {}
    parity = [by[str(version)] for m in window if str(version) in (by := m.get("parity_by_version", {}))]
    for key in ("loss", "mean_reward", "clip_frac", "trunc_frac", "mean_ratio", "mean_abs_log_ratio", "kl",
                "grad_norm"):
        values = [m[key] for m in window if key in m]
        if values:
            out[key] = fmean(values)
    if parity:
        out["parity"] = fmean(p["parity"] for p in parity)
        out["parity_p99"] = fmean(p["parity_p99"] for p in parity)
        out["parity_max"] = max(p["parity_max"] for p in parity)
    out["samples"] = int(sum(m["samples"] for m in window))
    out["tokens"] = int(sum(m["tokens"] for m in window))
    # Completion tokens of the trajectories taken, and those left out of training by reason
    # (greedy, unsupported:<knob>, outside_support): tokens / completion_tokens is the trainable share.
    out["completion_tokens"] = int(sum(m.get("completion_tokens", 0) for m in window))
    masked: Counter[str] = Counter()
    for m in window:
        masked.update(m.get("masked", {}))
    out["masked_tokens"] = {reason: int(n) for reason, n in sorted(masked.items())}
    out["steps"] = len(window)
    staleness: Counter[str] = Counter()
    for m in window:
        staleness.update(m.get("staleness", {}))
    out["staleness"] = dict(sorted(staleness.items(), key=lambda kv: int(kv[0])))
    out.update(counters)
    return out
