"""Registry versions rebuilt into safetensors files tensor by tensor, for nodes that serve from files.

:func:`rebuild_file` is :meth:`.registry.Registry.load` written to a file: the version's chain is
walked from ``base`` (files the caller holds, a version on the chain) or from the nearest full
version (an anchor, written to a step file first). The deltas after it are applied in one pass
(:func:`.codec.streaming.apply_chain`): each tensor goes through every delta on one thread of the
codec's pool and only the last version is written, so a node ten versions behind writes one file,
not ten. A pass holds at most :data:`PASS_BYTES` of delta objects; a longer chain is cut into
passes, each written to a step file. No whole state is held, and no anchor either: an anchor (or a
sharded anchor's shards) is read from the store by ranges, each tensor's streams as the thread
pool comes to them (:meth:`.store.Store.get_range`, :class:`.codec.anchor.AnchorReader`). Peak
memory is the interpreter, a few of the largest tensors per thread, and the pass's deltas (a delta
version's shards are fetched in parallel, whole: a delta is about 1% of the model). A vLLM node
(full weights) loads versions this way and never holds the model.

Invariants:
- ``out_path`` is replaced (atomically, after an fsync) only by a file whose tensors hash to the
  version's recorded sha256 (a sharded version's per shard and whole), every anchor tensor checked
  against its digest. Each delta's header hashes must be its registry row's and its parent's; a
  pass hashes only what it writes, and when that fails it runs again with every version's base
  and target hashes checked as if it were applied alone (:func:`.codec.streaming.apply_chain`).
  On any failure :class:`.registry.WeightsError` names the version to blame, ``out_path`` is left
  as it was, and the step files are removed.
- The output lays tensors out as the version's object does (name order); a file rebuilt from a
  delta is byte for byte the file :func:`.codec.streaming.apply_files` writes.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from flywheel.weights.codec.anchor import MAGIC, AnchorReader, is_anchor, read_full
from flywheel.weights.codec.container import read_delta_header
from flywheel.weights.codec.state import DeltaError
from flywheel.weights.codec.streaming import Step, StepError, apply_chain, delta_layout, files_sha256
from flywheel.weights.codec.tensorfile import TensorFiles, TensorWriter
from flywheel.weights.registry import Registry, VersionInfo, WeightsError
from flywheel.weights.shards import FETCH_THREADS, Manifest, fetch_shard, is_manifest, read_manifest
from flywheel.weights.store import Store, StoreError

Paths = Sequence[str | os.PathLike[str]]
#: One pass of :func:`rebuild_file` holds at most this many bytes of delta objects (one at least).
PASS_BYTES = 1 << 30
Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def files_digest(paths: Paths) -> tuple[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """The state hash of the tensors in the safetensors files ``paths`` (a model folder's shards),
    read tensor by tensor, and their :func:`files_layout`."""
    with TensorFiles(list(paths)) as files:
        return files_sha256(files), _layout(files)


def files_layout(paths: Paths) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's dtype and shape in the safetensors files ``paths`` (their headers only)."""
    with TensorFiles(list(paths)) as files:
        return _layout(files)


def _layout(files: TensorFiles) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (i.dtype, i.shape) for n, i in files.index.items()}


