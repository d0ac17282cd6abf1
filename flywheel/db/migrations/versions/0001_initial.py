"""Initial schema: raw events, sessions, trajectories, scores, model versions, audit log, nodes.

Hand-written to match ``flywheel/db/models.py`` exactly (names come from its naming convention);
tests/integration/test_db.py compares the migrated schema with the models on both databases.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _bigid() -> sa.Column:
    # BIGINT on PostgreSQL; INTEGER on SQLite so the column is the rowid alias that autoincrements.
    return sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False)


def upgrade() -> None:
    op.create_table(
        "generations",
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("generation_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(128), nullable=False),
        _ts("ts"),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_generations")),
        sa.UniqueConstraint("generation_id", name=op.f("uq_generations_generation_id")),
    )
    op.create_index("ix_generations_session", "generations", ["tenant", "session_id"])

    op.create_table(
        "feedback",
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("feedback_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("generation_id", sa.String(128), nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("signal", sa.String(64), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        _ts("ts"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_feedback")),
        sa.UniqueConstraint("tenant", "feedback_id", name=op.f("uq_feedback_tenant_feedback_id")),
    )
    op.create_index("ix_feedback_session", "feedback", ["tenant", "session_id"])

    op.create_table(
        "sessions",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("last_event_at"),
        _ts("closed_at", nullable=True),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "session_id", name=op.f("pk_sessions")),
    )
    op.create_index("ix_sessions_status", "sessions", ["status", "last_event_at"])

    op.create_table(
        "trajectories",
        _bigid(),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("closed_reason", sa.String(32), nullable=False),
        _ts("ts"),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trajectories")),
        sa.UniqueConstraint("event_id", name=op.f("uq_trajectories_event_id")),
        sa.UniqueConstraint("trajectory_id", "revision", name=op.f("uq_trajectory_revision")),
    )

    op.create_table(
        "scored_trajectories",
        _bigid(),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("reward_spec_version", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("total_reward", sa.Float(), nullable=False),
        _ts("ts"),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scored_trajectories")),
        sa.UniqueConstraint("event_id", name=op.f("uq_scored_trajectories_event_id")),
        sa.UniqueConstraint(
            "trajectory_id", "revision", "reward_spec_version", name=op.f("uq_scored_revision_spec")
        ),
    )

    op.create_table(
        "model_versions",
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("store_key", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("full_bytes", sa.BigInteger(), nullable=False),
        sa.Column("fraction_changed", sa.Float(), nullable=True),
        sa.Column("train_step", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("model_line", "version", name=op.f("pk_model_versions")),
    )

    op.create_table(
        "version_transitions",
        _bigid(),
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=True),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        _ts("at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_version_transitions")),
    )

    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(128), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("live_version", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        _ts("last_heartbeat"),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_nodes")),
    )


def downgrade() -> None:
    op.drop_table("nodes")
    op.drop_table("version_transitions")
    op.drop_table("model_versions")
    op.drop_table("scored_trajectories")
    op.drop_table("trajectories")
    op.drop_index("ix_sessions_status", table_name="sessions")
    op.drop_table("sessions")
    op.drop_index("ix_feedback_session", table_name="feedback")
    op.drop_table("feedback")
    op.drop_index("ix_generations_session", table_name="generations")
    op.drop_table("generations")
