"""Alembic revisions for every flywheel table; run them with ``flywheel.db.session.upgrade(url)``."""
