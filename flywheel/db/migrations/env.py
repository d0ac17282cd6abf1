"""Alembic environment: runs revisions against the URL that ``flywheel.db.session.upgrade`` passes.

The URL comes from ``config.attributes["flywheel_url"]`` (set in code), else ``-x url=...`` on the
alembic command line, else ``sqlalchemy.url`` in the ini file. The engine is built by
``flywheel.db.session.make_engine`` so SQLite gets the same pragmas as the application.
SQLite runs in batch mode (table copy-and-move) so ALTERs work there too.
"""

from __future__ import annotations

from alembic import context

from flywheel.db.models import Base
from flywheel.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("flywheel_url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: use flywheel.db.session.upgrade(url) or `alembic -x url=...`")
    return url


def _options(dialect_name: str) -> dict:
    is_sqlite = dialect_name == "sqlite"
    return {
        "target_metadata": target_metadata,
        "render_as_batch": is_sqlite,
        # make_engine wraps every SQLite transaction in BEGIN IMMEDIATE, so SQLite DDL is transactional.
        "transactional_ddl": True if is_sqlite else None,
        "compare_type": True,
    }


def run_migrations_offline() -> None:
    from sqlalchemy.engine import make_url

    url = _url()
    options = {k: v for k, v in _options(make_url(url).get_backend_name()).items() if v is not None}
    context.configure(url=url, literal_binds=True, **options)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            options = {k: v for k, v in _options(connection.dialect.name).items() if v is not None}
            context.configure(connection=connection, **options)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
