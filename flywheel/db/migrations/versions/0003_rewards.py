"""Rewards: the reward specs used (version -> fingerprint) and per-version reward stats with anomaly flags.

Hand-written to match ``RewardSpecRow`` and ``RewardVersionStats`` in ``flywheel/db/models.py``;
tests/integration/test_db.py compares the migrated schema with the models and downgrades it.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "reward_specs",
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_reward_specs")),
    )
    op.create_table(
        "reward_version_stats",
        sa.Column("model_line", sa.String(128), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("reward_spec_version", sa.String(64), nullable=False),
        sa.Column("train_count", sa.Integer(), nullable=False),
        sa.Column("train_sum", sa.Float(), nullable=False),
        sa.Column("held_out_count", sa.Integer(), nullable=False),
        sa.Column("held_out_sum", sa.Float(), nullable=False),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("flag_reason", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_line", "model_version", "reward_spec_version", name=op.f("pk_reward_version_stats")),
    )


def downgrade() -> None:
    op.drop_table("reward_version_stats")
    op.drop_table("reward_specs")
