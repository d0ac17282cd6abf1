"""Generations by end user: ``generations.user_hash`` (the keyed hash of the end user a request
named, ``flywheel/identity.py``) and the index that finds a tenant's user's rows.

Rows stored before have no hash (NULL): their requests kept the raw ``user`` in the payload, which
this revision does not rewrite. Hand-written to match ``Generation`` in ``flywheel/db/models.py``;
tests/integration/test_db.py compares the migrated schema with the models and downgrades it.

Revision ID: 0008
Revises: 0007
Create Date: 2025-03-06 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("user_hash", sa.String(64), nullable=True))
    op.create_index("ix_generations_user", "generations", ["tenant", "user_hash"])


def downgrade() -> None:
    op.drop_index("ix_generations_user", table_name="generations")
    with op.batch_alter_table("generations") as batch:
        batch.drop_column("user_hash")
