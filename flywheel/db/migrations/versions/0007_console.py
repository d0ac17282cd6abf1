"""The operator console: which version each trajectory was trained into, the indexes of its look-ups,
and the rollout controller's latest decision per line.

``trained_trajectories`` (one row per trajectory id: its model line, version and when that version
was published) is created and backfilled from every existing version's
``model_versions.metrics["trajectory_ids"]``, in Python over the rows, a chunk at a time (JSON
functions differ between PostgreSQL and SQLite). Ids that are not strings of 1 to 128 characters are
skipped (the registry refuses them since); an id listed by two versions keeps the first (lowest
version of its line), as the registry's insert-or-ignore does from now on.

Then the indexes of the console's hot paths: a tenant's recent sessions, a session by id, a
session's trajectories, a version's audit trail, a line's
versions by status, a generation's feedback. Last, ``rollout_decisions`` (one row per model line,
rewritten by the rollout role each tick). Hand-written to match ``flywheel/db/models.py``;
tests/integration/test_db.py compares the migrated schema with the models and downgrades it.

Revision ID: 0007
Revises: 0006
Create Date: 2025-03-05 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: ``(index, table, columns)``, created in this order and dropped in the reverse one.
INDEXES = (
    ("ix_sessions_tenant_recent", "sessions", ["tenant", "last_event_at"]),
    ("ix_sessions_session_id", "sessions", ["session_id"]),
    ("ix_trajectories_session", "trajectories", ["tenant", "session_id"]),
    ("ix_version_transitions_version", "version_transitions", ["model_line", "version"]),
    ("ix_model_versions_status", "model_versions", ["model_line", "status"]),
    ("ix_feedback_generation", "feedback", ["generation_id"]),
)
#: Versions read per chunk of the backfill.
CHUNK = 500
MAX_ID_LENGTH = 128

# The tables as this revision knows them (not the models, which later revisions may change).
VERSIONS = sa.table(
    "model_versions", sa.column("model_line", sa.String()), sa.column("version", sa.Integer()),
    sa.column("metrics", sa.JSON()), sa.column("created_at", sa.DateTime(timezone=True)),
)
TRAINED = sa.table(
    "trained_trajectories", sa.column("trajectory_id", sa.String()), sa.column("model_line", sa.String()),
    sa.column("version", sa.Integer()), sa.column("trained_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    op.create_table(
        "trained_trajectories",
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("trained_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("trajectory_id", name="pk_trained_trajectories"),
    )
    op.create_index("ix_trained_trajectories_version", "trained_trajectories", ["model_line", "version"])
    _backfill(op.get_bind())
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns)
    op.create_table(
        "rollout_decisions",
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_line", name="pk_rollout_decisions"),
    )


def downgrade() -> None:
    op.drop_table("rollout_decisions")
    for name, table, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
    op.drop_index("ix_trained_trajectories_version", table_name="trained_trajectories")
    op.drop_table("trained_trajectories")


def _ids(metrics: Any) -> list[str]:
    ids = metrics.get("trajectory_ids") if isinstance(metrics, dict) else None
    if not isinstance(ids, list):
        return []
    return [i for i in ids if isinstance(i, str) and 0 < len(i) <= MAX_ID_LENGTH]


def _backfill(conn: sa.Connection) -> None:
    """One row per trajectory id listed in a version's metrics, versions in (line, version) order,
    read ``CHUNK`` at a time by key (never the whole table in memory); insert-or-ignore, so the
    first version that lists an id keeps it."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    after: tuple[str, int] | None = None
    while True:
        query = sa.select(VERSIONS).order_by(VERSIONS.c.model_line, VERSIONS.c.version).limit(CHUNK)
        if after is not None:
            query = query.where(sa.tuple_(VERSIONS.c.model_line, VERSIONS.c.version) > sa.tuple_(*after))
        rows = conn.execute(query).all()
        if not rows:
            return
        batch: dict[str, dict[str, Any]] = {}  # an id twice in the chunk: the first version keeps it
        for row in rows:
            for tid in _ids(row.metrics):
                batch.setdefault(tid, {"trajectory_id": tid, "model_line": row.model_line, "version": row.version,
                                       "trained_at": row.created_at})
        if batch:  # an id of an earlier chunk: already there, ignored
            conn.execute(insert(TRAINED).on_conflict_do_nothing(), list(batch.values()))
        after = (rows[-1].model_line, rows[-1].version)
