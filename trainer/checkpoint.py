"""The trainer's durable checkpoint: everything needed to resume as if the process had never died.

A checkpoint is written at every publish point, *before* the version is published, and holds the
fp32 master weights, the optimizer (Adam moments) and LR-scheduler state, the step, the version
the weights were trained from (``parent``, with its hash), the sample buffer (queued samples as raw
bytes with their record coordinates, the bounded de-dup memories of seen event ids and trained
trajectory ids, the drop counters), the offset tracker (read positions, records not yet
committable) and the metrics of the version it becomes, among them ``trajectory_ids`` (the
trajectories trained since ``parent``) and a random ``publish_token``. The version published from
it carries the same metrics, so a version and its checkpoint name each other.

The protocol at a publish point: (1) write the checkpoint atomically (temporary file, ``fsync``,
``os.replace``, ``fsync`` of the directory), (2) publish the version through the registry (which
allocates ``max + 1``), (3) commit the done prefix of the bus offsets. With background publishing
(trainer/publisher.py) a worker thread runs (1) and (2) on snapshots taken at the cut while the
loop trains on, and the loop runs (3) once the worker reports the version; the order is the same,
points never overlap (the next cut waits for the pending one), and so are the windows below, which
may now fall while later steps train. On start, the trainer loads the newest checkpoint and looks
for the version carrying its token: found, that is the current version; not found, it publishes the
checkpoint's weights now. Crash windows (``kill -9``):

- While training between publish points, or after a cut before its checkpoint is written (the
  snapshot is only in memory): the steps since the last checkpoint are lost, nothing else. The
  restart restores the checkpoint bit for bit; the bus redelivers every record after its committed
  offset; records below the checkpoint's read positions are skipped (their fate is in the restored
  buffer, counters and de-dup memory), later ones are processed as new. The lost steps were in no
  version, so no sample was used by them.
- While writing the checkpoint: the temporary file is never loaded (and is removed); the previous
  checkpoint stands, as above.
- After the checkpoint, before the registry row is inserted (upload, verification): no version
  has the token, so the restart publishes the checkpoint's weights: the number is allocated once,
  from the registry. The interrupted upload may leave an object under its random key,
  unreferenced. Steps trained since the cut are lost, as in the first case.
- After the row, before the bus commit (with background publishing: before the loop has seen the
  version): the restart finds the version by its token and adopts it (its hash is checked against
  the restored weights); nothing is published again. The bus redelivers the done records; the
  tracker knows them as done and commits them at the next publish point.
- After the commit: as the previous case, with nothing redelivered.

Sharded (``trainer.sharded_versions``, FSDP2 under torchrun; :func:`save_sharded`): every rank
writes its own shards of the master and Adam state into a hidden folder, rank 0 renames it to
``step-<step>.dcp`` and then writes the checkpoint file naming it, the same commit point as above;
the version is published sharded by every rank (trainer/shard_publish.py) and the restart checks
the found version's hash against the hash the ranks' shards compose to, with no rank gathering a
state. A crash before the file leaves a folder no checkpoint names, removed by the next save.

So a trajectory id appears in the ``trajectory_ids`` of at most one version, version numbers are
never reused, and every record is trained, buffered in the newest checkpoint, or dropped and
counted by reason. The newest checkpoint is the only valid one: an older one names an older
version, and resuming from it would train again what newer versions contain, so an unreadable
newest checkpoint is an error (never a silent fallback). Invariant assumed: one trainer per model
line and consumer group, reading every partition of the topic.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.settings import Settings
from flywheel.weights.registry import Registry, VersionInfo, VersionNotFound
from trainer.distributed import Dist

#: 2 added ``sharded``; format-1 files (no such key) still load.
FORMAT = 2
#: The suffix of a sharded checkpoint's folder.
SHARDS = ".dcp"
_NAME = re.compile(r"^step-(\d{10})\.pt$")


class CheckpointError(Exception):
    """A checkpoint is unreadable or does not belong to this model line and registry."""


@dataclass
class Checkpoint:
    """One resumable trainer state (module docstring); tensors on the CPU."""

    model_line: str
    step: int
    parent: int  # the version the weights were trained from
    parent_sha256: str
    publish_token: str  # carried in the metrics of the version published from this checkpoint
    metrics: dict[str, Any]  # that version's metrics, with ``trajectory_ids`` (the token is added on publish)
    model: dict[str, torch.Tensor]  # fp32 master weights, by parameter name
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    buffer: dict[str, Any]  # SampleBuffer.state_dict()
    offsets: dict[str, Any]  # OffsetTracker.state_dict()
    #: A sharded checkpoint's folder beside the file (``step-<step>.dcp``: every rank's shards of
    #: the master and the optimizer state, :func:`save_sharded`); ``model`` and ``optimizer`` are
    #: then empty. Empty: both are in the file.
    sharded: str = ""


def checkpoint_dir(settings: Settings) -> Path:
    """``trainer.checkpoint_dir``, or ``{data_dir}/trainer/<model line>``."""
    root = Path(settings.trainer.checkpoint_dir) if settings.trainer.checkpoint_dir else settings.data_path / "trainer"
    return root / settings.model.line


def save(directory: Path, checkpoint: Checkpoint, keep: int = 2) -> Path:
    """Write ``checkpoint`` atomically as ``step-<step>.pt``; keep the newest ``keep`` checkpoints
    (and the sharded folders of those only)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{checkpoint.step:010d}.pt"
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **asdict(checkpoint)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)
    for old in _checkpoints(directory)[:-keep]:
        old.unlink()
    kept = {p.name.removesuffix(".pt") + SHARDS for p in _checkpoints(directory)}
    for folder in directory.glob(f"step-*{SHARDS}"):
        if folder.name not in kept:  # a rotated checkpoint's, or one whose file a crash never wrote
            shutil.rmtree(folder, ignore_errors=True)
    return path