def rebuild_file(registry: Registry, version: int, out_path: str | os.PathLike[str], *,
                 base: tuple[int, Paths] | None = None) -> str:
    """Write ``version``'s weights to the safetensors file ``out_path``, rebuilt from ``base``
    (``(base_version, its safetensors files)``) when that version is on the chain, else from the
    nearest full version; returns the version's sha256, verified (module docstring)."""
    start, chain = registry.chain(version, base[0] if base is not None else None)
    out = Path(out_path)
    token = secrets.token_hex(4)
    made: list[Path] = []

    def step_file() -> tuple[Path, int]:
        path = out.parent / f".rebuild-{out.name}-{token}-{len(made)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        made.append(path)
        return path, fd

    try:
        if base is not None and start.version == base[0]:
            source: list[Any] = list(base[1])
            if not chain:  # the base itself: copied, its hash checked on the way
                path, fd = step_file()
                with os.fdopen(fd, "r+b", closefd=True) as fh:
                    _copy_into(source, fh.fileno(), start)
                source = [path]
        else:
            path, fd = step_file()
            with os.fdopen(fd, "r+b", closefd=True) as fh:
                _full_into(registry, start, fh.fileno())
            source = [path]
        parent = start
        for run in _passes(chain):
            path, fd = step_file()
            with os.fdopen(fd, "r+b", closefd=True) as fh:
                _chain_into(registry, run, parent, source, fh.fileno())
            if Path(source[0]) in made:
                Path(source[0]).unlink()
            source, parent = [path], run[-1]
        final = Path(source[0])
        with open(final, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(final, out)
        made.remove(final)
        return parent.sha256
    finally:
        for leftover in made:
            leftover.unlink(missing_ok=True)


def _copy_into(paths: Paths, fd: int, info: VersionInfo) -> None:
    with TensorFiles(list(paths)) as files:
        names = sorted(files.index)
        writer = TensorWriter(fd, [(n, files.index[n].dtype, files.index[n].shape) for n in names])
        for name in names:
            with files.view(name) as t:
                writer.write(name, t)
        writer.close()
        if files_sha256(files) != info.sha256:
            raise WeightsError(f"base files do not match version {info.version}'s recorded hash")


def _manifest(info: VersionInfo, data: bytes) -> tuple[Manifest, Layout]:
    """A sharded version's manifest, checked against the row, and the layout of its tensors."""
    manifest = read_manifest(data)
    if manifest.sha256 != info.sha256:
        raise DeltaError(f"manifest's state hash {manifest.sha256[:12]} is not the recorded {info.sha256[:12]}")
    return manifest, sorted((n, _dtype(d), tuple(s)) for shard in manifest.shards for n, d, s, _, _ in shard.tensors)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaError(f"unknown dtype {name!r} in shard manifest")
    return dtype


def _anchor(store: Store, key: str, size: int | None = None) -> AnchorReader:
    """The anchor at ``key`` (``size`` bytes, when the caller knows how many), read by ranges."""
    found = store.size(key)
    if size is not None and found != size:
        raise DeltaError(f"object {key!r} is {found} bytes, {size} expected")
    return AnchorReader(lambda at, length: store.get_range(key, at, length), found)


def _full_into(registry: Registry, info: VersionInfo, fd: int) -> None:
    """A full version (anchor, sharded anchors, or plain safetensors) into the file at ``fd``;
    anchors are read by ranges, tensor by tensor."""
    store = registry.store
    try:
        if is_manifest(info.store_key):
            manifest, layout = _manifest(info, registry.fetch(info))
            writer = TensorWriter(fd, layout)
            for meta in manifest.shards:  # each checked tensor by tensor against the manifest's hashes
                if meta.kind != "full" or _anchor(store, meta.key, meta.bytes).decode_into(writer) != meta.sha256:
                    raise DeltaError(f"shard {meta.rank} ({meta.key}) does not rebuild to its manifest hash")
            got = manifest.sha256
        elif is_anchor(registry.fetch(info, (0, len(MAGIC)))):
            anchor = _anchor(store, info.store_key)
            writer = TensorWriter(fd, anchor.layout)
            got = anchor.decode_into(writer)
        else:  # stored before anchors: plain safetensors, small enough to have been held whole
            state, got = read_full(registry.fetch(info))
            writer = TensorWriter(fd, [(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
            for name, t in state.items():
                writer.write(name, t)
        writer.close()
    except (DeltaError, StoreError) as exc:
        raise WeightsError(f"version {info.version} ({info.store_key}): {exc}") from exc
    if got != info.sha256:
        raise WeightsError(f"version {info.version} ({info.store_key}): does not match its recorded hash")


def _passes(chain: list[VersionInfo]) -> list[list[VersionInfo]]:
    """The chain's deltas cut into runs rebuilt in one pass each: as many as :data:`PASS_BYTES` of
    objects allow (one at least), so a node far behind writes a file per run, not per version."""
    runs: list[list[VersionInfo]] = []
    held = 0
    for info in chain:
        if not runs or held + info.bytes > PASS_BYTES:
            runs.append([])
            held = 0
        runs[-1].append(info)
        held += info.bytes
    return runs


def _step(registry: Registry, info: VersionInfo, parent: VersionInfo) -> tuple[Step, Layout]:
    """A delta version (or a sharded one) as a step of :func:`.codec.streaming.apply_chain` on
    ``parent``, its objects fetched (a sharded version's shards in parallel), and its target's layout."""
    data = registry.fetch(info)
    if not is_manifest(info.store_key):
        header = read_delta_header(data)[0]
        if header.target_sha256 != info.sha256 or header.base_sha256 != parent.sha256:
            raise DeltaError("delta's hashes differ from the registry's")
        return Step([(data, None)]), delta_layout(data)
    manifest, layout = _manifest(info, data)
    if manifest.kind != "delta" or manifest.base_sha256 != parent.sha256:
        raise DeltaError("a sharded delta needs its parent's state as the base")
    with ThreadPoolExecutor(min(FETCH_THREADS, max(1, len(manifest.shards))), "flywheel-shards") as pool:
        blobs = list(pool.map(lambda meta: fetch_shard(registry.store, meta), manifest.shards))
    parts = []
    for meta, blob in zip(manifest.shards, blobs, strict=True):
        header = read_delta_header(blob)[0]
        if header.base_sha256 != meta.base_sha256 or header.target_sha256 != meta.sha256:
            raise DeltaError(f"shard {meta.rank} ({meta.key}) does not rebuild to its manifest hash")
        parts.append((blob, [n for n, *_ in meta.tensors]))
    return Step(parts, base_sha256=manifest.base_sha256, sha256=manifest.sha256), layout


def _chain_into(registry: Registry, run: list[VersionInfo], parent: VersionInfo, source: Paths, fd: int) -> None:
    """The delta versions ``run`` (each the next one's parent, the first on ``parent``) applied in one
    pass on ``parent``'s files ``source`` into the file at ``fd``."""
    steps: list[tuple[Step, Layout]] = []
    prior = parent
    for info in run:
        try:
            steps.append(_step(registry, info, prior))
        except DeltaError as exc:
            raise WeightsError(f"version {info.version} ({info.store_key}): {exc}") from exc
        prior = info
    try:
        with TensorFiles(list(source)) as old:
            writer = TensorWriter(fd, steps[-1][1])
            got = apply_chain(old, [step for step, _ in steps], writer)
            writer.close()
    except DeltaError as exc:  # a StepError names the step to blame; the base files' own faults, the first
        info = run[exc.step if isinstance(exc, StepError) else 0]
        raise WeightsError(f"version {info.version} ({info.store_key}): {exc}") from exc
    if got != run[-1].sha256:  # each delta's own hashes are the registry's (_step); a mismatch here is a bug
        raise WeightsError(f"version {run[-1].version} ({run[-1].store_key}): rebuilt {got[:12]}, not its recorded hash")
