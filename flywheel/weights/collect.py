"""Garbage collection of a model line's weight objects: the versions still needed, and deleting the rest's objects.

:func:`collect` deletes only objects that no kept version needs (:func:`needed`): kept are the
stable and canary versions, candidates newer than stable, the version every node heartbeating
within ``node_ttl_s`` reports live, the last ``keep_rollback`` formerly stable versions (not
rolled back), and every ancestor their chains need. A collected version keeps its row, marked
``collected`` and audited (:meth:`.registry.Registry.mark_collected`) before its objects go (a
sharded version's shards too, :func:`.shards.object_keys`), so a load never finds half a version.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select

from flywheel.db.models import ModelVersion, Node, VersionTransition
from flywheel.weights.registry import Registry
from flywheel.weights.shards import object_keys


def needed(registry: Registry, *, keep_rollback: int = 2, node_ttl_s: float = 600.0) -> set[int]:
    """The versions :func:`collect` keeps (module docstring)."""
    line, now = registry.model_line, datetime.now(UTC)
    with registry.sessions() as session:
        rows = {r.version: r for r in session.scalars(select(ModelVersion).where(ModelVersion.model_line == line))}
        live = {v for v, beat in session.execute(
            select(Node.live_version, Node.last_heartbeat).where(Node.model_line == line)).all()
            if v is not None and (now - beat).total_seconds() <= node_ttl_s}
        was_stable = session.scalars(
            select(VersionTransition.version)
            .where(VersionTransition.model_line == line, VersionTransition.to_status == "stable")
            .order_by(VersionTransition.id.desc())).all()
    stable = [v for v, r in rows.items() if r.status == "stable"]
    newest_stable = max(stable, default=-1)
    roots = set(stable) | live
    roots |= {v for v, r in rows.items() if r.status == "canary" or (r.status == "candidate" and v > newest_stable)}
    previous = [v for v in dict.fromkeys(was_stable) if v not in stable and rows.get(v) is not None
                and rows[v].status != "rolled_back"]
    roots |= set(previous[:keep_rollback])
    keep: set[int] = set()
    for version in roots:
        while version is not None and version in rows and version not in keep:
            keep.add(version)
            row = rows[version]
            version = row.parent if row.kind == "delta" else None
    return keep


def collect(registry: Registry, *, keep_rollback: int = 2, node_ttl_s: float = 600.0,
            dry_run: bool = False) -> list[int]:
    """Delete the objects of versions nothing needs (:func:`needed`); returns those versions."""
    keep = needed(registry, keep_rollback=keep_rollback, node_ttl_s=node_ttl_s)
    doomed = [i for i in registry.versions() if i.version not in keep and i.status != "collected"]
    if dry_run:
        return [i.version for i in doomed]
    for info in doomed:
        if registry.mark_collected(info):  # else promoted (or collected) meanwhile: left alone
            for key in object_keys(registry.store, info.store_key):
                registry.store.delete(key)
    return [i.version for i in doomed]
