"""Consent against a running gateway, ingest and rewards worker (real HTTP, a stand-in upstream, the
local bus, SQLite or PostgreSQL), then the trainer on the quick tiny model.

Traffic under every policy and header: ``train``, ``store_only`` (the tenant's, or ``no-train``),
``none`` (the tenant's, or ``no-store``), a session that turns ``no-train`` half way, and a tenant
that trains on a sample of its sessions. Then every store is read back: nothing of ``none`` /
``no-store`` in the database, on any bus topic or in any file flywheel wrote (spool, bus log,
SQLite); ``store_only`` stored, scored and marked, and never on the topic the trainer reads. The
trainer, fed those scored rows anyway, drops them: no version's ``trajectory_ids`` holds one."""

from __future__ import annotations

import re
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from bench.upstream import CannedUpstream
from flywheel import consent
from flywheel.bus import make_bus
from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import ScoredTrajectory, TrajectoryEvent, trajectory_id_for
from flywheel.keys import create_key
from flywheel.settings import Settings, load_settings
from ingest.worker import run as run_ingest
from rewards.worker import run as run_rewards
from serving.gateway.app import create_app
from tests.fixtures.roles import RoleThread, drain_capture, served_app, wait_until
from tests.fixtures.traffic import produce
from tests.integration.test_pipeline import Traffic, make_settings, registry_for, send_twice, wait_for
from tests.integration.test_pipeline import running as running_roles
from tests.integration.test_pipeline import traffic as pipeline_traffic  # noqa: F401  (a fixture, by this name)
from tests.integration.test_tenancy_attacks import running

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
TENANTS = {"*": {"data_use": "train"}, "keep": {"data_use": "store_only"}, "nope": {"data_use": "none"},
           "half": {"train_fraction": 0.5}}
HALF_SESSIONS = 8


def _settings(data: Path, db_url: str, upstream_url: str) -> Settings:
    data.mkdir(parents=True, exist_ok=True)
    spec = data / "rewards.toml"  # no held-out slice: every trajectory for training reaches the scored topic
    spec.write_text('extends = "default"\nversion = "consent-v1"\n[guards]\nheld_out_fraction = 0.0\n')
    return load_settings(data_dir=str(data), bus={"kind": "local", "partitions": 2, "topic_prefix": "c."},
                         db={"url": db_url, "wait_s": 10}, live={"kind": "memory"}, tenants=TENANTS,
                         ingest={"inactivity_timeout_s": 1.0}, rewards={"spec_path": str(spec)},
                         gateway={"auth": "on", "upstream": upstream_url, "capture_ack": "fsynced",
                                  "rate_limit_rpm": 0, "rate_limit_burst": 0})


def _topic(settings: Settings, name: str) -> list[bytes]:
    bus = make_bus(settings)
    consumer = bus.consumer(f"check-{uuid.uuid4().hex}", [settings.topic(name)])
    try:
        return [r.value for _ in range(3) for r in consumer.poll(timeout_s=0.2, max_records=5000)]
    finally:
        consumer.close()
        bus.close()


def _files(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots if root.exists() for p in sorted(root.rglob("*")) if p.is_file()}


