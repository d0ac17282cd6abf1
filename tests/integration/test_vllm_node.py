"""``flywheel node`` with ``node.engine = "vllm"``: the node process keeps a vLLM server (the stand-in
that follows vLLM's HTTP contract, tests/fixtures/vllm_standin.py) on the registry's stable
version and keeps the last good one when a version is corrupt, reporting it in its heartbeat.
Full mode registers the weights vLLM started from, reloads each promoted version in place and,
behind the gateway, serves through its front, which stamps every answer with the version whose
weights produced it (a generation in flight during a promotion finishes on the old one); LoRA
mode bootstraps the zero adapter, loads each version as an adapter (canary preloaded) and, behind
the gateway, is sent ``model = <line>-v<version>`` while the client sees the line."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
from sqlalchemy import select

from flywheel.db.models import Node
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import SettingsError, load_settings
from flywheel.weights.codec.state import encode_full
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.node.main import run as run_node
from testbed.procs import free_port
from tests.fixtures.roles import MESSAGES, RoleThread, wait_until
from tests.fixtures.vllm_standin import VllmStandIn
from tests.integration.test_registry import make_state, train_step

pytestmark = pytest.mark.integration



def fleet_shows(http: httpx.Client, gateway: str, roles: list[Any], node_id: str, stable: int, held: set[int]) -> bool:
    """The gateway's view (GET /v1/models): ``stable`` is stable and ``node_id`` alone serves it, holding ``held``."""
    assert all(r.error is None for r in roles), [r.error for r in roles]
    shown = http.get(f"{gateway}/v1/models").json()["data"][0]["flywheel"]
    nodes = [(n["node_id"], n["live_version"], set(n["versions"])) for n in shown["nodes"]]
    return shown["stable"] == stable and nodes == [(node_id, stable, held)]


