"""Bytes shipped: what moving a node to each version of a line costs in object bytes, per chain and region.

Read-only arithmetic over a line's version rows (:meth:`.registry.Registry.shipped` hands them over)
and the pull ledgers of regional caches (:meth:`.store.RegionalCache.pulled`).

Invariants: a version's chain starts at its nearest full ancestor (its *anchor*) and follows the
deltas' parents; a chain whose parent is missing (or not listed before it) starts anew at the
version after the break. Nothing is fetched or written: only recorded sizes are added up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from flywheel.weights.store import RegionalCache


class StoredVersion(Protocol):
    """What the arithmetic reads of a version row (a :class:`.registry.VersionInfo` has it all)."""

    @property
    def version(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def parent(self) -> int | None: ...
    @property
    def bytes(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    @property
    def store_key(self) -> str: ...


@dataclass(frozen=True)
class ShippedBytes:
    """What moving a node to one version costs in object bytes (:func:`shipped_bytes`).

    ``bytes``: the object a node that holds ``parent`` fetches (the delta, or for a full version
    its stored anchor, compressed or not); ``chain_bytes``: every object from the chain's anchor
    (``anchor``) through this version, what a node holding none of them fetches; ``chain_average``:
    ``chain_bytes`` per version of that chain (``chain_length`` versions, the anchor included);
    ``regions``: bytes each given region's cache recorded pulling from the origin for this version's
    object (0: not pulled there, or pulled before the ledger existed)."""

    version: int
    kind: str
    parent: int | None
    bytes: int
    full_bytes: int
    anchor: int
    chain_length: int
    chain_bytes: int
    chain_average: float
    regions: dict[str, int]

    @property
    def pct_of_full(self) -> float:
        """``bytes`` as a percentage of the uncompressed state."""
        return 100.0 * self.bytes / max(self.full_bytes, 1)

    @property
    def chain_average_pct(self) -> float:
        """``chain_average`` as a percentage of the uncompressed state."""
        return 100.0 * self.chain_average / max(self.full_bytes, 1)


def shipped_bytes(versions: Iterable[StoredVersion], regions: Mapping[str, RegionalCache]) -> list[ShippedBytes]:
    """Bytes shipped per version of ``versions`` (oldest first), with what each of ``regions`` (a
    region's name -> its cache) recorded pulling for each version's object."""
    pulled = {name: cache.pulled() for name, cache in regions.items()}
    out: list[ShippedBytes] = []
    chains: dict[int, tuple[int, int, int]] = {}  # version -> (anchor, length, bytes) of its chain
    for info in versions:
        up = chains.get(info.parent) if info.kind == "delta" and info.parent is not None else None
        anchor, length, total = (up[0], up[1] + 1, up[2] + info.bytes) if up else (info.version, 1, info.bytes)
        chains[info.version] = (anchor, length, total)
        out.append(ShippedBytes(
            version=info.version, kind=info.kind, parent=info.parent, bytes=info.bytes,
            full_bytes=info.full_bytes, anchor=anchor, chain_length=length, chain_bytes=total,
            chain_average=total / length,
            regions={name: keys.get(info.store_key, 0) for name, keys in pulled.items()},
        ))
    return out
