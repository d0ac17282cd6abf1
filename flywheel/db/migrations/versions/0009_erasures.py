"""Erasure requests: ``erasures``, each subject's tombstone, deletion state and audit
(``flywheel/erasure.py``). Hand-written to match ``Erasure`` in ``flywheel/db/models.py``;
tests/integration/test_db.py compares the migrated schema with the models and downgrades it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "erasures",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("user_hash", sa.String(64), nullable=True),
        sa.Column("session_id", sa.String(256), nullable=True),
        sa.Column("requested_by", sa.String(128), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("counts", sa.JSON(), nullable=False),
        sa.Column("trained_into", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_erasures"),
    )
    op.create_index("ix_erasures_subject", "erasures", ["tenant", "user_hash", "session_id"])
    op.create_index("ix_erasures_state", "erasures", ["state"])


def downgrade() -> None:
    op.drop_index("ix_erasures_state", table_name="erasures")
    op.drop_index("ix_erasures_subject", table_name="erasures")
    op.drop_table("erasures")
