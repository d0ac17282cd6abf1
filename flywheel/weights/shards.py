"""Sharded versions: a version stored as a manifest of shard objects, one per trainer rank, each checked by hash.

Under torchrun no process holds a whole state to publish: each rank owns a set of whole tensors
(:func:`owners`, balanced by bytes, the same on every rank), exports their bf16 values, codes them
as a delta against its own shard of the parent version, or as an anchor (:func:`encode_shard`,
tensor by tensor from a file), uploads that object and reads it back (:func:`check_shard`, keeping
nothing). Rank 0 gathers only the shards'
:class:`ShardMeta` (keys, sizes, hashes; no tensor) and stores the version as a manifest
(:func:`manifest_bytes`), the object its registry row points at (a key ending in ``.manifest``).

Hashes compose, so a sharded version has the hash the same weights have published whole: a
state's :func:`~.codec.state.state_sha256` is one SHA-256 over per-tensor entries (name, dtype,
shape, bytes, the tensor's own SHA-256) in name order (:func:`~.codec.state.combine_digests`). A
shard's hash is that function over its tensors' entries, the version's over every shard's entries;
the manifest lists every entry, so each level is checked from the one below.

Manifest (UTF-8 JSON, ``format`` = :data:`FORMAT`): ``kind`` (``full``: every shard an anchor;
``delta``: every shard a delta on the same rank's shard of the parent), ``sha256`` (the whole
state), ``base_sha256`` (the parent's, for a delta), and per shard: ``rank``, ``key``, ``kind``,
``bytes`` and ``object_sha256`` (the object's bytes), ``sha256`` (the shard state), ``base_sha256``
(the parent's shard, for a delta), ``tensors`` (``[name, dtype, shape, bytes, digest hex]``),
``changed`` and ``elements``.

Invariants: :func:`load_sharded` returns exactly the state the manifest names or raises
:class:`~.codec.state.DeltaError` (a missing, corrupt or foreign shard, a manifest whose hashes do
not compose); it never returns part of a version. Shards of one manifest name disjoint tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flywheel.weights.codec.anchor import anchor_reader, encode_anchor_from, read_full
from flywheel.weights.codec.container import read_delta_header
from flywheel.weights.codec.delta import apply_delta
from flywheel.weights.codec.state import DeltaError, State, combine_digests
from flywheel.weights.codec.streaming import apply_into, delta_layout, diff_readers
from flywheel.weights.codec.tensorfile import Discard
from flywheel.weights.store import Store, StoreError

FORMAT = "flywheel-shards-v1"
#: A registry row whose ``store_key`` ends with this points at a manifest.
SUFFIX = ".manifest"
#: Shards fetched and rebuilt at once by :func:`load_sharded`.
FETCH_THREADS = 8

Entry = tuple[str, str, tuple[int, ...], int, bytes]


def owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """The rank that owns each tensor (``sizes``: its bytes): largest first (ties by name) to the
    least loaded rank (ties to the lower rank). Deterministic: every rank computes the same map."""
    load = [0] * world_size
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[name], load[rank] = rank, load[rank] + sizes[name]
    return out


@dataclass(frozen=True)
class ShardMeta:
    """One shard of a sharded version, as the manifest lists it (module docstring)."""

    rank: int
    key: str
    kind: str  # full | delta
    bytes: int
    object_sha256: str
    sha256: str
    base_sha256: str | None
    tensors: list[list[Any]]  # [name, dtype, shape, bytes, digest hex]
    changed: int
    elements: int

    def entries(self) -> list[Entry]:
        return [(n, d, tuple(s), int(b), bytes.fromhex(h)) for n, d, s, b, h in self.tensors]


@dataclass(frozen=True)
class Manifest:
    kind: str
    sha256: str
    base_sha256: str | None
    shards: list[ShardMeta]

    @property
    def stored_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def raw_bytes(self) -> int:
        return sum(int(t[3]) for s in self.shards for t in s.tensors)

    @property
    def fraction_changed(self) -> float:
        elements = sum(s.elements for s in self.shards)
        return sum(s.changed for s in self.shards) / elements if elements else 0.0


def is_manifest(key: str) -> bool:
    return key.endswith(SUFFIX)


def shard_key(model_line: str, token: str, rank: int, world_size: int, kind: str) -> str:
    """Where rank ``rank`` uploads its shard of the publish ``token`` (a random hex string)."""
    return f"{model_line}/s-{token}-r{rank:04d}-of-{world_size:04d}.{kind}"


def encode_shard(tensors: Any, base: Any | None, *, rank: int, key: str) -> tuple[bytes, ShardMeta]:
    """This rank's shard object: an anchor of ``tensors``, or (``base``: the same rank's shard of
    the parent) a delta on it; and its :class:`ShardMeta`. Both are readers (``index``, ``view``:
    a :class:`~.codec.tensorfile.TensorReader` over a file, or a state in memory through
    :class:`~.codec.tensorfile.StateReader`), read tensor by tensor: only the object is held."""
    if base is None:
        blob, listed = encode_anchor_from(tensors)
        kind, base_sha, changed = "full", None, None
    else:
        blob, summary = diff_readers(base, tensors)
        kind, base_sha, changed, listed = "delta", read_delta_header(blob)[0].base_sha256, summary["changed"], summary["digests"]
    elements = sum(math.prod(shape) for _, _, shape, _, _ in listed)
    meta = ShardMeta(rank=rank, key=key, kind=kind, bytes=len(blob), object_sha256=hashlib.sha256(blob).hexdigest(),
                     sha256=combine_digests(listed), base_sha256=base_sha,
                     tensors=[[n, d, list(s), b, h.hex()] for n, d, s, b, h in listed],
                     changed=elements if changed is None else changed, elements=elements)
    return blob, meta


def check_shard(store: Store, meta: ShardMeta, base: Any | None) -> None:
    """Read an uploaded shard back as :func:`rebuild_shard` does (``base``: a reader of the parent's
    shard, for a delta), each tensor decoded, hashed and dropped, so nothing the size of the shard
    is held; :class:`DeltaError` if it is missing, corrupt or does not rebuild ``meta``'s hash."""
    blob = fetch_shard(store, meta)
    if meta.kind == "full":
        reader = anchor_reader(blob)
        got = reader.decode_into(Discard(reader.layout))
    elif base is None:
        raise DeltaError(f"shard {meta.rank} is a delta and no base was given")
    else:
        got = apply_into(base, blob, Discard(delta_layout(blob)), base_sha256=meta.base_sha256)
    if got != meta.sha256:
        raise DeltaError(f"shard {meta.rank} ({meta.key}) rebuilds to {got[:12]}, expected {meta.sha256[:12]}")


