"""Generations by (model line, version, time): the rollout controller's canary window queries.

Revision ID: 0005
Revises: 0004
Create Date: 2025-03-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_generations_version", "generations", ["model_line", "model_version", "ts"])


def downgrade() -> None:
    op.drop_index("ix_generations_version", table_name="generations")
