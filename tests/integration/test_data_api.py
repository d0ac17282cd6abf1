"""The data-rights HTTP API (serving/gateway/data_router.py) against a running gateway (auth on,
real HTTP) on SQLite and PostgreSQL, over test_data_export.py's rows: an admin's erasure deletes
the rows in the background and its audit shows the counts and the versions trained on them; an
export streams the subject's rows as ``flywheel data export`` writes them; a tenant's key reaches
its own tenant's users only, never another's or the admin routes; bad subjects are 400s naming the
field; a forged ``X-Flywheel-Data`` header does not loosen a tenant's policy; and a gateway killed
with -9 mid-erasure leaves it pending, for the janitor to complete."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from bench.upstream import CannedUpstream
from flywheel import consent
from flywheel.db.models import Erasure
from flywheel.keys import create_key, key_id_of
from flywheel.settings import load_settings
from flywheel.subjects import Subject, export, user_subject
from serving.gateway.app import create_app
from serving.gateway.data import DataServing
from tests.fixtures.roles import served_app, wait_until
from tests.integration.test_data_export import RAW, SECRET, stored  # noqa: F401 (fixture)
from tests.integration.test_tenancy_attacks import running

pytestmark = pytest.mark.integration

ALICE = user_subject(SECRET, "acme", RAW)
TENANTS = {"keep": {"data_use": "store_only"}, "nope": {"data_use": "none"}}


@dataclass
class Api:
    url: str
    sessions: Any
    upstream: CannedUpstream
    keys: dict[str, str]  # acme, globex, keep, nope (tenants), admin
    admin_id: str
    data: DataServing

    def as_(self, who: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[who]}"} if who is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
def api(stored, migrated_db_url: str, tmp_path) -> Iterator[Api]:  # noqa: F811
    with running(CannedUpstream()) as (upstream, upstream_url):
        settings = load_settings(data_dir=str(tmp_path / "data"), bus={"kind": "local", "topic_prefix": "d."},
                                 db={"url": migrated_db_url}, live={"kind": "memory"}, tenants=TENANTS,
                                 gateway={"auth": "on", "upstream": upstream_url, "user_id_secret": SECRET,
                                          "rate_limit_rpm": 0, "rate_limit_burst": 0})
        keys = {tenant: create_key(stored, tenant)[1] for tenant in ("acme", "globex", "keep", "nope")}
        admin, keys["admin"] = create_key(stored, "ops", role="admin", name="dpo")
        app = create_app(settings)
        with served_app(app) as url:
            app.state.services.data.settle_s = 0.2  # no stage runs here: nothing in flight to wait for
            yield Api(url, stored, upstream, keys, admin.key_id, app.state.services.data)


def rows_of(sessions: Any, subject: Subject) -> dict[str, int]:
    return {kind: n for kind, n in export(sessions, subject, io.BytesIO()).items() if n}


def erasures(sessions: Any) -> int:
    with sessions() as db:
        return int(db.scalar(select(func.count()).select_from(Erasure)) or 0)


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def done(client: httpx.Client, location: str) -> dict[str, Any]:
    return wait_until(f"{location} to be done", lambda: (r := client.get(location).json())["state"] == "done" and r,
                      timeout_s=30)


def test_an_admin_erasure_deletes_the_rows_and_its_audit_shows_counts_and_versions(api: Api) -> None:
    before = rows_of(api.sessions, ALICE)
    globex_alice = rows_of(api.sessions, user_subject(SECRET, "globex", RAW))
    with api.as_("admin") as admin:
        r = admin.post("/admin/data/forget", json={"tenant": "acme", "user": RAW})
        assert r.status_code == 202, r.text
        answer = r.json()
        assert RAW not in r.text and answer["user_hash"] == ALICE.user_hash and answer["session_id"] is None
        assert answer["trained_into"] == [{"model_line": "line", "version": 3}]  # known before any deletion
        assert answer["requested_by"] == f"admin API key {api.admin_id}" and api.keys["admin"] not in r.text
        assert r.headers["location"] == f"/admin/data/erasures/{answer['id']}"
        audit = done(admin, r.headers["location"])
    assert audit["counts"]["generation"] == before["generation"] == 4
    assert audit["rows"] == sum(audit["counts"].values()) >= sum(before.values())  # the shared s2 whole
    assert audit["trained_into"] == answer["trained_into"] and audit["requested_by"] == answer["requested_by"]
    assert audit["requested_at"] <= audit["completed_at"]
    assert rows_of(api.sessions, ALICE) == {}
    assert rows_of(api.sessions, user_subject(SECRET, "globex", RAW)) == globex_alice  # another tenant's "alice"
    with api.sessions() as db:
        row = db.get(Erasure, answer["id"])
        assert (row.state, row.counts, row.requested_by) == ("done", audit["counts"], audit["requested_by"])


def test_an_export_streams_the_subjects_rows_as_the_command_writes_them(api: Api) -> None:
    expected = io.BytesIO()
    export(api.sessions, ALICE, expected)
    want = [json.loads(line) for line in expected.getvalue().decode().splitlines()]
    api.data.chunk_bytes = 256  # many chunks through the bounded queue
    with api.as_("admin") as admin, api.as_("acme") as acme:
        by_admin = lines(admin.post("/admin/data/export", json={"tenant": "acme", "user": RAW}))
        by_tenant = lines(acme.post("/v1/data/export", json={"user": RAW}))
        session = lines(acme.post("/v1/data/export", json={"tenant": "acme", "session": "s4"}))
        r = acme.post("/v1/data/export", json={"user": "nobody"})
        api.data.chunk_bytes = 1
        with admin.stream("POST", "/admin/data/export", json={"tenant": "acme", "user": RAW}) as cut:
            assert next(cut.iter_bytes())  # then the client goes away: the reading thread stops
    wait_until("the abandoned export's thread to stop",
               lambda: not [t for t in threading.enumerate() if t.name == "data-export"], timeout_s=10)
    for got in (by_admin, by_tenant):
        assert got[0] == {**want[0], "exported_at": got[0]["exported_at"]} and got[1:] == want[1:]
    assert {(x["type"], x.get("generation_id")) for x in session if x["type"] == "generation"} == {("generation", "g7")}
    assert r.headers["cache-control"] == "no-store" and [x["type"] for x in lines(r)] == ["subject", "end"]
    with api.as_("acme") as acme:  # the raw id never rides in a URL: a GET with it in the query is refused
        got = acme.get("/v1/data/export", params={"user": RAW})
        assert got.status_code == 405 and RAW not in got.text
    assert erasures(api.sessions) == 0


def test_a_tenant_key_reaches_its_own_tenants_users_only(api: Api) -> None:
    before = rows_of(api.sessions, ALICE)
    with api.as_("globex") as globex, api.as_("acme") as acme, api.as_(None) as anonymous:
        # Another tenant named in the body or query: 403, before anything is read or written.
        assert error(globex.post("/v1/data/forget", json={"tenant": "acme", "user": RAW}), 403)["code"] == \
            "tenant_mismatch"
        assert error(globex.post("/v1/data/export", json={"tenant": "acme", "user": RAW}), 403)["param"] == "tenant"
        # The admin routes: no key is a 401, a tenant's key a 403.
        for client, status in ((anonymous, 401), (globex, 403), (acme, 403)):
            assert error(client.post("/admin/data/forget", json={"tenant": "acme", "user": RAW}), status)
            assert error(client.post("/admin/data/export", json={"tenant": "acme", "user": RAW}), status)
            assert error(client.get("/admin/data/erasures/1"), status)
            assert error(client.post("/v1/data/forget", json={"user": RAW}) if client is anonymous
                         else client.get("/v1/data/erasures/1"), 401 if client is anonymous else 404)
        assert rows_of(api.sessions, ALICE) == before and erasures(api.sessions) == 0
        # Without a tenant, a key's request is its own tenant's: globex's "alice" is another person.
        exported = lines(globex.post("/v1/data/export", json={"user": RAW}))
        assert {x.get("tenant", "globex") for x in exported} == {"globex"} and ("generation", "g8") in {
            (x["type"], x.get("generation_id")) for x in exported}
        r = globex.post("/v1/data/forget", json={"user": RAW})
        assert r.status_code == 202 and r.headers["location"].startswith("/v1/data/erasures/"), r.text
        assert done(globex, r.headers["location"])["counts"]["generation"] == 1
        assert rows_of(api.sessions, ALICE) == before
        # acme's erasure is acme's: another tenant's key gets the 404 of one that does not exist.
        mine = acme.post("/v1/data/forget", json={"tenant": "acme", "session": "s4"})
        assert mine.status_code == 202, mine.text
        assert mine.json()["requested_by"] == f"API key {key_id_of(api.keys['acme'])}" and api.keys["acme"] not in mine.text
        theirs = error(globex.get(mine.headers["location"]), 404)
        assert theirs == error(globex.get("/v1/data/erasures/999999"), 404) | {"message": theirs["message"]}
        assert theirs["code"] == "erasure_not_found"
        assert done(acme, mine.headers["location"])["tenant"] == "acme"
        # An erasure of acme's the operator asked for: acme sees that it was, not the admin key's id.
        with api.as_("admin") as admin:
            by_admin = admin.post("/admin/data/forget", json={"tenant": "acme", "session": "s-none"})
        seen = done(acme, by_admin.headers["location"].replace("/admin/", "/v1/"))
        assert seen["requested_by"] == "the operator" and api.admin_id not in json.dumps(seen)
    assert rows_of(api.sessions, ALICE) == before  # s4 is bob's alone


def test_bad_subjects_are_400s_naming_the_field(api: Api) -> None:
    bodies = [({}, "user"), ({"user": RAW, "session": "s1"}, "session"), ({"user": ""}, "user"),
              ({"user": "u" * 1025}, "user"), ({"user": 5}, "user"), ({"session": ""}, "session"),
              ({"session": "s" * 257}, "session"), ({"session": "a\x01b"}, "session"), ({"who": RAW}, "who")]
    with api.as_("acme") as acme, api.as_("admin") as admin:
        for body, param in bodies:
            assert error(acme.post("/v1/data/forget", json=body), 400)["param"] == param, body
            assert error(admin.post("/admin/data/forget", json={"tenant": "acme", **body}), 400)["param"] == param
        assert error(admin.post("/admin/data/forget", json={"user": RAW}), 400)["param"] == "tenant"
        assert error(admin.post("/admin/data/forget", json={"tenant": "no tenant", "user": RAW}), 400)["param"] == \
            "tenant"
        assert error(acme.post("/v1/data/forget", content=b"[1]"), 400)
        assert error(admin.post("/admin/data/export", json={"tenant": "acme"}), 400)["param"] == "user"
        assert error(acme.post("/v1/data/export", json={"user": RAW, "session": "s1"}), 400)["param"] == "session"
        assert error(acme.post("/v1/data/export", json={"user": ""}), 400)["param"] == "user"
    assert erasures(api.sessions) == 0


def test_a_forged_data_header_does_not_loosen_a_tenants_policy(api: Api) -> None:
    # test_consent.py covers the whole pipeline; here only that no header value loosens a policy.
    body = {"messages": [{"role": "user", "content": "sort 3 1 2"}]}
    served = api.upstream.served
    with api.as_("keep") as keep, api.as_("nope") as nope:
        r = keep.post("/v1/chat/completions", json=body, headers={consent.HEADER: "train"})
        assert error(r, 400)["param"] == consent.HEADER and api.upstream.served == served  # refused before routing
        r = nope.post("/v1/chat/completions", json=body, headers={consent.HEADER: "no-train"})
        assert r.status_code == 200 and r.headers[consent.USE_HEADER] == "none", r.text
        r = keep.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers[consent.USE_HEADER] == "store_only", r.text


def test_a_gateway_killed_mid_erasure_leaves_it_pending_and_the_janitor_completes_it(
        stored, migrated_db_url: str, tmp_path) -> None:  # noqa: F811
    import os
    import subprocess
    import sys
    from datetime import UTC, datetime
    from pathlib import Path

    from flywheel import erasure
    from flywheel.janitor import tasks
    from testbed.procs import free_port

    before = rows_of(stored, ALICE)
    _, admin_key = create_key(stored, "ops", role="admin", name="dpo")
    port, log = free_port(), tmp_path / "gateway.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_DATA_DIR=str(tmp_path / "data"), FLYWHEEL_DB__URL=migrated_db_url, FLYWHEEL_BUS__KIND="local",
               FLYWHEEL_LIVE__KIND="memory", FLYWHEEL_GATEWAY__AUTH="on", FLYWHEEL_GATEWAY__USER_ID_SECRET=SECRET)
    with running(CannedUpstream()) as (_, upstream_url), open(log, "ab") as out:
        gateway = subprocess.Popen([sys.executable, "-m", "launch.cli", "gateway", "--port", str(port),
                                    "--upstream", upstream_url], cwd=Path(__file__).resolve().parents[2], env=env,
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until("the gateway", lambda: gateway.poll() is None and httpx.get(f"{url}/health").status_code == 200
                       or gateway.poll() is not None, timeout_s=60)
            assert gateway.poll() is None, log.read_text()
            r = httpx.post(f"{url}/admin/data/forget", json={"tenant": "acme", "user": RAW},
                           headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
            assert r.status_code == 202, r.text
            erasure_id = r.json()["id"]
            # the first pass deletes; the second waits erasure.SETTLE_S: killed in between
            wait_until("the first deletion pass", lambda: rows_of(stored, ALICE) == {}, timeout_s=erasure.SETTLE_S)
        finally:
            gateway.kill()
            gateway.wait(10)
    assert erasure.pending(stored) == [erasure_id]  # never half: pending, its tombstone holding
    turns = dict(tasks(load_settings(None, data_dir=str(tmp_path / "janitor")), stored, None))
    assert turns["erasure_resume"]() == []  # younger than erasure.STALE_AFTER: its gateway may still finish it
    with stored() as db, db.begin():
        db.get(Erasure, erasure_id).requested_at = datetime.now(UTC) - erasure.STALE_AFTER
    assert turns["erasure_resume"]() == [erasure_id]
    with stored() as db:
        row = db.get(Erasure, erasure_id)
        assert row.state == "done" and row.counts["generation"] == before["generation"] == 4, row.counts
    assert rows_of(stored, ALICE) == {}


def test_asking_twice_is_one_erasure_and_a_flood_of_erasures_or_exports_gets_429s(api: Api, monkeypatch) -> None:
    from serving.gateway import data

    api.data.settle_s = 5.0  # the first erasure stays pending a while
    monkeypatch.setattr(data, "MAX_PENDING_ERASURES", 2)
    monkeypatch.setattr(data, "MAX_EXPORTS_PER_TENANT", 1)
    with api.as_("acme") as acme, api.as_("globex") as globex:
        first = acme.post("/v1/data/forget", json={"user": RAW})
        again = acme.post("/v1/data/forget", json={"user": RAW})
        assert first.status_code == again.status_code == 202 and again.json()["id"] == first.json()["id"]
        assert erasures(api.sessions) == 1  # asked twice, erased once
        assert acme.post("/v1/data/forget", json={"session": "s4"}).status_code == 202
        flood = acme.post("/v1/data/forget", json={"session": "s3"})
        assert flood.status_code == 429 and flood.headers["retry-after"] == "10"
        assert error(flood, 429)["code"] == "too_many_pending_erasures" and erasures(api.sessions) == 2
        assert globex.post("/v1/data/forget", json={"session": "s1"}).status_code == 202  # another tenant's own

        # An export still being written holds the tenant's slot (its reading thread, held here
        # after acme's first one has written its rows, until released: a small export would
        # otherwise be done, into the socket's buffers, before the next request).
        release, real_export = threading.Event(), data.export

        def held_export(sessions: Any, subject: Any, out: Any) -> Any:
            counts = real_export(sessions, subject, out)
            if subject.tenant == "acme":
                release.wait(10)
            return counts

        monkeypatch.setattr(data, "export", held_export)
        api.data.chunk_bytes = 1  # its rows reach the client at once: the answer starts before the hold
        try:
            with acme.stream("POST", "/v1/data/export", json={"session": "s9"}) as held:
                assert held.status_code == 200
                second = acme.post("/v1/data/export", json={"session": "s9"})
                assert second.status_code == 429 and error(second, 429)["code"] == "too_many_exports"
                assert globex.post("/v1/data/export", json={"session": "s1"}).status_code == 200
        finally:
            release.set()
        wait_until("the held export's slot", lambda: acme.post("/v1/data/export", json={"session": "s9"})
                   .status_code == 200, timeout_s=10)
