"""SQLAlchemy 2 models: every table flywheel keeps. Alembic revisions in ``flywheel/db/migrations/`` own the schema.

Invariants:
- Raw events (generations, feedback) are keyed by their ``event_id``; inserting one twice is a no-op,
  so replaying a topic never duplicates a row.
- The full event is kept as JSON in ``payload`` so every trajectory and score can be rebuilt from
  raw events; the other columns are for filtering and joins.
- Rows are portable between PostgreSQL (production) and SQLite (embedded). Timestamps are stored in
  UTC and always read back timezone-aware (SQLite keeps no zone, so :class:`UTCDateTime` restores it).
- Every constraint and index has a deterministic name (``NAMING_CONVENTION``), so later migrations can
  drop or alter them on both databases (SQLite batch mode needs the names).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """``TIMESTAMP WITH TIME ZONE``: writes aware datetimes as UTC, reads them back aware (UTC).

    Naive datetimes are rejected on write: a zone-less timestamp is a bug waiting for a server move.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: flywheel stores timezone-aware timestamps only")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict: JSON}


class Generation(Base):
    __tablename__ = "generations"

    event_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    generation_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(256))
    model_line: Mapped[str] = mapped_column(String(128))
    model_version: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(128))
    ts: Mapped[datetime]
    payload: Mapped[dict] = mapped_column(JSON)
    #: The keyed hash of the end user the request named (``flywheel/identity.py``); None: none named.
    user_hash: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        Index("ix_generations_session", "tenant", "session_id"),
        # A user's generations (what erasing a user by id finds).
        Index("ix_generations_user", "tenant", "user_hash"),
        # The rollout controller compares versions over a window: generations per version since a time.
        Index("ix_generations_version", "model_line", "model_version", "ts"),
        Index("ix_generations_ts", "ts"),  # the retention job: the oldest rows first (flywheel/retention.py)
    )


class Feedback(Base):
    __tablename__ = "feedback"

    event_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    feedback_id: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(256))
    generation_id: Mapped[str | None] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))
    signal: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None] = mapped_column(Float)
    ts: Mapped[datetime]
    #: pending (session open), joined (part of an emitted trajectory), expired (after the horizon)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    payload: Mapped[dict] = mapped_column(JSON)

    __table_args__ = (
        UniqueConstraint("tenant", "feedback_id", name="uq_feedback_tenant_feedback_id"),
        Index("ix_feedback_session", "tenant", "session_id"),
        Index("ix_feedback_generation", "generation_id"),  # the feedback a generation got (console)
        Index("ix_feedback_ts", "ts"),  # the retention job
    )


class SessionState(Base):
    """Ingest's view of one session: open until an outcome or inactivity closes it."""

    __tablename__ = "sessions"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="open")
    last_event_at: Mapped[datetime]
    closed_at: Mapped[datetime | None]
    revision: Mapped[int] = mapped_column(Integer, default=0)

    __table_args__ = (
        Index("ix_sessions_status", "status", "last_event_at"),
        # The operator console: a tenant's recent sessions, and a session found by its id alone.
        Index("ix_sessions_tenant_recent", "tenant", "last_event_at"),
        Index("ix_sessions_session_id", "session_id"),
    )


class Trajectory(Base):
    __tablename__ = "trajectories"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(String(128))
    revision: Mapped[int] = mapped_column(Integer)
    event_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[str] = mapped_column(String(256))
    model_line: Mapped[str] = mapped_column(String(128))
    closed_reason: Mapped[str] = mapped_column(String(32))
    ts: Mapped[datetime]
    payload: Mapped[dict] = mapped_column(JSON)

    __table_args__ = (
        UniqueConstraint("trajectory_id", "revision", name="uq_trajectory_revision"),
        # The operator console: a session's trajectories (by id: uq_trajectory_revision's prefix).
        Index("ix_trajectories_session", "tenant", "session_id"),
        Index("ix_trajectories_ts", "ts"),  # the retention job
    )


class ScoredTrajectoryRow(Base):
    __tablename__ = "scored_trajectories"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(String(128))
    revision: Mapped[int] = mapped_column(Integer)
    reward_spec_version: Mapped[str] = mapped_column(String(64))
    event_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant: Mapped[str] = mapped_column(String(128))
    total_reward: Mapped[float] = mapped_column(Float)
    ts: Mapped[datetime]
    payload: Mapped[dict] = mapped_column(JSON)

    __table_args__ = (
        UniqueConstraint("trajectory_id", "revision", "reward_spec_version", name="uq_scored_revision_spec"),
        Index("ix_scored_trajectories_ts", "ts"),  # the retention job
    )


class RewardSpecRow(Base):
    """Every reward spec version used, with the fingerprint (sha256 of the resolved spec) it names forever."""

    __tablename__ = "reward_specs"

    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime]


class RewardVersionStats(Base):
    """Per model version and reward spec: total-reward sums of the trajectories the version served
    (their last turn), training and held-out apart, and the anomaly verdict (rewards/guards.py)."""

    __tablename__ = "reward_version_stats"

    model_line: Mapped[str] = mapped_column(String(128), primary_key=True)
    model_version: Mapped[int] = mapped_column(Integer, primary_key=True)
    reward_spec_version: Mapped[str] = mapped_column(String(64), primary_key=True)
    train_count: Mapped[int] = mapped_column(Integer, default=0)
    train_sum: Mapped[float] = mapped_column(Float, default=0.0)
    held_out_count: Mapped[int] = mapped_column(Integer, default=0)
    held_out_sum: Mapped[float] = mapped_column(Float, default=0.0)
    flagged: Mapped[bool] = mapped_column(Boolean, default=False)
    flag_reason: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime]