def chat_through(http: httpx.Client, gateway: str, session: str | None = None, path: str = "/v1/chat/completions",
                 **body: Any) -> httpx.Response:
    """A chat (or text) completion through the gateway, in ``session``; asserts a 200."""
    payload = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "sort: 3 1 2"}
    r = http.post(f"{gateway}{path}", headers={"X-Flywheel-Session": session} if session else {},
                  json={**payload, "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r

def test_a_vllm_node_follows_the_registry_and_keeps_the_last_good_version(tmp_path: Path) -> None:
    rng = random.Random(8)
    base = make_state(rng)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(encode_full(base))  # what vLLM was started from
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    registry = Registry(sessions, FolderStore(tmp_path / "weights"), "vllm-line")

    def live_version() -> tuple[int | None, str]:
        with sessions() as s:
            row = s.scalar(select(Node).where(Node.node_id == "vllm-0"))
            return (row.live_version, row.status) if row is not None else (None, "")

    stop = threading.Event()
    with VllmStandIn(served_model_name="vllm-line") as standin:  # vLLM serves model.line in full mode
        settings = load_settings(data_dir=str(tmp_path), db={"url": db_url},
                                 model={"line": "vllm-line", "path": str(model)},
                                 node={"engine": "vllm", "vllm_url": standin.url, "node_id": "vllm-0", "poll_s": 0.2,
                                       "port": free_port()})
        node = RoleThread("vllm-node", run_node, settings, stop)
        node.start()
        try:
            wait_until("the base registered and live", lambda: live_version() == (0, "serving"), timeout_s=30)
            # What changes vLLM (the start-up probe's completions change nothing).
            posted = lambda: [c.path for c in standin.calls if c.method == "POST" and c.path != "/v1/completions"]  # noqa: E731
            assert registry.get(0).status == "stable" and not posted()  # nothing reloaded for the base
            assert len([c for c in standin.calls if c.path == "/v1/completions"]) == 2  # the logprobs probe

            v1 = registry.publish(train_step(rng, base), parent=0, parent_state=base)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("vLLM on v1", lambda: live_version() == (1, "serving"), timeout_s=30)
            assert standin.weights_sha256 == v1.sha256
            assert posted() == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]

            state1 = registry.load(1)
            v2 = registry.publish(train_step(rng, state1), parent=1, parent_state=state1)
            blob = bytearray(registry.store.get(v2.store_key))
            blob[-3] ^= 0xFF
            registry.store.put(v2.store_key, bytes(blob))
            registry.set_status(v2.version, "stable", reason="test: corrupt")
            wait_until("the failure reported", lambda: live_version() == (1, "failed_update"), timeout_s=30)
            assert standin.weights_sha256 == v1.sha256  # the corrupt version never reached vLLM
            assert node.error is None and node.is_alive()
        finally:
            stop.set()
            node.join(timeout=30)
            db.dispose()
    assert node.error is None


def test_a_vllm_node_needs_its_url() -> None:
    with pytest.raises(SettingsError, match="vllm_url"):
        load_settings(node={"engine": "vllm"})


def test_the_vllm_api_key_is_a_secret() -> None:
    from flywheel.settings import redacted

    settings = load_settings(node={"engine": "vllm", "vllm_url": "http://vllm:8000", "vllm_api_key": "k-987"})
    assert settings.node.vllm_api_key == "k-987"
    assert "k-987" not in repr(settings) and "k-987" not in json.dumps(redacted(settings))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_vllm_node_refuses_to_start_against_raw_logprobs(tmp_path: Path, mode: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(encode_full({"model.layers.0.self_attn.q_proj.weight": torch.ones(8, 8)}))
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    with VllmStandIn(served_model_name="raw-line", logprobs_mode="raw_logprobs") as standin:
        settings = load_settings(data_dir=str(tmp_path), db={"url": db_url}, model={"line": "raw-line", "path": str(model)},
                                 trainer={"lora_rank": 4, "lora_targets": ["q_proj"]} if mode == "lora" else {},
                                 node={"engine": "vllm", "vllm_url": standin.url, "vllm_mode": mode,
                                       "port": free_port()})
        from serving.node.vllm_probe import LogprobsModeError

        with pytest.raises(LogprobsModeError, match="--logprobs-mode processed_logprobs"):
            run_node(settings, threading.Event())
        changed = [c.path for c in standin.calls if c.method == "POST" and c.path != "/v1/completions"]
        assert changed == [] and not standin.loras  # nothing loaded, nothing served


FULL_LINE = "full-node-line"
FULL_NODE = "vllm-full-0"


def captured(settings: Any, count: int) -> dict[str, Any]:
    """The generation events on the bus, by generation id (at least ``count`` of them, within 20 s)."""
    from flywheel.bus import make_bus
    from flywheel.events import GenerationEvent

    bus = make_bus(settings)
    consumer = bus.consumer("check", [settings.topic("generations")])
    events: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 20
        while len(events) < count and time.monotonic() < deadline:
            for record in consumer.poll(timeout_s=0.3, max_records=100):
                event = GenerationEvent.from_bytes(record.value)
                events[event.generation_id] = event
    finally:
        consumer.close()
        bus.close()
    return events


def test_the_gateway_captures_a_full_mode_node_with_the_version_that_produced_each_generation(
    tmp_path: Path, redis_url: str, live_prefix: str
) -> None:
    """The gateway in front of a full-mode node: it reaches the node's front (the heartbeat's URL),
    and every captured generation names the version whose weights decoded all of its tokens (the
    stand-in records them per token), across a promotion with a stream in flight, a session stuck
    on the old version, and a corrupt version that never reaches vLLM."""
    from serving.gateway.main import run as run_gateway
    from tests.integration.test_vllm_front import InThread

    rng = random.Random(13)
    base = make_state(rng)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(encode_full(base))
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    registry = Registry(sessions, FolderStore(tmp_path / "weights"), FULL_LINE)
    stop = threading.Event()
    with VllmStandIn(served_model_name=FULL_LINE, weights_path=str(model)) as standin, \
            httpx.Client(timeout=30) as http:
        settings = load_settings(
            data_dir=str(tmp_path), db={"url": db_url, "wait_s": 10}, model={"line": FULL_LINE, "path": str(model)},
            store={"path": str(tmp_path / "weights")},
            node={"engine": "vllm", "vllm_url": standin.url, "node_id": FULL_NODE, "poll_s": 0.2, "port": free_port()},
            live={"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix},
            bus={"kind": "local", "partitions": 1, "topic_prefix": f"full-{uuid.uuid4().hex[:8]}."},
            gateway={"port": free_port()})
        gateway, node = f"http://127.0.0.1:{settings.gateway.port}", f"http://127.0.0.1:{settings.node.port}"
        roles = [RoleThread("vllm-full-node", run_node, settings, stop),
                 RoleThread("gateway", run_gateway, settings, stop)]
        for role in roles:
            role.start()

        fleet = partial(fleet_shows, http, gateway, roles, FULL_NODE)
        chat = partial(chat_through, http, gateway)

        def front_engine() -> dict[str, Any]:
            return http.get(f"{node}/health").json()["engine"]

        served: list[tuple[str, int, str]] = []  # (session, version, generation)

        def record(r: httpx.Response) -> tuple[str, int]:
            session, version = r.headers["X-Flywheel-Session"], int(r.headers["X-Flywheel-Model-Version"])
            served.append((session, version, r.headers["X-Flywheel-Generation"]))
            return session, version

        try:
            wait_until("the gateway to see v0 on the node", lambda: fleet(0, {0}), timeout_s=60)
            with sessions() as s:
                assert s.scalar(select(Node.url).where(Node.node_id == FULL_NODE)) == node  # the front, not vLLM
            r = chat()
            assert (r.json()["model"], r.json()["model_version"]) == (FULL_LINE, 0)
            old, _ = record(r)
            record(chat(old, path="/v1/completions"))

            # A promotion while a stream is in flight: the stream finishes on v0, the reload waits for
            # it, and a request that comes meanwhile waits for the reload and is served by v1.
            standin.token_delay_s = 0.15

            def streamed() -> tuple[httpx.Response, list[Any]]:
                with http.stream("POST", f"{gateway}/v1/chat/completions",
                                 json={"messages": MESSAGES, "max_tokens": 10, "stream": True}) as s:
                    lines = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
                return s, [line if line == "[DONE]" else json.loads(line) for line in lines]

            in_flight = InThread(streamed)
            wait_until("vLLM decoding the stream", lambda: standin.in_flight == 1, timeout_s=10)
            v1 = registry.publish(train_step(rng, base), parent=0, parent_state=base)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("the node's reload waiting for the stream", lambda: front_engine()["reloading"], timeout_s=30)
            later = InThread(lambda: httpx.post(f"{node}/v1/chat/completions", timeout=30,
                                                json={"model": FULL_LINE, "messages": MESSAGES, "max_tokens": 2}))
            wait_until("the later request held back", lambda: front_engine()["queued"] == 1, timeout_s=10)
            assert "/collective_rpc" not in standin.paths()
            s, chunks = in_flight.result()
            assert s.status_code == 200 and s.headers["X-Flywheel-Model-Version"] == "0" and chunks[-1] == "[DONE]"
            assert {c["model_version"] for c in chunks[:-1]} == {0}
            served.append((s.headers["X-Flywheel-Session"], 0, s.headers["X-Flywheel-Generation"]))
            r = later.result()
            assert r.headers["X-Flywheel-Model-Version"] == "1" and r.json()["model_version"] == 1
            assert [g.weights for g in standin.generations if g.id == r.json()["id"]] == [[v1.sha256] * 2]
            standin.token_delay_s = 0

            wait_until("the gateway to see v1 on the node", lambda: fleet(1, {1}), timeout_s=60)
            new, version = record(chat())
            assert version == 1

            # A session still on v0: the node answers the built-in node's 409, the gateway moves it on.
            stale = http.post(f"{node}/v1/chat/completions", headers={"X-Flywheel-Model-Version": "0"},
                              json={"messages": MESSAGES})
            assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_unavailable"
            assert record(chat(old)) == (old, 1)

            # A corrupt version never reaches vLLM; the node keeps v1 and stamps it.
            state1 = registry.load(1)
            v2 = registry.publish(train_step(rng, state1), parent=1, parent_state=state1)
            blob = bytearray(registry.store.get(v2.store_key))
            blob[-3] ^= 0xFF
            registry.store.put(v2.store_key, bytes(blob))
            registry.set_status(v2.version, "stable", reason="test: corrupt")
            wait_until("the failure reported", lambda: http.get(f"{node}/health").json()["update_status"]
                       == "failed_update", timeout_s=30)
            assert standin.weights_sha256 == v1.sha256 and http.get(f"{node}/health").json()["version"] == 1
            assert record(chat())[1] == 1

            # Captured: one event per generation, naming the version that decoded every token.
            wait_until("the spool to ship", lambda: http.get(f"{gateway}/admin/capture").json()["events"] == 0,
                       timeout_s=30)
            events = captured(settings, len(served))
            generations = {g.id: g for g in standin.generations}
            for session, version, generation in served:
                event = events[generation]
                assert (event.session_id, event.model_line, event.model_version, event.node_id) == (
                    session, FULL_LINE, version, FULL_NODE)
                decoded = generations[event.response["id"]].weights
                assert decoded == [registry.get(version).sha256] * len(event.completion_token_ids), (generation, version)
            assert sorted({v for _, v, _ in served}) == [0, 1] and len(served) == 6
        finally:
            stop.set()
            for role in roles:
                role.join(timeout=30)
            db.dispose()
    assert all(r.error is None and not r.is_alive() for r in roles), [r.error for r in roles]


# --- LoRA mode ------------------------------------------------------------------------------------

LORA_LINE = "lora-node-line"
LORA_NODE = "vllm-lora-0"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_base_model(folder: Path, rng: random.Random, hidden: int = 32, layers: int = 2) -> Path:
    """A base model folder as vLLM would be started from (only its safetensors matter here)."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    state = {"model.embed_tokens.weight": torch.randn(50, hidden, generator=g).bfloat16(),
             "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        for proj in PROJ:
            state[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.randn(hidden, hidden, generator=g).bfloat16()
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g).bfloat16()
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(encode_full(state))
    return folder


def linear_layers(model: Path) -> dict[str, tuple[int, int]]:
    """The model's linear layers as vLLM's LoRA manager sees them: module -> (out_features, in_features)."""
    state = safetensors.torch.load_file(model / "model.safetensors")
    return {n.removesuffix(".weight"): tuple(t.shape) for n, t in state.items()
            if t.dim() == 2 and n.endswith("_proj.weight")}


def trained(rng: random.Random, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next adapter version: every B moved (as training moves it), A kept."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    return {name: (t.float() + torch.randn(t.shape, generator=g) * 0.01).bfloat16() if ".lora_B." in name else t.clone()
            for name, t in adapter.items()}


def lora_settings(tmp_path: Path, db_url: str, model: Path, vllm_url: str, **extra: Any) -> Any:
    return load_settings(data_dir=str(tmp_path), db={"url": db_url, "wait_s": 10},
                         model={"line": LORA_LINE, "path": str(model)}, trainer={"lora_rank": 4},
                         node={"engine": "vllm", "vllm_mode": "lora", "vllm_url": vllm_url, "node_id": LORA_NODE,
                               "poll_s": 0.2, "keep_versions": 2, **extra.pop("node", {})}, **extra)


def test_a_lora_mode_node_follows_promotions_and_rollbacks_and_keeps_corrupt_adapters_out(tmp_path: Path) -> None:
    from serving.rollout_actions import manual_rollback

    rng = random.Random(21)
    model = lora_base_model(tmp_path / "model", rng)
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    registry = Registry(sessions, FolderStore(tmp_path / "weights"), LORA_LINE)

    def node_row() -> tuple[int | None, str]:
        with sessions() as s:
            row = s.scalar(select(Node).where(Node.node_id == LORA_NODE))
            return (row.live_version, row.status) if row is not None else (None, "")

    stop = threading.Event()
    with VllmStandIn(max_lora_rank=8, lora_modules=linear_layers(model)) as standin:
        node = RoleThread("vllm-lora-node", run_node, lora_settings(tmp_path, db_url, model, standin.url), stop)
        node.start()

        def loads() -> list[str]:
            return [c.body["lora_name"] for c in standin.calls if c.path == "/v1/load_lora_adapter"]

        try:
            # An empty registry: the node publishes the zero adapter as stable v0, and vLLM serves it.
            wait_until("v0 bootstrapped and live", lambda: node_row() == (0, "serving"), timeout_s=30)
            v0 = registry.get(0)
            zero = registry.load(0)
            assert v0.status == "stable" and v0.kind == "full" and v0.metrics["base"].startswith("vllm node bootstrap")
            assert sorted(zero) == sorted(f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{x}.weight"
                                          for i in range(2) for p in PROJ for x in "AB")
            assert all(not t.any() for n, t in zero.items() if ".lora_B." in n)  # serves the base exactly
            assert all(t.abs().max() > 0 for n, t in zero.items() if ".lora_A." in n)  # so training can move B
            assert list(standin.loras) == [f"{LORA_LINE}-v0"] and loads() == [f"{LORA_LINE}-v0"]
            loaded = standin.loras[f"{LORA_LINE}-v0"]
            assert loaded["sha256"] == v0.sha256 and loaded["ignored"] == []  # every module reached a layer
            assert (loaded["config"]["r"], loaded["config"]["lora_alpha"], loaded["config"]["target_modules"]) == (
                4, 16.0, list(PROJ))
            assert not any(c.path in ("/collective_rpc", "/pause") for c in standin.calls)  # vLLM keeps its base

            # A promotion: the new adapter is loaded and goes live.
            state1 = trained(rng, zero)
            v1 = registry.publish(state1, parent=0, parent_state=zero)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("v1 live", lambda: node_row() == (1, "serving"), timeout_s=30)
            assert standin.loras[f"{LORA_LINE}-v1"]["sha256"] == v1.sha256

            # A canary is preloaded beside it, not made live; the oldest adapter is unloaded (keep 2).
            state2 = trained(rng, state1)
            v2 = registry.publish(state2, parent=1, parent_state=state1)
            registry.set_status(v2.version, "canary", reason="test")
            wait_until("the canary preloaded", lambda: sorted(standin.loras) == [f"{LORA_LINE}-v1", f"{LORA_LINE}-v2"],
                       timeout_s=30)
            wait_until("the node serving v1 beside the canary", lambda: node_row() == (1, "serving"), timeout_s=30)
            assert [c.body for c in standin.calls if c.path == "/v1/unload_lora_adapter"] == [
                {"lora_name": f"{LORA_LINE}-v0"}]

            # Promoting the canary and rolling it back switch between held adapters: nothing is loaded.
            before = loads()
            registry.set_status(v2.version, "stable", reason="test")
            wait_until("v2 live", lambda: node_row() == (2, "serving"), timeout_s=30)
            manual_rollback(registry, v2.version, "test")
            wait_until("v1 restored", lambda: node_row() == (1, "serving"), timeout_s=30)
            assert loads() == before and sorted(standin.loras) == [f"{LORA_LINE}-v1", f"{LORA_LINE}-v2"]

            # A corrupt adapter version never reaches vLLM; the node keeps v1 and says why.
            v3 = registry.publish(trained(rng, state1), parent=1, parent_state=state1)
            blob = bytearray(registry.store.get(v3.store_key))
            blob[-3] ^= 0xFF
            registry.store.put(v3.store_key, bytes(blob))
            registry.set_status(v3.version, "stable", reason="test: corrupt")
            wait_until("the failure reported", lambda: node_row() == (1, "failed_update"), timeout_s=30)
            assert f"{LORA_LINE}-v3" not in loads() and not (tmp_path / "vllm" / f"{LORA_LINE}-v3").exists()
            assert node.error is None and node.is_alive()
        finally:
            stop.set()
            node.join(timeout=30)
            db.dispose()
    assert node.error is None


def test_lora_mode_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match="vllm_mode"):
        load_settings(node={"vllm_mode": "lora"})  # the built-in engine serves full weights
    with pytest.raises(SettingsError, match="lora_rank"):
        load_settings(trainer={"lora_publish": "adapter"})


def test_the_gateway_names_the_lora_version_to_vllm_and_the_client_sees_the_line(
    tmp_path: Path, redis_url: str, live_prefix: str
) -> None:
    """The gateway in front of a LoRA-mode node: vLLM is sent ``<line>-v<version>`` for the session's
    version, with vLLM's API key; the client and the captured event see the line and the version, as
    from a built-in node."""
    from flywheel.bus import make_bus
    from flywheel.events import GenerationEvent
    from serving.gateway.main import run as run_gateway

    rng = random.Random(5)
    model = lora_base_model(tmp_path / "model", rng)
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    registry = Registry(make_session_factory(db), FolderStore(tmp_path / "weights"), LORA_LINE)
    stop = threading.Event()
    # vLLM started with --api-key: the node and the gateway (which talks to vLLM directly) send it.
    with VllmStandIn(served_model_name="base", max_lora_rank=8, lora_modules=linear_layers(model),
                     api_key="lora-key") as standin, httpx.Client(timeout=30) as http:
        settings = lora_settings(
            tmp_path, db_url, model, standin.url, store={"path": str(tmp_path / "weights")},
            node={"vllm_api_key": "lora-key"},
            live={"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix},
            bus={"kind": "local", "partitions": 1, "topic_prefix": f"lora-{uuid.uuid4().hex[:8]}."},
            gateway={"port": free_port()})
        gateway = f"http://127.0.0.1:{settings.gateway.port}"
        roles = [RoleThread("vllm-lora-node", run_node, settings, stop),
                 RoleThread("gateway", run_gateway, settings, stop)]
        for role in roles:
            role.start()

        fleet = partial(fleet_shows, http, gateway, roles, LORA_NODE)
        chat = partial(chat_through, http, gateway)

        def sent() -> str:
            return [c.body["model"] for c in standin.calls if c.path.endswith("completions")][-1]

        served: list[tuple[str, int, str]] = []  # (session, version, generation)

        def record(r: httpx.Response) -> tuple[str, int]:
            session, version = r.headers["X-Flywheel-Session"], int(r.headers["X-Flywheel-Model-Version"])
            served.append((session, version, r.headers["X-Flywheel-Generation"]))
            return session, version

        try:
            wait_until("the gateway to see v0 on the node", lambda: fleet(0, {0}), timeout_s=60)
            r = chat()
            body = r.json()
            assert (body["model"], body["model_version"]) == (LORA_LINE, 0) and sent() == f"{LORA_LINE}-v0"
            assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body  # only what was asked
            old, _ = record(r)

            zero = registry.load(0)
            v1 = registry.publish(trained(rng, zero), parent=0, parent_state=zero)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("the gateway to see v1 on the node", lambda: fleet(1, {0, 1}), timeout_s=60)
            assert record(chat(old)) == (old, 0) and sent() == f"{LORA_LINE}-v0"  # sticky: the session keeps v0
            r = chat()
            new, version = record(r)
            assert version == 1 and sent() == f"{LORA_LINE}-v1" and r.json()["model"] == LORA_LINE

            # A stream: every chunk names the line and the version; the text endpoint too.
            with http.stream("POST", f"{gateway}/v1/chat/completions", headers={"X-Flywheel-Session": new},
                             json={"messages": MESSAGES, "max_tokens": 3, "stream": True}) as s:
                assert s.status_code == 200 and s.headers["X-Flywheel-Model-Version"] == "1"
                lines = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
                served.append((new, 1, s.headers["X-Flywheel-Generation"]))
            chunks = [json.loads(line) for line in lines[:-1]]
            assert lines[-1] == "[DONE]" and chunks and sent() == f"{LORA_LINE}-v1"
            assert all((c["model"], c["model_version"]) == (LORA_LINE, 1) for c in chunks)
            r = chat(new, path="/v1/completions")
            assert (r.json()["model"], r.json()["model_version"]) == (LORA_LINE, 1) and sent() == f"{LORA_LINE}-v1"
            record(r)
            # n = 2, streamed: vLLM interleaves the choices; each is captured as its own generation.
            with http.stream("POST", f"{gateway}/v1/chat/completions", headers={"X-Flywheel-Session": new},
                             json={"messages": MESSAGES, "max_tokens": 3, "stream": True, "n": 2}) as s:
                assert s.status_code == 200
                lines = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
                pair = [g.strip() for g in s.headers["X-Flywheel-Generation"].split(",")]
            assert lines[-1] == "[DONE]" and len(pair) == 2 and sent() == f"{LORA_LINE}-v1"
            assert {json.loads(line)["choices"][0]["index"] for line in lines[:-1]} == {0, 1}
            served += [(new, 1, g) for g in pair]

            # vLLM loses v0 behind the node's back: its 404 moves the session on, as a node's 409 would.
            gone = http.post(f"{standin.url}/v1/unload_lora_adapter", json={"lora_name": f"{LORA_LINE}-v0"},
                             headers={"Authorization": "Bearer lora-key"})
            assert gone.status_code == 200
            r = chat(old)
            assert record(r) == (old, 1) and sent() == f"{LORA_LINE}-v1"
            assert [c.body["model"] for c in standin.calls if c.path.endswith("completions")][-2:] == [
                f"{LORA_LINE}-v0", f"{LORA_LINE}-v1"]

            # Captured: one event per generation, naming the line, the version and the node.
            wait_until("the spool to ship", lambda: http.get(f"{gateway}/admin/capture").json()["events"] == 0,
                       timeout_s=30)
            bus = make_bus(settings)
            consumer = bus.consumer("check", [settings.topic("generations")])
            events: dict[str, GenerationEvent] = {}
            try:
                deadline = time.monotonic() + 20
                while len(events) < len(served) and time.monotonic() < deadline:
                    for record_ in consumer.poll(timeout_s=0.3, max_records=100):
                        event = GenerationEvent.from_bytes(record_.value)
                        events[event.generation_id] = event
            finally:
                consumer.close()
                bus.close()
            assert [events[g].choice_index for g in pair] == [0, 1] and events[pair[0]].group_id is not None
            for session, version, generation in served:
                event = events[generation]
                assert (event.session_id, event.model_line, event.model_version, event.node_id) == (
                    session, LORA_LINE, version, LORA_NODE)
                assert event.response["model"] == LORA_LINE and event.response["model_version"] == version
                assert len(event.completion_token_ids) == len(event.completion_logprobs) == 3
        finally:
            stop.set()
            for role in roles:
                role.join(timeout=30)
            db.dispose()
    assert all(r.error is None and not r.is_alive() for r in roles), [r.error for r in roles]