class Client:
    """One tenant's HTTP client, remembering what each labelled session sent and was told."""

    def __init__(self, url: str, key: str, log: dict[str, dict[str, Any]]) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        self.log = log

    def chat(self, label: str, data: str | None = None, *, stream: bool = False, session: str | None = None) -> str:
        """One completion for the session ``label`` (its marker in the prompt); its generation id."""
        entry = self.log.setdefault(label, {"session": session or f"{label}-{uuid.uuid4().hex}", "markers": [],
                                            "generations": [], "uses": []})
        marker = f"marker-{uuid.uuid4().hex}"
        headers = {"X-Flywheel-Session": entry["session"], **({consent.HEADER: data} if data is not None else {})}
        body = {"messages": [{"role": "user", "content": f"sort 3 1 2 {marker}"}], "stream": stream}
        with self.http.stream("POST", CHAT, json=body, headers=headers) as r:
            r.read()
        assert r.status_code == 200, (label, r.text)
        assert not stream or r.text.rstrip().endswith("data: [DONE]"), r.text
        entry["markers"].append(marker)
        entry["generations"].append(r.headers["X-Flywheel-Generation"])
        entry["uses"].append(r.headers[consent.USE_HEADER])
        return r.headers["X-Flywheel-Generation"]

    def feedback(self, body: dict[str, Any], data: str | None = None) -> httpx.Response:
        headers = {consent.HEADER: data} if data is not None else {}
        return self.http.post("/v1/feedback", json={"feedback_id": f"fb-{uuid.uuid4().hex}", **body}, headers=headers)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def test_nothing_of_no_store_is_stored_and_store_only_never_reaches_the_trainer(tmp_path, db_url) -> None:
    data = tmp_path / "data"
    log: dict[str, dict[str, Any]] = {}
    with running(CannedUpstream()) as (upstream, upstream_url):
        settings = _settings(data, db_url, upstream_url)
        upgrade(db_url)
        engine = make_engine(db_url)
        db = make_session_factory(engine)
        keys = {tenant: create_key(db, tenant)[1] for tenant in ("acme", "keep", "nope", "half")}
        admin_key = create_key(db, "ops", role="admin")[1]
        stop = threading.Event()
        roles = [RoleThread("ingest", run_ingest, settings, stop), RoleThread("rewards", run_rewards, settings, stop)]
        with served_app(create_app(settings)) as url:
            for role in roles:
                role.start()
            acme, keep, nope, half = (Client(url, keys[t], log) for t in ("acme", "keep", "nope", "half"))
            acme.chat("train")
            acme.chat("train", stream=True)
            acme.chat("notrain", "no-train")
            acme.chat("nostore", "no-store")
            acme.chat("nostore", "no-store", stream=True)
            acme.chat("mixed")
            acme.chat("mixed", "no-train")
            keep.chat("keep")
            keep.chat("keep", "no-train", stream=True)
            keep.chat("keep-nostore", "no-store")
            nope.chat("nope")
            nope.chat("nope", "no-train", stream=True)  # a looser header is not applied
            for i in range(HALF_SESSIONS):
                half.chat(f"half{i}", session=f"half-{i}")  # fixed ids: the sample's split is known

            # A value the header does not know: a 400 naming it, before anything is routed.
            served = upstream.served
            r = acme.http.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                               headers={consent.HEADER: "train"})
            assert r.status_code == 400, r.text
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (consent.HEADER, "invalid_data_use")
            assert upstream.served == served

            # Feedback: stored under train and store_only; under none checked, counted, never stored.
            for label, who in (("train", acme), ("notrain", acme), ("keep", keep)):
                r = who.feedback({"generation_id": log[label]["generations"][0], "kind": "explicit",
                                  "signal": "thumbs", "value": 1})
                assert r.status_code == 202 and len(r.json()["event_ids"]) == 1, r.text
            unstored = [
                acme.feedback({"generation_id": log["nostore"]["generations"][0], "kind": "explicit",
                               "signal": "thumbs", "value": -1, "comment": f"c-{log['nostore']['markers'][0]}"},
                              "no-store"),
                acme.feedback({"session_id": log["nostore"]["session"], "kind": "outcome", "signal": "task_solved",
                               "value": 1}, "no-store"),
                nope.feedback({"generation_id": log["nope"]["generations"][0], "kind": "explicit", "signal": "thumbs",
                               "value": 1, "comment": f"c-{log['nope']['markers'][0]}"}),
                nope.feedback({"session_id": log["nope"]["session"], "kind": "implicit", "signal": "abandon", "value": 1},
                              "no-train"),
            ]
            for r in unstored:
                assert r.status_code == 202 and r.json() == {"accepted": 1, "event_ids": []}, r.text
                assert r.headers[consent.USE_HEADER] == "none"
            bad = nope.feedback({"session_id": log["nope"]["session"], "metric": "no_such_metric", "value": 1})
            assert bad.status_code == 400, bad.text  # still checked against its metric
            aimless = nope.feedback({"kind": "explicit", "signal": "thumbs", "value": 1})
            assert aimless.status_code == 400 and aimless.json()["error"]["code"] == "missing_required_parameter"
            # Without the header, feedback naming a no-store generation finds nothing: it was never stored.
            r = acme.feedback({"generation_id": log["nostore"]["generations"][1], "kind": "explicit",
                               "signal": "thumbs", "value": 1})
            assert r.status_code == 404 and r.json()["error"]["code"] == "generation_not_found", r.text
            metrics = acme.http.get("/metrics").text

            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as admin:
                captured = drain_capture(admin, settings)

        uses = {"train": "train", "notrain": "store_only", "nostore": "none", "mixed": "store_only",
                "keep": "store_only", "keep-nostore": "none", "nope": "none"}
        policy = consent.TenantPolicy(train_fraction=0.5)
        for i in range(HALF_SESSIONS):
            uses[f"half{i}"] = consent.sampled("train", policy, "half", log[f"half{i}"]["session"])
        assert set(uses.values()) == {"train", "store_only", "none"}
        assert sorted(uses[f"half{i}"] for i in range(HALF_SESSIONS)) == ["store_only"] * 3 + ["train"] * 5
        for label, entry in log.items():  # every answer said which use applied
            expected = [uses[label]] * len(entry["uses"]) if label != "mixed" else ["train", "store_only"]
            assert entry["uses"] == expected, label
        stored = {label for label, use in uses.items() if use != "none"}
        unstored_labels = set(uses) - stored
        tenant_of = {label: ("keep" if label.startswith("keep") else "nope" if label == "nope"
                             else "half" if label.startswith("half") else "acme") for label in uses}
        trajectories = {trajectory_id_for(tenant_of[label], log[label]["session"]): label for label in stored}

        def scored() -> bool:
            assert not [r.error for r in roles if r.error is not None]
            with db() as s:
                return len(set(s.scalars(select(ScoredTrajectoryRow.trajectory_id)))) >= len(stored)

        try:
            wait_until("every stored session to be scored", scored, timeout_s=90)
        finally:
            stop.set()
            for role in roles:
                role.join(30)
        assert not [r.error for r in roles if r.error is not None]

    # The gateway counted what it served and never recorded.
    n_none = sum(len(log[label]["generations"]) for label in unstored_labels)
    assert re.search(rf'^flywheel_gateway_unstored_total{{kind="generation"}} {n_none}\.0$', metrics, re.M), metrics
    assert re.search(r'^flywheel_gateway_unstored_total{kind="feedback"} 4\.0$', metrics, re.M), metrics
    assert re.search(rf'^flywheel_gateway_data_use_total{{data_use="none",route="chat"}} {n_none}\.0$', metrics, re.M)

    # The database: generations, feedback, sessions, trajectories and scores of stored sessions only.
    by_session = {log[label]["session"]: label for label in uses}
    with db() as s:
        generations = s.execute(select(Generation.session_id, Generation.generation_id, Generation.payload)).all()
        feedback_sessions = set(s.scalars(select(Feedback.session_id)))
        session_rows = set(s.scalars(select(SessionState.session_id)))
        trajectory_rows = [TrajectoryEvent.model_validate(p) for p in s.scalars(select(Trajectory.payload))]
        scored_rows = [ScoredTrajectory.model_validate(p) for p in s.scalars(select(ScoredTrajectoryRow.payload))]
    engine.dispose()
    assert {by_session[g.session_id] for g in generations} == stored
    assert sorted(g.generation_id for g in generations) == sorted(
        gid for label in stored for gid in log[label]["generations"])
    for g in generations:
        label = by_session[g.session_id]
        expected = log[label]["uses"][log[label]["generations"].index(g.generation_id)]
        assert g.payload["data_use"] == expected, label
    assert {by_session[s] for s in feedback_sessions} == {"train", "notrain", "keep"}
    assert {by_session[s] for s in session_rows} == stored
    for rows in (trajectory_rows, scored_rows):
        assert {trajectories[t.trajectory_id]: t.data_use for t in rows} == {label: uses[label] for label in stored}

    # The bus: the gateway's topics, ingest's and the trainer's.
    topics = {name: _topic(settings, name) for name in ("generations", "feedback", "trajectories", "scored")}
    assert len(topics["generations"]) == len(generations) == len(captured[settings.topic("generations")])
    assert len(topics["feedback"]) == 3
    on_scored = {ScoredTrajectory.from_bytes(v).trajectory_id for v in topics["scored"]}
    assert {trajectories[t] for t in on_scored} == {label for label in stored if uses[label] == "train"}
    assert {TrajectoryEvent.from_bytes(v).data_use for v in topics["trajectories"]} == {"train", "store_only"}

    # Not a byte of none / no-store traffic anywhere: its prompts, comments, sessions, generation ids.
    secrets = [x for label in unstored_labels for x in (log[label]["session"], *log[label]["markers"],
                                                        *log[label]["generations"])]
    written = _files(data, tmp_path / "db")
    assert any("spool" in p.parts for p in written) and any("bus" in p.parts for p in written)
    leaks = [(str(p), x) for p, content in written.items() for x in secrets if x.encode() in content]
    assert not leaks
    assert not [x for values in topics.values() for v in values for x in secrets if x.encode() in v]
    # ... while the stored traffic is there to be found (the search would see a leak).
    assert all(x.encode() in b"".join(topics["generations"]) for label in stored for x in log[label]["markers"])


