"""Tombstoned sessions: ``erasure_sessions``, the sessions an erasure covers, for the stages that
see only a session id (``flywheel/tombstones.py``). Hand-written to match ``ErasureSession`` in
``flywheel/db/models.py``; tests/integration/test_db.py compares the migrated schema with the models
and downgrades it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "erasure_sessions",
        sa.Column("erasure_id", sa.Integer(), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("added_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("erasure_id", "tenant", "session_id", name="pk_erasure_sessions"),
    )
    op.create_index("ix_erasure_sessions_added_at", "erasure_sessions", ["added_at"])
    op.create_index("ix_erasure_sessions_trajectory_id", "erasure_sessions", ["trajectory_id"])


def downgrade() -> None:
    op.drop_index("ix_erasure_sessions_trajectory_id", table_name="erasure_sessions")
    op.drop_index("ix_erasure_sessions_added_at", table_name="erasure_sessions")
    op.drop_table("erasure_sessions")