def fetch_shard(store: Store, meta: ShardMeta) -> bytes:
    """One shard's object, checked against the manifest's length and hash; :class:`DeltaError` if
    it is missing or differs."""
    try:
        blob = store.get(meta.key)
    except StoreError as exc:
        raise DeltaError(f"shard {meta.rank} ({meta.key}) unavailable: {exc}") from exc
    if len(blob) != meta.bytes or hashlib.sha256(blob).hexdigest() != meta.object_sha256:
        raise DeltaError(f"shard {meta.rank} ({meta.key}) does not match its manifest hash (corrupt)")
    return blob


def rebuild_shard(store: Store, meta: ShardMeta, base: Mapping[str, torch.Tensor] | None) -> State:
    """Fetch one shard and rebuild its tensors (a delta on ``base``: the parent's tensors of the
    same names), every hash checked; :class:`DeltaError` if it is missing, corrupt or foreign."""
    blob = fetch_shard(store, meta)
    if meta.kind == "full":
        state, got = read_full(blob)
    else:
        if base is None:
            raise DeltaError(f"shard {meta.rank} is a delta and no base was given")
        names = [t[0] for t in meta.tensors]
        subset = {n: base[n] for n in names if n in base}
        state = apply_delta(subset, blob, old_sha256=meta.base_sha256)  # a wrong base fails the target hash
        got = meta.sha256
    if got != meta.sha256:
        raise DeltaError(f"shard {meta.rank} ({meta.key}) rebuilds to {got[:12]}, expected {meta.sha256[:12]}")
    return state


