"""Writes the trainer's checkpoints and publishes its versions off the training loop's critical path.

A publish point (trainer/train.py) hands :meth:`Publisher.submit` a :class:`~trainer.checkpoint.Checkpoint`
and the version's bf16 export, as :func:`snapshot` copies that the loop's later optimizer steps
cannot change, and goes on training. A worker thread then does what the loop did inline before:
``checkpoint.save`` (atomic, fsynced) and then :func:`publish` (``registry.publish``: encode the
delta, upload, verify, insert the row).

Invariants:

- One publish point at a time, in submission order: ``submit`` blocks while the previous point is
  still being written (that wait is ``stall_s``), so point k+1's checkpoint is never written
  before point k's version exists, and the crash windows are exactly trainer/checkpoint.py's.
- The worker never touches the bus. Committing offsets is the caller's: the Kafka consumer is not
  thread-safe, so the loop commits, on its own thread, once :meth:`Publisher.done` (or ``wait``)
  has returned the point's version: checkpoint -> publish -> commit, as before.
- A worker failure is never lost: ``done``, ``wait`` and any later ``submit`` re-raise it (it is
  kept in ``error``), and the worker stops; the loop crashes as an inline failure would.
- ``background=False`` does the same work inline in ``submit`` (today's behaviour, and the
  baseline of bench/trainer_step.py); its whole duration is the stall.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flywheel.weights.registry import Registry, State, VersionInfo
from trainer import checkpoint

log = logging.getLogger("flywheel.trainer")


class Snapshot(NamedTuple):
    """A publish point's tensors, safe from later optimizer steps (CPU tensors)."""

    master: State
    optimizer: dict[str, Any]
    export: State


def snapshot(master: State, optimizer_state: Mapping[str, Any], export: State, *,
             live: Iterable[torch.nn.Module | torch.optim.Optimizer] | None = None) -> Snapshot:
    """Copies of the fp32 ``master`` (``Dist.full_state_dict`` / ``Policy.master_state``), the
    ``optimizer_state`` (``Dist.optimizer_state_dict`` / ``optimizer.state_dict()``) and the bf16
    ``export`` that no later optimizer step can change, on the CPU.

    In one process ``optimizer.state_dict()`` returns the live Adam moments (and a CPU-resident
    model's gathered state may alias its parameters); under FSDP the gathered states are fresh CPU
    tensors already. With ``live`` (the models and optimizers still training), a CPU tensor is
    copied only if it shares storage with one of theirs; without it, every tensor is copied.
    Containers are always rebuilt (``optimizer.state_dict()`` hands out its live per-parameter dicts)."""
    shared = None if live is None else {ptr for obj in live for ptr in _storages(obj)}

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.detach().to("cpu")  # a copy already
        if shared is None or _storage(t) in shared:
            return t.detach().clone()
        return t

    return Snapshot({k: own(v) for k, v in master.items()}, _copy(optimizer_state, own),
                    {k: own(v) for k, v in export.items()})


def publish(registry: Registry, export: State, ckpt: checkpoint.Checkpoint, parent_state: State) -> VersionInfo:
    """Publish ``export`` as the version made from ``ckpt`` (its metrics carry the token)."""
    info = registry.publish(
        export, parent=ckpt.parent, parent_state=parent_state, train_step=ckpt.step,
        metrics={**ckpt.metrics, "publish_token": ckpt.publish_token},
    )
    log.info(
        "published v%d (%s, %d bytes, %.1f%% of full) at step %d: %s",
        info.version, info.kind, info.bytes, 100.0 * info.bytes / max(info.full_bytes, 1), ckpt.step,
        {k: round(v, 4) for k, v in info.metrics.items() if isinstance(v, float)},
    )
    return info


