"""Time indexes for the retention job (``flywheel/retention.py``): the oldest generations, feedback,
trajectories and scored rows first. Hand-written to match ``flywheel/db/models.py``;
tests/integration/test_db.py compares the migrated schema with the models and downgrades it.

On PostgreSQL each index is built ``CONCURRENTLY`` (outside the revision's transaction), so an
upgrade of a live database never blocks the writers of these hot tables while it builds.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: (index, table): each on the table's ``ts``.
INDEXES = (
    ("ix_generations_ts", "generations"),
    ("ix_feedback_ts", "feedback"),
    ("ix_trajectories_ts", "trajectories"),
    ("ix_scored_trajectories_ts", "scored_trajectories"),
)


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            for name, table in INDEXES:
                op.create_index(name, table, ["ts"], postgresql_concurrently=True, if_not_exists=True)
        return
    for name, table in INDEXES:
        op.create_index(name, table, ["ts"])


def downgrade() -> None:
    for name, table in INDEXES:
        op.drop_index(name, table_name=table)
