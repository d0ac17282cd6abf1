"""An index on when each erasure was requested: every stage reads the tombstones newer than its last
read (``flywheel/tombstones.py``), ingest once per stored batch. Hand-written to match
``flywheel/db/models.py``; tests/integration/test_db.py compares the migrated schema with the
models and downgrades it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_erasures_requested_at", "erasures", ["requested_at"])


def downgrade() -> None:
    op.drop_index("ix_erasures_requested_at", table_name="erasures")
