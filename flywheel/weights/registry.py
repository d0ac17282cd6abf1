"""The version registry of one model line: publish, look up, promote and load weight versions.

A version is ``(model line, integer version, kind full|delta, parent, sha256 of the reconstructed
weights)``; its bytes live in the object store under ``store_key``, its row in ``model_versions``,
and every status change is audited in ``version_transitions``.

Invariants:
- A row exists only for an object that was uploaded, read back and reconstructed to the recorded
  hash (publish is upload -> verify -> insert, in that order; a failed publish removes its object;
  the check decodes tensor by tensor and keeps none, so it never holds a second state).
  The trajectories its ``metrics["trajectory_ids"]`` lists are recorded as trained into it
  (``trained_trajectories``) in the transaction that inserts the row.
- Version numbers are never reused: the primary key ``(model_line, version)`` decides, and a
  publisher that loses the race retries with the next number. Store keys carry a random token,
  so a losing publisher never overwrites the winner's object.
- Full versions are stored as compressed anchors (:mod:`flywheel.weights.codec.anchor`, lossless);
  full objects stored before that are plain safetensors and still load. ``bytes`` is the object
  stored, ``full_bytes`` the state's raw tensor bytes (uncompressed: what "% of full" figures are
  relative to).
- A delta is stored only on top of a parent whose recorded hash matches the base it was encoded
  against, and never on anchor versions (``version % full_every == 0``), so a load never walks
  more than ``full_every - 1`` deltas. The delta competes with the object that would be stored
  instead, a compressed anchor, whose size is estimated from the parent chain's anchor (its
  stored bytes per raw byte, times this state's raw bytes), so a delta publish never compresses a
  full state it will not store. A delta is refused when it is not much smaller than that anchor
  (``DELTA_MAX_RATIO``), and when the deltas since the chain's anchor would add up to more than
  ``chain_max_ratio`` of it (a new anchor is then cheaper to fetch than that chain).
- :meth:`Registry.load` returns weights whose hash equals the row's, or raises :class:`WeightsError`.
- At most one version of a line is ``stable``: promoting one retires the previous (audited).
- A line may be *pinned* (:meth:`Registry.pin`): the pinned version is stable, carries who pinned
  it, when and why (``model_versions.pinned_*``; at most one per line), and stays stable: while a
  pin holds, :meth:`Registry.set_status` refuses every status change (:class:`LinePinned`) unless
  told ``override_pin``, and even then never makes another version stable nor moves the pinned one
  off stable (move the pin instead). Pinning ends a running canary (back to ``candidate``) in the
  same transaction. Pin, re-pin and unpin are audited in ``version_transitions`` like status changes
  (a pin of the stable version, and an unpin, as a ``stable -> stable`` row whose reason says so).
  Every status or pin change runs under the line's lock, so a pin and a compare-and-set
  (``expect=``) never interleave.
- Garbage collection (:mod:`flywheel.weights.collect`) marks a version ``collected`` here
  (:meth:`Registry.mark_collected`, audited) before it deletes its objects; collected versions
  keep their row so version numbers and the audit log stay whole.
- A sharded version (:meth:`Registry.publish_manifest`, from trainer ranks that each wrote and
  verified one shard) is a row like any other whose object is a manifest of shard objects
  (:mod:`flywheel.weights.shards`); loads and garbage collection follow the manifest to its shards.
- :meth:`Registry.squash` encodes one delta between any two versions, verified like a publish.
- :meth:`Registry.shipped` reports, read-only, the bytes a node moving to each version fetches,
  the average over its chain, and what each region's cache recorded pulling
  (:mod:`flywheel.weights.shipping` adds them up).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from flywheel.db.models import ModelVersion, VersionTransition
from flywheel.db.trained import record_trained, trained_ids
from flywheel.weights.codec.anchor import anchor_reader, encode_anchor, raw_bytes, read_full
from flywheel.weights.codec.container import read_delta_header
from flywheel.weights.codec.delta import apply_delta, encode_delta_with_summary
from flywheel.weights.codec.state import DeltaError, state_sha256, tensor_digests
from flywheel.weights.codec.stats import count_changed
from flywheel.weights.codec.streaming import check_delta
from flywheel.weights.codec.tensorfile import Discard
from flywheel.weights.shards import SUFFIX, check_manifest, is_manifest, load_sharded, read_manifest
from flywheel.weights.shipping import ShippedBytes, shipped_bytes
from flywheel.weights.store import RegionalCache, Store, StoreError, validate_key

State = dict[str, torch.Tensor]

STATUSES = ("candidate", "canary", "stable", "rolled_back", "retired", "collected")
_PUBLISH_ATTEMPTS = 20
#: A delta is kept only when it is below this fraction of the (compressed) anchor that would be
#: stored instead; otherwise the version is stored in full (a delta that saves little is not worth a
#: dependency on its parent chain).
DELTA_MAX_RATIO = 0.5
#: The deltas between a full anchor and a new version may add up to this fraction of an anchor.
CHAIN_MAX_RATIO = 1.0


class WeightsError(Exception):
    """Weights could not be published or reconstructed exactly (missing, corrupt, mismatched)."""


class StatusChanged(WeightsError):
    """A compare-and-set status change found another status (someone moved the version meanwhile)."""


class VersionNotFound(WeightsError, LookupError):
    """No such version in this model line."""


class LinePinned(StatusChanged):
    """The line is pinned: its status changes are frozen (``flywheel rollout unpin`` lifts the pin)."""

    def __init__(self, message: str, pin: PinInfo) -> None:
        super().__init__(message)
        self.pin = pin


@dataclass(frozen=True)
class PinInfo:
    """A line's rollout pin: ``version`` is held stable; no automatic or manual status changes."""

    model_line: str
    version: int
    by: str
    reason: str
    at: datetime

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"v{self.version} by {self.by} at {self.at.isoformat(timespec='seconds')}{why}"


