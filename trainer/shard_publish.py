"""Sharded publishing under torchrun: each rank codes, uploads and checks its own shard; rank 0 writes the manifest.

:meth:`ShardedPublisher.publish` is a collective (every rank calls it, in the same place of the
loop) that stores the model's bf16 export as one sharded version (:mod:`flywheel.weights.shards`)
without any process holding the whole state:

1. Each rank exports the tensors it owns (:func:`~flywheel.weights.shards.owners`, by bytes): the
   FSDP2 shards of each parameter are rounded to bf16 where they are, all-gathered one tensor at a
   time and written by the owner only, into a file of its own (``workdir``), so a rank holds one
   bf16 tensor in flight beyond its training state (under DDP every rank has every tensor
   already), under the checkpoint's names (a fused tensor of experts is written as the files
   hold it, one tensor per expert: ``flywheel.weightnames``); the persistent buffers
   (``flywheel.lm.persistent_buffers``, whole on every rank) are written as held by their owners.
   Its previous shard (the next delta's base) is a file there too: no shard of the export is ever
   held in memory.
2. Rank 0 plans the version (one small broadcast): a random token for the shard keys and the kind,
   ``delta`` when the registry allows it on ``parent`` and the ranks' previous shards (their hashes
   gathered as per-tensor entries, no tensor) compose to the parent's recorded hash, else ``full``
   (anchors: the first version, an anchor number, a restart or a new world size).
3. Each rank codes its shard (a delta against its own previous shard, or an anchor) from the two
   files tensor by tensor, uploads it, reads it back and decodes it (each tensor hashed and
   dropped), every hash checked; only the :class:`ShardMeta` is gathered.
   When the deltas together would not pay (``Registry.sharded_kind``), every rank codes an anchor
   instead.
4. Rank 0 stores the manifest through ``Registry.publish_manifest`` (upload, read back, insert the
   row) and broadcasts the version (or the failure) to every rank; only then does each rank keep
   its new shard's file as the next version's base (a rename).

A failure anywhere (a rank's encode, upload or read-back, the manifest, the row) is gathered and
raised on every rank as :class:`~flywheel.weights.registry.WeightsError`, so the ranks leave the
collective together and the job ends as an inline publish failure would; objects already uploaded
are deleted (best effort) and no row exists. A rank killed mid-publish ends the job through
torchrun: its peers' collective fails, the manifest is never written, and nodes keep serving what
they serve (the shards uploaded so far stay unreferenced, like an interrupted upload's object).

Only full-parameter policies publish sharded (a LoRA export merges or selects tensors that no
rank owns as such; adapter versions are small anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from flywheel.lm import persistent_buffers
from flywheel.weightnames import pieces, to_checkpoint
from flywheel.weights.codec.state import combine_digests
from flywheel.weights.codec.streaming import tensor_entries
from flywheel.weights.codec.tensorfile import TensorReader, TensorWriter
from flywheel.weights.registry import Registry, VersionInfo, WeightsError
from flywheel.weights.shards import ShardMeta, check_shard, encode_shard, manifest_bytes, owners, shard_key
from flywheel.weights.store import Store
from trainer.distributed import Dist, unwrap

log = logging.getLogger("flywheel.trainer")


class ShardedPublisher:
    """This rank's part of sharded publishing (module docstring); ``registry`` on rank 0 only.
    ``workdir``: where this rank keeps its shard files (``rank-NNNN`` under it, emptied at start),
    on a disk, not in memory (a ``tmpfs`` would hold them in RAM after all)."""

    def __init__(self, dist: Dist, model: torch.nn.Module, store: Store, model_line: str,
                 registry: Registry | None = None, *, workdir: str | os.PathLike[str]) -> None:
        if dist.is_main and registry is None:
            raise ValueError("rank 0 publishes through the registry")
        self.dist, self.store, self.model_line, self.registry = dist, store, model_line, registry
        buffers = persistent_buffers(unwrap(model))  # in the export as held, not sharded: whole on every rank
        sizes = {name: p.numel() * 2 for name, p in unwrap(model).named_parameters()}  # bf16 bytes
        sizes.update({name: b.numel() * b.element_size() for name, b in buffers.items()})
        #: The rank that owns each of the model's tensors (the same map on every rank); it writes
        #: the export's tensors made of it (one per expert where the model fuses them).
        self.owner = owners(sizes, dist.world_size)
        shapes = {name: (torch.bfloat16, p.shape) for name, p in unwrap(model).named_parameters()}
        shapes.update({name: (b.dtype, b.shape) for name, b in buffers.items()})
        self._layout = [(piece, *layout) for name, (dtype, shape) in shapes.items() if self.owner[name] == dist.rank
                        for piece, layout in pieces(unwrap(model), name, shape, dtype).items()]
        self.dir = Path(workdir) / f"rank-{dist.rank:04d}"
        shutil.rmtree(self.dir, ignore_errors=True)  # a killed run's files: never a base
        self.dir.mkdir(parents=True)
        #: This rank's shard of the last version it published or started from (bf16), once there is one.
        self.previous = self.dir / "previous.safetensors"
        self._next = self.dir / "next.safetensors"
        self._previous_entries: list[Any] | None = None

    def export(self, model: torch.nn.Module, path: Path) -> None:
        """Write this rank's tensors of the bf16 export (``flywheel.lm.export_state``'s names and
        values) into a safetensors file at ``path``, one tensor at a time; a collective under
        FSDP2: every rank calls it."""
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            writer = TensorWriter(fd, self._layout)
            with torch.no_grad():
                for name, p in unwrap(model).named_parameters():
                    # Rounding is elementwise, so each rank rounds its own piece and the gather
                    # moves (and the owner holds) bf16: half the bytes of gathering fp32.
                    t = p.detach().to(torch.bfloat16)
                    if isinstance(t, DTensor):
                        t = t.full_tensor()  # every rank, in the same order; only the owner keeps it
                    if self.owner[name] == self.dist.rank:
                        self._write(writer, model, name, t.cpu())
                    del t
                for name, b in persistent_buffers(unwrap(model)).items():
                    if self.owner[name] == self.dist.rank:
                        self._write(writer, model, name, b.detach().cpu())
            writer.close()
        finally:
            os.close(fd)

    @staticmethod
    def _write(writer: TensorWriter, model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Write the model's tensor ``name`` as the export's tensors made of it (itself, or its
        checkpoint pieces: ``flywheel.weightnames``)."""
        for piece, t in to_checkpoint(unwrap(model), {name: tensor}).items():
            writer.write(piece, t)

    def start(self, model: torch.nn.Module) -> None:
        """Take this rank's shard of the weights the model holds now (the version it was loaded
        from) as the next delta's base; a collective."""
        self.export(model, self._next)
        os.replace(self._next, self.previous)
        self._previous_entries = None

    def held_sha256(self) -> str:
        """The hash of the whole state the ranks' shards from :meth:`start` or the last publish
        make (``state_sha256`` of the bf16 export; no tensor is gathered); a collective."""
        held = self.dist.all_gather_object(self._entries())
        if any(e is None for e in held):
            raise WeightsError("a rank holds no shard: call start() first")
        return combine_digests([x for e in held for x in e])

    def publish(self, model: torch.nn.Module, *, parent: int | None, train_step: int | None = None,
                metrics: dict[str, Any] | None = None) -> VersionInfo:
        """Store the model's export as the next version on ``parent`` (module docstring); a
        collective. Returns the version on every rank, or raises :class:`WeightsError` on every rank."""
        dist = self.dist
        self.export(model, self._next)
        held = dist.all_gather_object(self._entries())
        plan: dict[str, Any] | None = None
        if dist.is_main:
            assert self.registry is not None
            kind = self.registry.sharded_kind(parent)
            base_sha = self.registry.get(parent).sha256 if parent is not None else None
            if kind == "delta" and (any(e is None for e in held)
                                    or combine_digests([x for e in held for x in e]) != base_sha):
                log.info("the ranks do not hold v%s's shards: publishing sharded anchors", parent)
                kind = "full"
            plan = {"token": secrets.token_hex(6), "kind": kind, "base_sha256": base_sha if kind == "delta" else None}
        plan = dist.broadcast_object(plan)
        assert plan is not None
        metas = self._upload(plan["token"], plan["kind"])
        if plan["kind"] == "delta":
            redo = None
            if dist.is_main:
                assert self.registry is not None
                raw = sum(int(t[3]) for m in metas for t in m.tensors)
                redo = self.registry.sharded_kind(parent, sum(m.bytes for m in metas), raw) == "full"
            if dist.broadcast_object(redo):  # the deltas cost about as much as anchors: store anchors
                self.store.delete(metas[dist.rank].key)
                plan = {**plan, "kind": "full", "base_sha256": None}
                metas = self._upload(plan["token"], "full")
        outcome: VersionInfo | str | None = None
        if dist.is_main:
            assert self.registry is not None
            try:
                outcome = self.registry.publish_manifest(manifest_bytes(plan["kind"], plan["base_sha256"], metas),
                                                         parent=parent, train_step=train_step, metrics=metrics)
            except Exception as exc:  # handed to every rank, raised there
                outcome = f"{type(exc).__name__}: {exc}"
                for meta in metas:
                    self._forget(meta.key)
        outcome = dist.broadcast_object(outcome)
        if not isinstance(outcome, VersionInfo):
            raise WeightsError(f"sharded publish failed: {outcome}")
        os.replace(self._next, self.previous)
        self._previous_entries = metas[dist.rank].tensors
        return outcome

    def _entries(self) -> list[Any] | None:
        """The entries of this rank's previous shard (hashed from its file once, on first use), or None."""
        if self._previous_entries is None and self.previous.exists():
            with TensorReader(self.previous) as held:
                self._previous_entries = [list(e) for e in tensor_entries(held)]
        return None if self._previous_entries is None else [
            (n, d, tuple(s), int(b), h if isinstance(h, bytes) else bytes.fromhex(h))
            for n, d, s, b, h in self._previous_entries]

    def _upload(self, token: str, kind: str) -> list[ShardMeta]:
        """Code (from the files), upload and read back this rank's shard; every rank's meta, in
        rank order (a collective). Any rank's failure is raised on every rank."""
        dist = self.dist
        key = shard_key(self.model_line, token, dist.rank, dist.world_size, kind)
        result: ShardMeta | str
        try:
            parent = TensorReader(self.previous) if kind == "delta" else contextlib.nullcontext()
            with TensorReader(self._next) as new, parent as base:
                blob, meta = encode_shard(new, base, rank=dist.rank, key=key)
                self.store.put(key, blob)
                del blob
                check_shard(self.store, meta, base)  # read back: every hash checked, nothing kept
            result = meta
        except Exception as exc:  # gathered: every rank raises it below
            result = f"rank {dist.rank}: {type(exc).__name__}: {exc}"
        results = dist.all_gather_object(result)
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            self._forget(key)
            raise WeightsError("sharded publish failed: " + "; ".join(errors))
        return results  # type: ignore[return-value]

    def _forget(self, key: str) -> None:
        try:
            self.store.delete(key)
        except Exception:  # best effort: an unreferenced object is harmless
            log.warning("could not delete shard object %s", key, exc_info=True)