def test_the_trainer_never_trains_on_store_only(tmp_path: Path, sqlite_url: str, tiny_model_dir: Path,
                                                pipeline_traffic: Traffic) -> None:  # noqa: F811  (the fixture)
    """The pipeline's eight sessions served by the quick model, two of them not for training (one
    wholly, one from its second turn on): ingest, rewards and the trainer; then the store_only
    scored rows are put on the trainer's topic anyway, as a stray producer might."""
    from trainer.train import train

    traffic = pipeline_traffic
    wholly, partly = traffic.sessions[0], traffic.sessions[3]  # session 3 has two turns
    second = [g for g in traffic.generations if g.session_id == partly][1]
    marked = [g.model_copy(update={"data_use": "store_only"}) if g.session_id == wholly or g is second else g
              for g in traffic.generations]
    assert [g.session_id for g in marked if g.data_use != "train"] == [wholly, partly]
    upgrade(sqlite_url)
    settings = make_settings(tmp_path / "a", sqlite_url, tiny_model_dir,
                             trainer={"batch_size": 2, "steps_per_version": 3})
    db = make_session_factory(make_engine(sqlite_url))
    send_twice(settings, Traffic(marked, traffic.feedback, traffic.sessions))
    kept = {trajectory_id_for("acme", s) for s in (wholly, partly)}
    with running_roles(run_ingest, run_rewards, settings=settings):
        def scored_all() -> bool:
            with db() as s:
                return len(set(s.scalars(select(ScoredTrajectoryRow.trajectory_id)))) >= len(traffic.sessions)
        wait_for("every session scored", scored_all)
    with db() as s:
        rows = [ScoredTrajectory.model_validate(p) for p in s.scalars(select(ScoredTrajectoryRow.payload))]
    assert {r.trajectory_id for r in rows if r.data_use != "train"} == kept
    on_topic = {ScoredTrajectory.from_bytes(v).trajectory_id for v in _topic(settings, "scored")}
    assert on_topic and not on_topic & kept
    # A stray producer puts them on the trainer's topic after all.
    produce(settings, [row for row in rows if row.data_use != "train"])

    registry = registry_for(settings)
    with running_roles(train, settings=settings):
        wait_for("version 1", lambda: len(registry.versions()) >= 2, timeout_s=180)
    trained = [tid for v in registry.versions() for tid in (v.metrics or {}).get("trajectory_ids", [])]
    v1 = registry.get(1)
    assert sorted(trained) == sorted({trajectory_id_for("acme", s) for s in traffic.sessions} - kept)
    assert v1.metrics["dropped_not_for_training"] == 2
