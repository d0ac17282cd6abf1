"""The rollout pin: who pinned which version of a line, when and why (``flywheel rollout pin``).

Three nullable columns on ``model_versions``, set only on the version a pin holds stable, and a
partial unique index so that a line has at most one pinned version. Hand-written to match
``ModelVersion`` in ``flywheel/db/models.py``; tests/integration/test_db.py compares the migrated
schema with the models and downgrades it.

Revision ID: 0006
Revises: 0005
Create Date: 2025-03-04 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PINNED = sa.text("pinned_at IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("pinned_by", sa.String(256), nullable=True))
        batch.add_column(sa.Column("pin_reason", sa.Text(), nullable=True))
    op.create_index("uq_model_versions_pinned", "model_versions", ["model_line"], unique=True,
                    postgresql_where=PINNED, sqlite_where=PINNED)


def downgrade() -> None:
    op.drop_index("uq_model_versions_pinned", table_name="model_versions")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("pin_reason")
        batch.drop_column("pinned_by")
        batch.drop_column("pinned_at")
