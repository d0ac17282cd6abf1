"""PostgreSQL: the raw-event and trajectory payloads are TOAST-compressed with lz4 instead of pglz.

Every payload is a few kB of JSON (token ids and logprobs), above TOAST's 2 kB threshold, so each
insert compresses it and each read decompresses it; lz4 costs PostgreSQL a fraction of pglz's CPU
(``bench/ingest``: PostgreSQL CPU per 1,000 events 338 -> 246 ms). Only on servers built with lz4
(PostgreSQL >= 14, where ``default_toast_compression`` lists it); elsewhere, and on SQLite, a no-op.
Existing rows keep their compression; new rows get lz4.

Revision ID: 0004
Revises: 0003
Create Date: 2025-03-02 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PAYLOADS = ["generations", "feedback", "trajectories", "scored_trajectories"]


def _lz4_available() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    return bool(bind.execute(sa.text(
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'")).scalar())


def _set(method: str) -> None:
    if _lz4_available():
        for table in PAYLOADS:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN payload SET COMPRESSION {method}")


def upgrade() -> None:
    _set("lz4")


def downgrade() -> None:
    _set("pglz")