def save_sharded(dist: Dist, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpoint: Checkpoint | None, keep: int = 2) -> Path:
    """Write a sharded checkpoint; a collective: rank 0 passes ``checkpoint`` (its ``model`` and
    ``optimizer`` empty), the other ranks None.

    Every rank writes its shards of the master and optimizer state into a hidden folder
    (:meth:`Dist.save_sharded_state`); rank 0 then renames it to ``step-<step>.dcp`` and writes the
    checkpoint file naming it, atomically as :func:`save` does. The file is the commit point: a crash
    before it leaves a hidden folder (removed by the next load or save) or a folder no checkpoint
    names (removed by the next save); neither is ever loaded, and the previous checkpoint stands,
    as in the crash windows above."""
    step = dist.broadcast_object(checkpoint.step if checkpoint is not None else None)
    name = f"step-{step:010d}{SHARDS}"
    tmp = directory / f".{name}.tmp"
    if dist.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in (tmp, directory / name):  # left by a crash of an earlier attempt at this step
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    dist.save_sharded_state(model, optimizer, tmp)  # returns on rank 0 once every rank's shards are written
    if not dist.is_main:
        return directory / name
    assert checkpoint is not None and not checkpoint.model and not checkpoint.optimizer
    _fsync_dir(tmp)  # the ranks' files are fsynced by DCP; their names in the folder here
    os.replace(tmp, directory / name)
    _fsync_dir(directory)
    checkpoint.sharded = name
    return save(directory, checkpoint, keep)


def load_sharded(dist: Dist, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 checkpoint: Checkpoint | None) -> None:
    """Load the shards of a sharded ``checkpoint`` (rank 0's; None on the others) into the wrapped
    model and its optimizer, with any number of ranks; a collective."""
    name = dist.broadcast_object(checkpoint.sharded if checkpoint is not None else None)
    dist.load_sharded_state(model, optimizer, directory / name)


def load_latest(directory: Path, model_line: str) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` (None when there is none); removes stale temporaries."""
    if not directory.is_dir():
        return None
    for tmp in directory.glob(".step-*.tmp"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted sharded save; never loaded
        else:
            tmp.unlink()  # an interrupted save; never loaded
    paths = _checkpoints(directory)
    if not paths:
        return None
    try:
        data = torch.load(paths[-1], map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling or zip failure: say which file
        raise CheckpointError(f"cannot read the newest trainer checkpoint {paths[-1]}: {exc}") from exc
    if data.pop("format", None) not in (1, FORMAT):
        raise CheckpointError(f"{paths[-1]} is not a format-1 or format-{FORMAT} trainer checkpoint")
    checkpoint = Checkpoint(**data)
    if checkpoint.model_line != model_line:
        raise CheckpointError(f"{paths[-1]} is for model line {checkpoint.model_line!r}, not {model_line!r}")
    if checkpoint.sharded and not (directory / checkpoint.sharded / ".metadata").is_file():
        raise CheckpointError(f"{paths[-1]} names the sharded state {checkpoint.sharded!r}, which is not in {directory}")
    return checkpoint


def find_published(registry: Registry, checkpoint: Checkpoint) -> VersionInfo | None:
    """The version published from ``checkpoint`` (it carries the checkpoint's token), or None.

    Checks that the checkpoint's parent is still in the registry with the recorded hash.
    """
    if registry.get(checkpoint.parent).sha256 != checkpoint.parent_sha256:
        raise CheckpointError(
            f"checkpoint at step {checkpoint.step} was trained from a v{checkpoint.parent} with another hash "
            "than the registry's: it belongs to another registry"
        )
    latest = registry.latest()
    assert latest is not None  # the parent exists
    for version in range(latest.version, checkpoint.parent, -1):
        try:
            info = registry.get(version)
        except VersionNotFound:
            continue
        if info.metrics.get("publish_token") == checkpoint.publish_token:
            return info
    return None


def _checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