def manifest_bytes(kind: str, base_sha256: str | None, shards: list[ShardMeta]) -> bytes:
    """The manifest of a version made of ``shards`` (one per rank); its whole-state hash is composed
    from theirs (raises ``ValueError`` when shards overlap or disagree on the kind)."""
    shards = sorted(shards, key=lambda s: s.rank)
    if {s.kind for s in shards} != {kind}:
        raise ValueError(f"a {kind} manifest needs {kind} shards, got {[s.kind for s in shards]}")
    entries = [e for s in shards for e in s.entries()]
    if len({e[0] for e in entries}) != len(entries):
        raise ValueError("shards name a tensor twice")
    body = {"format": FORMAT, "kind": kind, "sha256": combine_digests(entries), "base_sha256": base_sha256,
            "shards": [asdict(s) for s in shards]}
    return json.dumps(body, separators=(",", ":")).encode()


def read_manifest(data: bytes) -> Manifest:
    """Parse a manifest and check that its hashes compose (each shard's from its tensors, the whole
    from every shard's); :class:`DeltaError` otherwise."""
    try:
        body = json.loads(bytes(data))
        if body.get("format") != FORMAT:
            raise DeltaError(f"not a {FORMAT} manifest")
        manifest = Manifest(kind=body["kind"], sha256=body["sha256"], base_sha256=body["base_sha256"],
                            shards=[ShardMeta(**s) for s in body["shards"]])
        entries = [e for s in manifest.shards for e in s.entries()]
        bad = [s.rank for s in manifest.shards if combine_digests(s.entries()) != s.sha256 or s.kind != manifest.kind]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise DeltaError(f"corrupt shard manifest: {exc}") from exc
    if bad:
        raise DeltaError(f"corrupt shard manifest: shards {bad} do not match their tensors or the manifest's kind")
    if len({e[0] for e in entries}) != len(entries) or combine_digests(entries) != manifest.sha256:
        raise DeltaError("corrupt shard manifest: its shards do not compose to its state hash")
    return manifest


def load_sharded(store: Store, data: bytes, *, sha256: str, base: Mapping[str, torch.Tensor] | None = None,
                 base_sha256: str | None = None) -> State:
    """The state a manifest names (``sha256``: the hash its registry row records), its shards
    fetched and rebuilt in parallel; a delta's on ``base`` (whose hash is ``base_sha256``, checked
    by the caller). Every shard and the whole are checked before anything is returned."""
    manifest = read_manifest(data)
    if manifest.sha256 != sha256:
        raise DeltaError(f"manifest's state hash {manifest.sha256[:12]} is not the recorded {sha256[:12]}")
    if manifest.kind == "delta" and (base is None or base_sha256 != manifest.base_sha256):
        raise DeltaError("a sharded delta needs its parent's state as the base")
    with ThreadPoolExecutor(min(FETCH_THREADS, max(1, len(manifest.shards))), "flywheel-shards") as pool:
        parts = list(pool.map(lambda s: rebuild_shard(store, s, base), manifest.shards))
    state: State = {}
    for part in parts:
        state.update(part)
    return dict(sorted(state.items()))


def check_manifest(store: Store, key: str, sha256: str) -> Manifest:
    """Read a stored manifest back: it parses, composes to ``sha256`` and every shard object is
    there (each rank has read its own shard back and rebuilt it before rank 0 writes this)."""
    try:
        manifest = read_manifest(store.get(key))
    except StoreError as exc:
        raise DeltaError(f"manifest {key!r} unreadable: {exc}") from exc
    if manifest.sha256 != sha256:
        raise DeltaError(f"manifest {key!r} composes to {manifest.sha256[:12]}, expected {sha256[:12]}")
    missing = [s.key for s in manifest.shards if not store.exists(s.key)]
    if missing:
        raise DeltaError(f"manifest {key!r} names missing shards {missing}")
    return manifest


def object_keys(store: Store, key: str) -> list[str]:
    """Every object a version's ``store_key`` stands for: itself, and a manifest's shards first
    (what garbage collection deletes). An unreadable manifest stands for itself alone."""
    if not is_manifest(key):
        return [key]
    try:
        return [s.key for s in read_manifest(store.get(key)).shards] + [key]
    except (StoreError, DeltaError):
        return [key]
