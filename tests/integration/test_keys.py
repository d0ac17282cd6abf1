"""API keys on real PostgreSQL and SQLite: the ``flywheel keys`` CLI, the 0002 migration, and
KeyStore authentication (caching, revocation within key_cache_s, one answer for every bad key)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import event, inspect

from flywheel.db.models import Base
from flywheel.db.session import downgrade, make_engine, make_session_factory, upgrade
from flywheel.keys import create_key, key_hash, revoke_key
from launch.cli import main
from serving.errors import APIError
from serving.gateway.auth import INVALID_KEY_MESSAGE, KeyStore

pytestmark = pytest.mark.integration


@pytest.fixture
def cli(db_url, tmp_path, monkeypatch, capsys):
    """``flywheel keys ...`` on ``db_url``: returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("FLYWHEEL_DB__URL", db_url)
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", str(tmp_path / "data"))

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["keys", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def db(migrated_db_url):
    """(session factory, engine) on a migrated database, counting the statements that read api_keys."""
    engine = make_engine(migrated_db_url)
    engine.queries = 0  # type: ignore[attr-defined]

    @event.listens_for(engine, "before_cursor_execute")
    def _count(_conn, _cursor, statement, *_rest):  # noqa: ANN001
        if statement.lstrip().upper().startswith("SELECT") and "api_keys" in statement:
            engine.queries += 1  # type: ignore[attr-defined]

    yield make_session_factory(engine), engine
    engine.dispose()


def _queries(engine) -> int:
    return engine.queries


def test_cli_create_list_revoke(cli):
    code, out, err = cli("create", "--tenant", "acme", "--name", "ci bot", "--rpm", "120")
    assert code == 0
    key = out.strip()
    key_id = key.split("_")[1]
    assert key.startswith(f"fwk_{key_id}_") and f"key {key_id} for tenant acme" in err and "only this once" in err

    code, out, _ = cli("create", "--tenant", "ops", "--admin", "--json")
    admin = json.loads(out)
    assert code == 0 and admin["role"] == "admin" and admin["tenant"] == "ops" and admin["rate_limit_rpm"] is None
    assert admin["key"].startswith(f"fwk_{admin['key_id']}_")

    code, out, err = cli("list")
    assert code == 0 and key_id in out and admin["key_id"] in out and "ci bot" in out and "120" in out
    secret, admin_secret = key.rsplit("_", 1)[1], admin["key"].rsplit("_", 1)[1]
    assert secret not in out + err and admin_secret not in out + err and key_hash(key) not in out

    code, out, _ = cli("list", "--tenant", "acme", "--json")
    listed = json.loads(out)
    assert [k["key_id"] for k in listed] == [key_id]
    assert listed[0]["revoked_at"] is None and listed[0]["role"] == "tenant" and listed[0]["rate_limit_rpm"] == 120
    assert "key" not in listed[0] and secret not in out and key_hash(key) not in out

    code, out, _ = cli("revoke", key_id)
    assert code == 0 and f"revoked {key_id}" in out
    assert cli("revoke", key_id)[0] == 0  # already revoked: still revoked, not an error
    listed = json.loads(cli("list", "--tenant", "acme", "--json")[1])
    assert listed[0]["revoked_at"] is not None

    code, _, err = cli("revoke", "000000000000")
    assert code == 1 and "no key" in err


def test_cli_refuses_bad_input(cli):
    code, out, err = cli("create", "--tenant", "acme corp")
    assert code == 2 and out == "" and "invalid tenant name" in err
    code, out, err = cli("create", "--tenant", "acme", "--rpm", "-5")
    assert code == 2 and out == "" and "rpm" in err
    assert json.loads(cli("list", "--json")[1]) == []


def test_migration_0002_up_and_down(db_url):
    def tables() -> set[str]:
        engine = make_engine(db_url)
        try:
            return set(inspect(engine).get_table_names())
        finally:
            engine.dispose()

    upgrade(db_url)
    assert "api_keys" in tables()
    downgrade(db_url, "0001")
    assert "api_keys" not in tables() and "generations" in tables()
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
        assert {ix["name"] for ix in inspect(engine).get_indexes("api_keys")} == {"ix_api_keys_tenant"}
    finally:
        engine.dispose()
    downgrade(db_url)
    assert tables() <= {"alembic_version"}


def test_authenticate_valid_forged_unknown_malformed(db):
    sessions, engine = db
    info, key = create_key(sessions, "acme", name="app", rpm=30)
    admin, admin_key = create_key(sessions, "ops", role="admin")
    key_id, secret = key.split("_")[1], key.split("_")[2]
    forged = f"fwk_{key_id}_{'0' * 64 if secret != '0' * 64 else '1' * 64}"
    unknown = f"fwk_{'a' * 12}_{secret}"

    async def scenario() -> None:
        store = KeyStore(sessions, cache_s=30)
        principal = await store.authenticate(f"Bearer {key}")
        assert (principal.key_id, principal.tenant, principal.role, principal.rate_limit_rpm) == (
            info.key_id, "acme", "tenant", 30)
        assert not principal.is_admin
        assert (await store.authenticate(f"bearer {admin_key}")).is_admin

        errors = []
        before = _queries(engine)
        for header in (None, "", "Bearer", f"Basic {key}", key, "Bearer sk-proj-abc", f"Bearer {key}x"):
            with pytest.raises(APIError) as caught:
                await store.authenticate(header)
            errors.append(caught.value)
        assert _queries(engine) == before, "malformed keys must not reach the database"
        for header in (f"Bearer {forged}", f"Bearer {unknown}"):
            with pytest.raises(APIError) as caught:
                await store.authenticate(header)
            errors.append(caught.value)
        for err in errors:
            assert (err.status, err.code, err.message) == (401, "invalid_api_key", INVALID_KEY_MESSAGE)
            assert secret not in str(err.body()) and key_id not in err.message

    asyncio.run(scenario())


def test_results_are_cached_and_concurrent_lookups_share_one_query(db):
    sessions, engine = db
    _, key = create_key(sessions, "acme")
    bad = f"fwk_{'b' * 12}_{'c' * 64}"

    async def scenario() -> None:
        store = KeyStore(sessions, cache_s=30)
        before = _queries(engine)
        principals = await asyncio.gather(*[store.authenticate(f"Bearer {key}") for _ in range(25)])
        assert {p.tenant for p in principals} == {"acme"}
        assert _queries(engine) - before == 1
        for _ in range(50):
            await store.authenticate(f"Bearer {key}")
        assert _queries(engine) - before == 1

        results = await asyncio.gather(*[store.authenticate(f"Bearer {bad}") for _ in range(25)],
                                       return_exceptions=True)
        assert all(isinstance(r, APIError) and r.status == 401 for r in results)
        for _ in range(50):
            with pytest.raises(APIError):
                await store.authenticate(f"Bearer {bad}")
        assert _queries(engine) - before == 2, "a repeated bad key is looked up once per cache_s"

    asyncio.run(scenario())


def test_revoked_key_is_refused_within_cache_s(db):
    sessions, _ = db
    info, key = create_key(sessions, "acme")
    cache_s = 0.5

    async def scenario() -> float:
        store = KeyStore(sessions, cache_s=cache_s)
        await store.authenticate(f"Bearer {key}")
        assert revoke_key(sessions, info.key_id).revoked_at is not None
        revoked_at = time.monotonic()
        while True:
            try:
                await store.authenticate(f"Bearer {key}")
            except APIError as exc:
                assert exc.status == 401 and exc.message == INVALID_KEY_MESSAGE
                return time.monotonic() - revoked_at
            assert time.monotonic() - revoked_at < cache_s + 1.0, "revoked key still accepted after cache_s"
            await asyncio.sleep(0.02)

    refused_after = asyncio.run(scenario())
    assert refused_after <= cache_s + 0.3
    # A fresh gateway (cold cache) refuses it at once, and so does one with caching off.
    for cache in (30.0, 0.0):
        with pytest.raises(APIError):
            asyncio.run(KeyStore(sessions, cache_s=cache).authenticate(f"Bearer {key}"))


def test_a_database_failure_is_a_503_not_a_pass(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")  # never migrated: no api_keys table
    try:
        store = KeyStore(make_session_factory(engine), cache_s=30)
        key = f"fwk_{'d' * 12}_{'e' * 64}"
        with pytest.raises(APIError) as caught:
            asyncio.run(store.authenticate(f"Bearer {key}"))
        assert caught.value.status == 503 and caught.value.code == "auth_unavailable"
        assert key not in caught.value.message
    finally:
        engine.dispose()


def test_key_rows_hold_only_the_hash(db):
    sessions, engine = db
    info, key = create_key(sessions, "acme")
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM api_keys WHERE key_id = :k"), {"k": info.key_id}).mappings().one()
    secret = key.rsplit("_", 1)[1]
    assert row["key_sha256"] == key_hash(key)
    assert all(secret not in str(value) for value in row.values())