@dataclass(frozen=True)
class VersionInfo:
    model_line: str
    version: int
    kind: str
    parent: int | None
    sha256: str
    store_key: str
    bytes: int
    full_bytes: int
    fraction_changed: float | None
    train_step: int | None
    metrics: dict[str, Any]
    status: str
    created_at: datetime


def _pin(row: ModelVersion) -> PinInfo:
    assert row.pinned_at is not None
    return PinInfo(row.model_line, row.version, row.pinned_by or "", row.pin_reason or "", row.pinned_at)


def _info(row: ModelVersion) -> VersionInfo:
    return VersionInfo(
        model_line=row.model_line,
        version=row.version,
        kind=row.kind,
        parent=row.parent,
        sha256=row.sha256,
        store_key=row.store_key,
        bytes=row.bytes,
        full_bytes=row.full_bytes,
        fraction_changed=row.fraction_changed,
        train_step=row.train_step,
        metrics=dict(row.metrics or {}),
        status=row.status,
        created_at=row.created_at,
    )


class Registry:
    """Versions of ``model_line``, rows through ``session_factory``, bytes in ``store``."""

    def __init__(
        self, session_factory: sessionmaker[Session], store: Store, model_line: str, full_every: int = 50,
        chain_max_ratio: float = CHAIN_MAX_RATIO, announce: Callable[[VersionInfo], None] | None = None,
    ) -> None:
        """``announce`` is called after every committed status change (e.g. to wake the nodes)."""
        validate_key(model_line)
        if full_every < 1:
            raise ValueError("full_every must be at least 1")
        if chain_max_ratio <= 0:
            raise ValueError("chain_max_ratio must be positive")
        self.chain_max_ratio = chain_max_ratio
        self.announce = announce
        self._sessions = session_factory
        self.store = store
        self.model_line = model_line
        self.full_every = full_every

    # --- reading -------------------------------------------------------------------------------

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The session factory of the registry's database (the rollout controller reads it too)."""
        return self._sessions

    def _row(self, session: Session, version: int) -> ModelVersion:
        row = session.get(ModelVersion, (self.model_line, version))
        if row is None:
            raise VersionNotFound(f"model line {self.model_line!r} has no version {version}")
        return row

    def get(self, version: int) -> VersionInfo:
        with self._sessions() as session:
            return _info(self._row(session, version))

    def latest(self, status: str | None = None) -> VersionInfo | None:
        """The highest version (with ``status``, when given), or None."""
        query = select(ModelVersion).where(ModelVersion.model_line == self.model_line)
        if status is not None:
            _check_status(status)
            query = query.where(ModelVersion.status == status)
        with self._sessions() as session:
            row = session.scalars(query.order_by(ModelVersion.version.desc()).limit(1)).first()
            return _info(row) if row is not None else None

    def ensure_base(self, state: dict[str, Any], reason: str) -> VersionInfo:
        """The line's stable version; on an empty line, publish ``state`` as a full stable version 0.

        Two callers racing on an empty line may both publish (v0 and v1, identical weights);
        harmless, and only start-up paths call this.
        """
        stable = self.latest("stable")
        if stable is not None:
            return stable
        if self.latest() is None:
            info = self.publish(state, parent=None, force_full=True, metrics={"base": reason})
            self.set_status(info.version, "stable", reason=reason)
            return self.get(info.version)
        raise WeightsError(f"model line {self.model_line!r} has versions but none is stable; promote one")

    def versions(self) -> list[VersionInfo]:
        query = select(ModelVersion).where(ModelVersion.model_line == self.model_line)
        with self._sessions() as session:
            return [_info(r) for r in session.scalars(query.order_by(ModelVersion.version))]

    def pinned(self) -> PinInfo | None:
        """The line's rollout pin, or None."""
        query = select(ModelVersion).where(ModelVersion.model_line == self.model_line,
                                           ModelVersion.pinned_at.is_not(None))
        with self._sessions() as session:
            row = session.scalars(query.limit(1)).first()
            return _pin(row) if row is not None else None

    def transitions(self, version: int | None = None) -> list[dict[str, Any]]:
        """The audit log of this line (or of one version), oldest first."""
        query = select(VersionTransition).where(VersionTransition.model_line == self.model_line)
        if version is not None:
            query = query.where(VersionTransition.version == version)
        with self._sessions() as session:
            return [
                {"version": t.version, "from_status": t.from_status, "to_status": t.to_status,
                 "reason": t.reason, "at": t.at}
                for t in session.scalars(query.order_by(VersionTransition.id))
            ]

    def shipped(self, regions: Mapping[str, RegionalCache] | None = None) -> list[ShippedBytes]:
        """Bytes shipped per version, oldest first (read-only; :func:`.shipping.shipped_bytes`).

        ``regions`` maps a region's name to its cache (a :class:`RegionalCache` over this store);
        by default the registry's own store when it reads through one."""
        if regions is None:
            regions = {self.store.region: self.store} if isinstance(self.store, RegionalCache) else {}
        return shipped_bytes(self.versions(), regions)

    # --- status --------------------------------------------------------------------------------

    def set_status(self, version: int, status: str, reason: str, *, expect: str | None = None,
                   override_pin: bool = False) -> VersionInfo:
        """Move ``version`` to ``status`` (audited). Promoting to ``stable`` retires the previous
        stable version in the same transaction. Setting the current status again is a no-op.
        ``expect``: only from that status (compare-and-set, under the line's lock); otherwise
        :class:`StatusChanged` and nothing changes. On a pinned line: :class:`LinePinned` unless
        ``override_pin``, and always for a change that would unseat the pinned version."""
        _check_status(status)
        now = datetime.now(UTC)
        changed = False
        with self._sessions() as session, session.begin():
            rows = self._lock_line(session)
            target = next((r for r in rows if r.version == version), None)
            if target is None:
                raise VersionNotFound(f"model line {self.model_line!r} has no version {version}")
            pin = next((r for r in rows if r.pinned_at is not None), None)
            if pin is not None and target.status != status:
                held = _pin(pin)
                if not override_pin:
                    raise LinePinned(f"model line {self.model_line!r} is pinned to {held.describe()}; "
                                     f"status changes are frozen until it is unpinned", held)
                if status == "stable" or target is pin:  # another stable version, or the pinned one off stable
                    raise LinePinned(f"model line {self.model_line!r} is pinned to {held.describe()}; "
                                     f"move the pin (pin another version) or unpin first", held)
            if expect is not None and target.status != expect:
                raise StatusChanged(f"version {version} is {target.status}, not {expect}")
            if target.status == status:
                return _info(target)
            changed = True
            self._move(session, rows, target, status, reason, now)
            session.flush()
            info = _info(target)
        if changed and self.announce is not None:
            self.announce(info)
        return info

    def pin(self, version: int, *, by: str, reason: str = "", verify: bool = True) -> tuple[PinInfo, list[VersionInfo]]:
        """Pin the line to ``version``: make it stable (unless it is), end a running canary (back to
        ``candidate``), move an existing pin, all in one audited transaction. Any version but a
        collected one; unless it is already stable its weights are first rebuilt and checked
        against its hash (``verify``). Returns the pin and the versions whose status changed."""
        info = self.get(version)
        if info.status == "collected":
            raise WeightsError(f"version {version} was garbage-collected; its weights are gone")
        if verify and info.status != "stable":
            self.load(version)  # raises WeightsError unless the weights rebuild to the recorded hash
        now = datetime.now(UTC)
        who = f"pinned by {by}" + (f": {reason}" if reason else "")
        with self._sessions() as session, session.begin():
            rows = self._lock_line(session)
            target = next((r for r in rows if r.version == version), None)
            if target is None:
                raise VersionNotFound(f"model line {self.model_line!r} has no version {version}")
            if target.status == "collected":  # collected meanwhile
                raise WeightsError(f"version {version} was garbage-collected; its weights are gone")
            changed: list[ModelVersion] = []
            for row in rows:
                if row is not target and row.pinned_at is not None:  # a moved pin: the row is retired below
                    row.pinned_at, row.pinned_by, row.pin_reason = None, None, None
                if row is not target and row.status == "canary":
                    session.add(self._transition(row.version, "canary", "candidate",
                                                 f"canary ended: line pinned to v{version} by {by}", now))
                    row.status = "candidate"
                    changed.append(row)
            session.flush()  # the old pin is gone before the new one is written (the unique index)
            if target.status != "stable":
                self._move(session, rows, target, "stable", who, now, superseded=f"superseded by v{version} ({who})")
                changed.append(target)
            else:
                session.add(self._transition(version, "stable", "stable", who, now))
            target.pinned_at, target.pinned_by, target.pin_reason = now, by, reason
            session.flush()
            pin = _pin(target)
            infos = [_info(r) for r in changed]
        if self.announce is not None:
            for changed_info in infos:
                self.announce(changed_info)
        return pin, infos

    def unpin(self, *, by: str, reason: str = "") -> PinInfo | None:
        """Lift the line's pin (audited); returns the pin lifted, or None when there was none."""
        now = datetime.now(UTC)
        with self._sessions() as session, session.begin():
            rows = self._lock_line(session)
            row = next((r for r in rows if r.pinned_at is not None), None)
            if row is None:
                return None
            lifted = _pin(row)
            why = f"unpinned by {by}" + (f": {reason}" if reason else "") + f" (pinned by {lifted.by})"
            session.add(self._transition(row.version, row.status, row.status, why, now))
            row.pinned_at, row.pinned_by, row.pin_reason = None, None, None
        return lifted

    def _lock_line(self, session: Session) -> list[ModelVersion]:
        """Every row of the line, locked (PostgreSQL; SQLite transactions are BEGIN IMMEDIATE), so
        two promotions cannot both leave a stable version and a pin never races a status change."""
        return list(session.scalars(
            select(ModelVersion)
            .where(ModelVersion.model_line == self.model_line)
            .order_by(ModelVersion.version)
            .with_for_update()
        ).all())

    def _move(self, session: Session, rows: list[ModelVersion], target: ModelVersion, status: str, reason: str,
              now: datetime, superseded: str | None = None) -> None:
        if status == "stable":
            for row in rows:
                if row.status == "stable" and row is not target:
                    why = superseded or f"superseded by v{target.version}"
                    session.add(self._transition(row.version, "stable", "retired", why, now))
                    row.status = "retired"
        session.add(self._transition(target.version, target.status, status, reason, now))
        target.status = status

    def _transition(self, version: int, old: str | None, new: str, reason: str, at: datetime) -> VersionTransition:
        return VersionTransition(
            model_line=self.model_line, version=version, from_status=old, to_status=new, reason=reason, at=at
        )

    # --- publishing ----------------------------------------------------------------------------

    def publish(
        self,
        state: State,
        *,
        parent: int | None,
        parent_state: State | None = None,
        train_step: int | None = None,
        metrics: dict[str, Any] | None = None,
        force_full: bool = False,
    ) -> VersionInfo:
        """Store ``state`` as the next version (status ``candidate``) and return it.

        A delta against ``parent`` when it is allowed (not ``force_full``, not an anchor version)
        and pays (:meth:`_delta_pays`); otherwise a full version, a compressed anchor.
        ``parent_state`` must be the parent's weights (checked by hash); it is loaded from the
        registry when omitted. The trajectories ``metrics["trajectory_ids"]`` lists (strings) are
        recorded as trained into the version (:mod:`flywheel.db.trained`) with its row.
        """
        trained = trained_ids(metrics)  # checked before anything is uploaded
        digests = tensor_digests(state)  # each tensor hashed once: for the state's hash and a full version's anchor
        sha = state_sha256(state, digests)
        full_bytes = raw_bytes(state)
        anchor_blob: bytes | None = None
        parent_sha: str | None = None
        if parent is not None:
            parent_sha = self.get(parent).sha256
            if parent_state is not None and state_sha256(parent_state) != parent_sha:
                raise WeightsError(f"parent_state does not match version {parent}'s recorded hash")
        fraction: float | None = None
        delta_blob: bytes | None = None

        for _ in range(_PUBLISH_ATTEMPTS):
            version = self._next_version()
            anchor = parent is None or force_full or version % self.full_every == 0
            if not anchor and delta_blob is None:
                if parent_state is None:
                    assert parent is not None
                    parent_state = self.load(parent)
                delta_blob, summary = encode_delta_with_summary(
                    parent_state, state, old_sha256=parent_sha, new_sha256=sha
                )
                fraction = summary.fraction_changed
            if fraction is None and parent_state is not None:
                changed, elements = count_changed(parent_state, state)
                fraction = changed / elements if elements else 0.0
            pays = not anchor and delta_blob is not None and parent is not None \
                and self._delta_pays(parent, len(delta_blob), full_bytes)
            kind = "delta" if pays else "full"
            if kind == "full" and anchor_blob is None:
                anchor_blob = encode_anchor(state, digests)
            data = delta_blob if kind == "delta" else anchor_blob
            assert data is not None
            key = f"{self.model_line}/v{version:08d}-{secrets.token_hex(4)}.{kind}"
            self.store.put(key, data)
            try:
                self._verify_object(key, kind, sha, parent_state, parent_sha)
                return self._insert(ModelVersion(
                    model_line=self.model_line, version=version, kind=kind, parent=parent, sha256=sha, store_key=key,
                    bytes=len(data), full_bytes=full_bytes, fraction_changed=fraction, train_step=train_step,
                    metrics=dict(metrics or {}), status="candidate", created_at=datetime.now(UTC)), trained)
            except IntegrityError:
                self.store.delete(key)  # another publisher took this number: try the next one
            except BaseException:
                self.store.delete(key)
                raise
        raise WeightsError(
            f"could not allocate a version number for {self.model_line!r} after {_PUBLISH_ATTEMPTS} attempts"
        )

    def _insert(self, row: ModelVersion, trained: list[str]) -> VersionInfo:
        """Insert a published version's row, its audit row and its trained trajectories, at once."""
        with self._sessions() as session, session.begin():
            session.add(row)
            session.add(self._transition(row.version, None, "candidate", f"published ({row.kind})", row.created_at))
            session.flush()
            record_trained(session, self.model_line, row.version, trained, row.created_at)
            return _info(row)

    def sharded_kind(self, parent: int | None, delta_bytes: int | None = None, full_bytes: int = 0) -> str:
        """What the next sharded version on ``parent`` is stored as (trainer/shard_publish.py asks
        before its ranks encode, and again with the shards' total ``delta_bytes``): ``full`` when it
        must be an anchor or a delta of that size does not pay (:meth:`_delta_pays`), else ``delta``."""
        if parent is None or self._next_version() % self.full_every == 0:
            return "full"
        if delta_bytes is not None and not self._delta_pays(parent, delta_bytes, full_bytes):
            return "full"
        return "delta"

    def publish_manifest(self, manifest: bytes, *, parent: int | None, train_step: int | None = None,
                         metrics: dict[str, Any] | None = None) -> VersionInfo:
        """Store a sharded version (:mod:`.shards`: its shards uploaded and each read back and
        rebuilt by the rank that wrote it) as the next version: the manifest is uploaded, read back
        and checked to compose to its hash, with every shard present, and then the row is inserted.
        A delta manifest must be on ``parent`` (its recorded hash) and never lands on an anchor number."""
        trained = trained_ids(metrics)
        parsed = read_manifest(manifest)
        if parsed.kind == "delta" and (parent is None or self.get(parent).sha256 != parsed.base_sha256):
            raise WeightsError(f"the sharded delta is not on version {parent}'s recorded hash")
        for _ in range(_PUBLISH_ATTEMPTS):
            version = self._next_version()
            if parsed.kind == "delta" and version % self.full_every == 0:
                raise WeightsError(f"v{version} must be an anchor; the sharded delta was planned for another number")
            key = f"{self.model_line}/v{version:08d}-{secrets.token_hex(4)}.{parsed.kind}{SUFFIX}"
            self.store.put(key, manifest)
            try:
                check_manifest(self.store, key, parsed.sha256)
                return self._insert(ModelVersion(
                    model_line=self.model_line, version=version, kind=parsed.kind, parent=parent, sha256=parsed.sha256,
                    store_key=key, bytes=len(manifest) + parsed.stored_bytes, full_bytes=parsed.raw_bytes,
                    fraction_changed=parsed.fraction_changed, train_step=train_step, metrics=dict(metrics or {}),
                    status="candidate", created_at=datetime.now(UTC)), trained)
            except IntegrityError:
                self.store.delete(key)
            except DeltaError as exc:
                self.store.delete(key)
                raise WeightsError(f"sharded version {key!r} failed verification: {exc}") from exc
            except BaseException:
                self.store.delete(key)
                raise
        raise WeightsError(
            f"could not allocate a version number for {self.model_line!r} after {_PUBLISH_ATTEMPTS} attempts"
        )

    def _delta_pays(self, parent: int, delta_bytes: int, full_bytes: int) -> bool:
        """Whether a delta of ``delta_bytes`` on ``parent`` beats storing the state (``full_bytes``
        raw) as a new anchor: under ``DELTA_MAX_RATIO`` of that anchor, and with the deltas since
        the chain's anchor under ``chain_max_ratio`` of it. The new anchor's size is estimated from
        the chain's anchor (stored bytes per raw byte; 1 for one stored as plain safetensors)."""
        chain = 0
        with self._sessions() as session:
            row = self._row(session, parent)
            while row.kind == "delta" and row.parent is not None:
                chain += row.bytes
                row = self._row(session, row.parent)
            ratio = row.bytes / row.full_bytes if row.full_bytes > 0 else 1.0
        anchor_bytes = ratio * full_bytes
        return delta_bytes < DELTA_MAX_RATIO * anchor_bytes and chain + delta_bytes <= self.chain_max_ratio * anchor_bytes

    def _next_version(self) -> int:
        with self._sessions() as session:
            current = session.scalar(
                select(func.max(ModelVersion.version)).where(ModelVersion.model_line == self.model_line)
            )
        return 0 if current is None else current + 1

    def _verify_object(
        self, key: str, kind: str, sha: str, parent_state: State | None, parent_sha: str | None
    ) -> None:
        """Read the object back and rebuild the weights from it, tensor by tensor (each hashed and
        dropped: the check never holds a second state); raise unless the hash matches."""
        try:
            data = self.store.get(key)
            if kind == "full":  # each tensor checked against its digest, the state hash built from them
                anchor = anchor_reader(data)
                got = anchor.decode_into(Discard(anchor.layout))
            else:
                assert parent_state is not None and parent_sha is not None
                got = check_delta(parent_state, data, old_sha256=parent_sha)  # checks the target hash
        except (StoreError, DeltaError) as exc:
            raise WeightsError(f"published object {key!r} failed verification: {exc}") from exc
        if got != sha:
            raise WeightsError(f"published object {key!r} rebuilds to {got[:12]}, expected {sha[:12]}")

    # --- loading -------------------------------------------------------------------------------

    def chain(self, version: int, base_version: int | None = None) -> tuple[VersionInfo, list[VersionInfo]]:
        """Where ``version``'s weights are rebuilt from: ``base_version`` when it is on the chain,
        else the nearest full version; and the deltas to apply on it, oldest first."""
        chain: list[VersionInfo] = []
        seen: set[int] = set()
        with self._sessions() as session:
            current = _info(self._row(session, version))
            while current.version != base_version and current.kind != "full":
                if current.kind != "delta" or current.parent is None:
                    raise WeightsError(f"version {current.version} is a {current.kind!r} with parent {current.parent}")
                if current.version in seen or current.parent >= current.version:
                    raise WeightsError(f"version chain of {version} is not strictly decreasing at {current.version}")
                seen.add(current.version)
                chain.append(current)
                try:
                    current = _info(self._row(session, current.parent))
                except VersionNotFound as exc:
                    raise WeightsError(f"version {version} needs missing parent: {exc}") from exc
        return current, chain[::-1]

    def load(self, version: int, *, base: tuple[int, State] | None = None) -> State:
        """The weights of ``version``, rebuilt from the nearest full anchor, or from ``base``
        (``(base_version, base_state)``) when that version is on the chain; every step's hash is
        checked against its row."""
        start, chain = self.chain(version, base[0] if base is not None else None)
        if base is not None and start.version == base[0]:
            state = base[1]
            if state_sha256(state) != start.sha256:
                raise WeightsError(f"base state does not match version {start.version}'s recorded hash")
            if not chain:
                return {name: t.detach().cpu().clone() for name, t in state.items()}
        else:
            state = self._rebuild(start, None, None)

        state_sha = start.sha256
        for info in chain:
            state = self._rebuild(info, state, state_sha)
            state_sha = info.sha256
        return state

    def _rebuild(self, info: VersionInfo, base: State | None, base_sha: str | None) -> State:
        """One version's weights from its object: an anchor, or a delta on ``base`` (hash
        ``base_sha``), or a manifest of either's shards (:mod:`.shards`); the row's hash checked."""
        data = self.fetch(info)
        try:
            if is_manifest(info.store_key):
                return load_sharded(self.store, data, sha256=info.sha256, base=base, base_sha256=base_sha)
            if info.kind == "full":
                state, got = read_full(data)
                if got != info.sha256:
                    raise DeltaError("does not match its recorded hash")
                return state
            if base is None or read_delta_header(data)[0].target_sha256 != info.sha256:
                raise DeltaError("delta's target hash differs from the registry's")
            return apply_delta(base, data, old_sha256=base_sha)
        except DeltaError as exc:
            raise WeightsError(f"version {info.version} ({info.store_key}): {exc}") from exc

    def fetch(self, info: VersionInfo, span: tuple[int, int] | None = None) -> bytes:
        """The object a version's row points at, or its ``span`` (offset, length: a range read);
        unchecked: the caller checks what it rebuilds."""
        if info.status == "collected":
            raise WeightsError(f"version {info.version} was garbage-collected; its weights are gone")
        try:
            return self.store.get(info.store_key) if span is None else self.store.get_range(info.store_key, *span)
        except StoreError as exc:
            raise WeightsError(f"version {info.version}: object {info.store_key!r} unavailable: {exc}") from exc

    # --- squash and the garbage collector's mark ------------------------------------------------

    def squash(self, old: int, new: int) -> bytes:
        """One delta that turns version ``old`` into version ``new`` (any two versions of the line,
        either order), checked by applying it before it is returned."""
        old_info, new_info = self.get(old), self.get(new)
        old_state = self.load(old)
        new_state = self.load(new, base=(old, old_state)) if new > old else self.load(new)
        delta, _ = encode_delta_with_summary(old_state, new_state, old_sha256=old_info.sha256,
                                             new_sha256=new_info.sha256)
        try:
            apply_delta(old_state, delta, old_sha256=old_info.sha256)
        except DeltaError as exc:  # pragma: no cover - the codec's own invariant
            raise WeightsError(f"squashed delta v{old} -> v{new} does not rebuild v{new}: {exc}") from exc
        return delta

    def mark_collected(self, info: VersionInfo) -> bool:
        """Set version ``info.version`` to ``collected`` (audited) unless its status changed since
        ``info`` was read (promoted, or collected meanwhile); whether it did. Garbage collection
        (:mod:`flywheel.weights.collect`) deletes the objects after this, so a load never finds
        half a version."""
        with self._sessions() as session, session.begin():
            row = session.get(ModelVersion, (self.model_line, info.version), with_for_update=True)
            if row is None or row.status != info.status:
                return False
            session.add(self._transition(info.version, row.status, "collected", "garbage collection", datetime.now(UTC)))
            row.status = "collected"
        return True


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}; expected one of {', '.join(STATUSES)}")