class ModelVersion(Base):
    __tablename__ = "model_versions"

    model_line: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))  # full | delta
    parent: Mapped[int | None] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    store_key: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    full_bytes: Mapped[int] = mapped_column(BigInteger)
    fraction_changed: Mapped[float | None] = mapped_column(Float)
    train_step: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    #: candidate | canary | stable | rolled_back | retired | collected
    status: Mapped[str] = mapped_column(String(16), default="candidate")
    created_at: Mapped[datetime]
    #: The rollout pin (``flywheel rollout pin``): set on the one version of the line that the pin
    #: holds stable (who, when, why); NULL everywhere on an unpinned line. Pin and unpin are audited
    #: in ``version_transitions``.
    pinned_at: Mapped[datetime | None]
    pinned_by: Mapped[str | None] = mapped_column(String(256))
    pin_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # At most one pinned version per line (the registry also writes pins under the line's lock).
        Index("uq_model_versions_pinned", "model_line", unique=True,
              postgresql_where=text("pinned_at IS NOT NULL"), sqlite_where=text("pinned_at IS NOT NULL")),
        Index("ix_model_versions_status", "model_line", "status"),  # a line's versions in one status
    )


class VersionTransition(Base):
    """Audit log: every status change of every version, with who/why."""

    __tablename__ = "version_transitions"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    model_line: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    from_status: Mapped[str | None] = mapped_column(String(16))
    to_status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    at: Mapped[datetime]

    __table_args__ = (Index("ix_version_transitions_version", "model_line", "version"),)  # one version's audit trail


class TrainedTrajectory(Base):
    """Which version each trajectory was trained into: the ``trajectory_ids`` of a version's
    ``metrics``, one row per id, written in the transaction that inserts that ``model_versions``
    row (``flywheel/db/trained.py``). An id is trained into at most one version; should one be
    listed again, the first version keeps it."""

    __tablename__ = "trained_trajectories"

    trajectory_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model_line: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    #: When the version was published (its ``model_versions.created_at``).
    trained_at: Mapped[datetime]

    __table_args__ = (Index("ix_trained_trajectories_version", "model_line", "version"),)


class Node(Base):
    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    region: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(512))
    model_line: Mapped[str] = mapped_column(String(128))
    live_version: Mapped[int | None] = mapped_column(Integer)
    #: serving | updating | failed_update
    status: Mapped[str] = mapped_column(String(32), default="serving")
    detail: Mapped[str] = mapped_column(Text, default="")
    last_heartbeat: Mapped[datetime]


class ApiKey(Base):
    """A tenant's (or an admin's) API key. Only the SHA-256 of the whole key is stored (flywheel/keys.py)."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    #: tenant | admin
    role: Mapped[str] = mapped_column(String(16), default="tenant")
    #: sha256 hex of the whole key ``fwk_<key_id>_<secret>``
    key_sha256: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    #: Requests per minute for this key; NULL: the gateway's ``rate_limit_rpm`` applies.
    rate_limit_rpm: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (Index("ix_api_keys_tenant", "tenant"),)


class RolloutDecisionRow(Base):
    """The rollout controller's latest decision per model line (``serving/rollout_record.py``):
    rewritten every tick, read by the operator console."""

    __tablename__ = "rollout_decisions"

    model_line: Mapped[str] = mapped_column(String(128), primary_key=True)
    #: none | wait | canary | promote | rollback | pinned
    action: Mapped[str] = mapped_column(String(16))
    version: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text, default="")
    figures: Mapped[dict] = mapped_column(JSON, default=dict)
    decided_at: Mapped[datetime]


class Erasure(Base):
    """One erasure request (``flywheel/erasure.py``): the subject's tombstone from the moment it is
    written, the state of the deletion (it resumes after a crash), and its audit."""

    __tablename__ = "erasures"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128))
    #: Exactly one of the two names the subject: an end user's keyed hash, or a session.
    user_hash: Mapped[str | None] = mapped_column(String(64))
    session_id: Mapped[str | None] = mapped_column(String(256))
    requested_by: Mapped[str] = mapped_column(String(128))
    requested_at: Mapped[datetime]
    #: pending (rows still to delete) | done
    state: Mapped[str] = mapped_column(String(16), default="pending")
    completed_at: Mapped[datetime | None]
    #: Rows deleted per kind, and the versions the subject's trajectories had been trained into.
    counts: Mapped[dict] = mapped_column(JSON, default=dict)
    trained_into: Mapped[list] = mapped_column(JSON, default=list)

    __table_args__ = (Index("ix_erasures_subject", "tenant", "user_hash", "session_id"),
                      Index("ix_erasures_state", "state"),
                      Index("ix_erasures_requested_at", "requested_at"))  # the stages' tombstone reads


class ErasureSession(Base):
    """A session an erasure covers (``flywheel/tombstones.py``): the subject's sessions when it was
    requested, and those a stage found in flight later. Every record of such a session is dropped,
    whenever it was sent: a later turn's prompt carries the earlier ones."""

    __tablename__ = "erasure_sessions"

    erasure_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    #: The session's trajectory id (``flywheel.events.trajectory_id_for``): how its scored and
    #: trained rows are found once its trajectories are gone.
    trajectory_id: Mapped[str] = mapped_column(String(128))
    added_at: Mapped[datetime]

    __table_args__ = (Index("ix_erasure_sessions_added_at", "added_at"),
                      Index("ix_erasure_sessions_trajectory_id", "trajectory_id"))
