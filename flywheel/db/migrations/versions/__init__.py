"""Alembic revision scripts (one file per schema change, applied in order)."""