class Publisher:
    """Checkpoint then publish each submitted point, one at a time, in a worker thread (module docstring)."""

    def __init__(self, registry: Registry, ckpt_dir: Path, keep: int, *, background: bool = True) -> None:
        self.registry, self.ckpt_dir, self.keep, self.background = registry, ckpt_dir, keep, background
        #: Total seconds :meth:`submit` blocked (the previous point still being written, or the
        #: whole work with ``background=False``).
        self.stall_s = 0.0
        #: Publish points submitted.
        self.versions = 0
        #: The worker's failure, re-raised by ``done``, ``wait`` and ``submit``.
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._job: tuple[checkpoint.Checkpoint, State, State] | None = None  # submitted, not yet written
        self._result: VersionInfo | None = None  # written, not yet returned by done()/wait()
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="flywheel-publisher", daemon=True)
            self._thread.start()

    def submit(self, ckpt: checkpoint.Checkpoint, export: State, parent_state: State) -> None:
        """Hand over one publish point whose tensors are snapshots (:func:`snapshot`); blocks only
        while the previous point is still being written (inline: for the whole work)."""
        started = time.monotonic()
        try:
            if self._thread is None:
                self._raise()
                self.versions += 1
                info = self._write(ckpt, export, parent_state)
                with self._cond:
                    self._result = info
                return
            with self._cond:
                self._cond.wait_for(lambda: self._job is None or self.error is not None)
                self._raise()
                if self._closed:
                    raise RuntimeError("the publisher is closed")
                self._job = (ckpt, export, parent_state)
                self.versions += 1
                self._cond.notify_all()
        finally:
            self.stall_s += time.monotonic() - started

    def done(self) -> VersionInfo | None:
        """Without blocking: the version written since the last call (the newest, if several), or
        None; re-raises the worker's failure."""
        with self._cond:
            self._raise()
            info, self._result = self._result, None
            return info

    def wait(self) -> VersionInfo | None:
        """Block until no point is pending; then as :meth:`done`."""
        with self._cond:
            self._cond.wait_for(lambda: self._job is None or self.error is not None)
        return self.done()

    def close(self) -> None:
        """Wait for the pending point, then stop the worker. Raises nothing: a failure stays in
        ``error`` (and ``done``/``wait`` still raise it); a result not yet collected stays too."""
        with self._cond:
            self._cond.wait_for(lambda: self._job is None or self.error is not None)
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                job = self._job
            try:
                info = self._write(*job)
            except BaseException as exc:  # handed to the loop: done()/wait() re-raise it there
                log.error("publishing the point at step %d failed: %r", job[0].step, exc)
                with self._cond:
                    self.error, self._job = exc, None
                    self._cond.notify_all()
                return
            with self._cond:
                self._result, self._job = info, None
                self._cond.notify_all()

    def _write(self, ckpt: checkpoint.Checkpoint, export: State, parent_state: State) -> VersionInfo:
        """The crash-window protocol's first two steps (trainer/checkpoint.py): save, then publish."""
        started = time.monotonic()
        checkpoint.save(self.ckpt_dir, ckpt, keep=self.keep)
        saved = time.monotonic()
        info = publish(self.registry, export, ckpt, parent_state)
        log.debug("publish point at step %d: checkpoint %.2fs, publish %.2fs", ckpt.step, saved - started,
                  time.monotonic() - saved)
        return info


def _storages(obj: torch.nn.Module | torch.optim.Optimizer) -> Iterable[int]:
    """Storage addresses of every tensor ``obj`` holds: parameters and buffers, or optimizer state."""
    if isinstance(obj, torch.nn.Module):
        tensors: Iterable[Any] = [*obj.parameters(), *obj.buffers()]
    else:
        tensors = [v for state in obj.state.values() for v in state.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            yield _storage(t.to_local() if hasattr(t, "to_local") else t)  # a DTensor: its shard


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _copy(value: Any, own: Any) -> Any:
    """``value`` with every container rebuilt and every tensor passed through ``own``."""
    if isinstance(value, torch.Tensor):
        return own(value)
    if isinstance(value, Mapping):
        return {k: _copy(v, own) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v, own) for v in value)
    return value
