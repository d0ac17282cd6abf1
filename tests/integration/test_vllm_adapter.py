"""The vLLM adapter against a stand-in vLLM HTTP server, with a real registry (SQLite and
PostgreSQL) and folder store: LoRA load/unload, full-weight reloads, failures, corrupt objects."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch

from flywheel.weights.codec.state import encode_full, state_sha256
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.node.updater import Updater
from serving.node.vllm_adapter import VllmAdapter
from tests.fixtures.vllm_standin import VllmStandIn
from tests.integration.test_registry import train_step

pytestmark = pytest.mark.integration

LORA_CONFIG = {"lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "base-model"}


@pytest.fixture
def standin():
    with VllmStandIn() as server:
        yield server


def lora_state(rng: random.Random, rank: int = 4, hidden: int = 32, layers: int = 2) -> dict[str, torch.Tensor]:
    """A PEFT-shaped LoRA adapter state (names as PEFT saves them, without the adapter name)."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    state = {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            state[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * 0.02).bfloat16()
            state[f"{prefix}.lora_B.weight"] = (torch.randn(hidden, rank, generator=g) * 0.02).bfloat16()
    return state


def full_state(rng: random.Random) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    return {
        "model.embed_tokens.weight": (torch.randn(300, 64, generator=g) * 0.02).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 64, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(64),
    }


def publish_chain(registry: Registry, first: dict[str, torch.Tensor], n: int, rng: random.Random):
    states, infos = [first], [registry.publish(first, parent=None)]
    for v in range(1, n):
        states.append(train_step(rng, states[-1]))
        infos.append(registry.publish(states[v], parent=v - 1, parent_state=states[v - 1]))
    return states, infos


# --- LoRA ---------------------------------------------------------------------------------------


def test_lora_versions_load_and_old_ones_unload(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-line", full_every=3)
    states, infos = publish_chain(registry, lora_state(rng), 5, rng)
    assert {i.kind for i in infos} == {"full", "delta"}  # deltas are rebuilt before they reach vLLM
    work = tmp_path / "work"
    adapter = VllmAdapter(standin.url, registry, work, mode="lora", keep_versions=2, lora_config=LORA_CONFIG,
                          served_model_name="base-model")

    for info in infos:
        outcome = adapter.apply(info.version)
        assert outcome.ok and outcome.changed and outcome.version == info.version, outcome
        assert adapter.current() == (info.version, info.sha256)

    names = [f"lora-line-v{v}" for v in range(5)]
    loads = [c.body for c in standin.calls if c.path == "/v1/load_lora_adapter"]
    unloads = [c.body for c in standin.calls if c.path == "/v1/unload_lora_adapter"]
    assert [b["lora_name"] for b in loads] == names
    assert [b["lora_path"] for b in loads] == [str(work / n) for n in names]
    assert unloads == [{"lora_name": n} for n in names[:3]]  # oldest first, the last two stay
    assert sorted(standin.loras) == names[3:]
    assert adapter.versions() == [3, 4]
    assert adapter.model_for() == "lora-line-v4" and adapter.model_for(3) == "lora-line-v3"
    assert sorted(adapter.loaded_models()) == sorted(["base-model", *names[3:]])

    # What vLLM read is the registry's version, bit for bit, in PEFT layout; unloaded folders are gone.
    assert sorted(p.name for p in work.iterdir()) == names[3:]
    for v in (3, 4):
        folder = work / f"lora-line-v{v}"
        assert (folder / "adapter_model.safetensors").read_bytes() == encode_full(states[v])
        assert state_sha256(safetensors.torch.load_file(folder / "adapter_model.safetensors")) == infos[v].sha256
        assert standin.loras[f"lora-line-v{v}"]["sha256"] == infos[v].sha256
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4
        assert config["target_modules"] == ["q_proj", "v_proj"] and config["lora_alpha"] == 16

    # An older held version goes live again without a load; a canary preload stays beside it.
    before = len(standin.calls)
    assert adapter.apply(3).changed and adapter.current()[0] == 3
    assert len(standin.calls) == before
    # ... and the next version is rebuilt on top of it (its state is the base for the delta).
    nxt = registry.publish(train_step(rng, states[3]), parent=3, parent_state=states[3])
    assert adapter.apply(nxt.version).ok and adapter.current() == (nxt.version, nxt.sha256)
    assert sorted(standin.loras) == [f"lora-line-v{v}" for v in (3, nxt.version)]


def test_updater_drives_the_lora_adapter(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    """The node's Updater follows stable and preloads canary through the adapter unchanged."""
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-upd")
    states, infos = publish_chain(registry, lora_state(rng), 3, rng)
    registry.set_status(1, "stable", reason="test")
    registry.set_status(2, "canary", reason="test")
    adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", keep_versions=2,
                          lora_config=LORA_CONFIG)
    updater = Updater(adapter, registry, _settings())
    outcome = updater.check_once()
    assert outcome.ok and outcome.version == 1
    assert adapter.current() == (1, infos[1].sha256)
    assert adapter.versions() == [1, 2]  # canary loaded, not live
    assert sorted(standin.loras) == ["lora-upd-v1", "lora-upd-v2"]


def test_lora_failure_keeps_previous_version(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-fail")
    states, infos = publish_chain(registry, lora_state(rng), 3, rng)
    adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", keep_versions=2,
                          lora_config=LORA_CONFIG, request_timeout_s=0.5)
    assert adapter.apply(0).ok

    standin.fail("/v1/load_lora_adapter", 500, "CUDA out of memory")
    outcome = adapter.apply(1)
    assert not outcome.ok and not outcome.changed and outcome.version == 0
    assert "CUDA out of memory" in outcome.detail and adapter.status == "failed_update"
    assert adapter.current() == (0, infos[0].sha256) and adapter.versions() == [0]

    # vLLM does not answer in time: bounded, and nothing is reported live.
    standin.hang("/v1/load_lora_adapter", 2.0)
    started = time.monotonic()
    outcome = adapter.apply(1)
    assert time.monotonic() - started < 1.8
    assert not outcome.ok and "no answer in time" in outcome.detail
    assert adapter.current()[0] == 0 and not adapter.holds(1)
    time.sleep(2.2)  # let the stand-in finish the hung request (it did load it)

    # The retry finds the adapter already in vLLM (same name, same bytes) and takes it.
    assert adapter.apply(1).ok and adapter.current() == (1, infos[1].sha256)

    # vLLM accepts the adapter, then cannot list it: not reported, the previous one stays live.
    standin.fail("/v1/models", 500, "boom", skip=1)
    outcome = adapter.apply(2)
    assert not outcome.ok and "boom" in outcome.detail and "lora-fail-v2" in standin.loras
    assert adapter.current() == (1, infos[1].sha256) and not adapter.holds(2)

    # vLLM answers 200 to the load but does not list the adapter: not reported either.
    del standin.loras["lora-fail-v2"]
    standin.list_loras = False
    outcome = adapter.apply(2)
    assert not outcome.ok and "does not list it" in outcome.detail
    assert adapter.current() == (1, infos[1].sha256) and not adapter.holds(2)
    assert not (tmp_path / "work" / "lora-fail-v2").exists()


def test_lora_endpoints_off_is_reported(sessions, tmp_path: Path, rng) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-off")
    registry.publish(lora_state(rng), parent=None)
    with VllmStandIn(runtime_lora=False) as server:
        adapter = VllmAdapter(server.url, registry, tmp_path / "work", mode="lora", lora_config=LORA_CONFIG)
        outcome = adapter.apply(0)
    assert not outcome.ok and outcome.version is None
    assert "HTTP 404" in outcome.detail and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in outcome.detail


def test_not_a_lora_state_is_refused(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-bad")
    registry.publish(full_state(rng), parent=None)
    adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", lora_config=LORA_CONFIG)
    outcome = adapter.apply(0)
    assert not outcome.ok and "not a PEFT LoRA adapter" in outcome.detail
    assert standin.calls == []


# --- full weights -------------------------------------------------------------------------------


def _full_setup(sessions, tmp_path: Path, standin: VllmStandIn, rng, n: int = 4, **kwargs):
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "full-line", full_every=3)
    states, infos = publish_chain(registry, full_state(rng), n, rng)
    standin.param_shapes = {k: tuple(t.shape) for k, t in states[0].items()}
    base = tmp_path / "base-model"  # the folder vLLM was started from (version 0)
    base.mkdir()
    (base / "model.safetensors").write_bytes(encode_full(states[0]))
    adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="full", served_model_name="base-model",
                          base_version=0, base_path=base, **kwargs)
    return registry, states, infos, adapter


def test_full_weight_update_call_sequence(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng)
    assert adapter.current() == (0, infos[0].sha256)

    outcome = adapter.apply(2)
    assert outcome.ok and outcome.changed and adapter.current() == (2, infos[2].sha256)
    folder = tmp_path / "work" / "full" / "full-line-v2"
    assert [(c.method, c.path) for c in standin.calls] == [
        ("POST", "/pause"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/resume")]
    assert standin.calls[0].query == {"mode": ["wait"], "wait_for_inflight_requests": ["true"]}
    assert standin.pause_modes == ["wait"]
    rpc = standin.calls[1].body
    assert rpc["method"] == "reload_weights"
    assert rpc["kwargs"] == {"weights_path": str(folder), "is_checkpoint_format": True}
    assert rpc["timeout"] > 0
    assert standin.weights_sha256 == infos[2].sha256 and not standin.paused
    written = safetensors.torch.load_file(folder / "model.safetensors")  # rebuilt file to file, never held whole
    assert state_sha256(written) == infos[2].sha256 and written.keys() == states[2].keys()
    assert all(torch.equal(written[k].view(torch.int16), states[2][k].view(torch.int16)) for k in written)
    assert adapter.model_for() == "base-model" and adapter.versions() == [2]

    assert adapter.apply(3).ok and standin.weights_sha256 == infos[3].sha256
    assert sorted(p.name for p in (tmp_path / "work" / "full").iterdir()) == ["full-line-v3"]
    assert standin.prefix_cache_resets == 2


def test_full_failure_restores_previous_version(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng)
    assert adapter.apply(1).ok

    standin.fail("/collective_rpc", 500, "RuntimeError: CUDA error: an illegal memory access")
    outcome = adapter.apply(2)
    assert not outcome.ok and outcome.version == 1
    assert "illegal memory access" in outcome.detail and "version 1 restored" in outcome.detail
    rpcs = [c.body["kwargs"]["weights_path"] for c in standin.calls if c.path == "/collective_rpc"]
    assert rpcs[-2:] == [str(tmp_path / "work/full/full-line-v2"), str(tmp_path / "work/full/full-line-v1")]
    assert standin.weights_sha256 == infos[1].sha256 and not standin.paused
    assert adapter.current() == (1, infos[1].sha256)

    # Restoring fails too: the adapter no longer claims any version.
    standin.fail("/collective_rpc", 500, "engine dead", times=2)
    outcome = adapter.apply(2)
    assert not outcome.ok and outcome.version is None and "weights unknown" in outcome.detail
    assert adapter.current() == (None, "")

    # A later full load (no base) brings it back.
    assert adapter.apply(3).ok and adapter.current() == (3, infos[3].sha256)
    assert standin.weights_sha256 == infos[3].sha256


def test_full_refusal_and_dev_mode_off(sessions, tmp_path: Path, rng) -> None:
    with VllmStandIn(dev_mode=False) as server:
        registry, states, infos, adapter = _full_setup(sessions, tmp_path, server, rng, n=2)
        outcome = adapter.apply(1)
        assert not outcome.ok and outcome.version == 0
        assert "HTTP 404" in outcome.detail and "VLLM_SERVER_DEV_MODE=1" in outcome.detail
        assert [c.path for c in server.calls] == ["/pause"]  # refused before anything was touched


def test_full_timeout_is_bounded(sessions, tmp_path: Path, standin: VllmStandIn, rng) -> None:
    registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng, n=2, reload_timeout_s=0.5,
                                                   request_timeout_s=0.5)
    standin.hang("/collective_rpc", 1.5)
    started = time.monotonic()
    outcome = adapter.apply(1)
    assert time.monotonic() - started < 5.0  # the reload and the restore each give up after 0.5 s
    assert not outcome.ok and "no answer in time" in outcome.detail
    assert adapter.current()[0] in (0, None) and adapter.current()[0] != 1


# --- corrupt objects ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_corrupt_registry_object_never_reaches_vllm(sessions, tmp_path: Path, standin: VllmStandIn, rng,
                                                    mode: str) -> None:
    store = FolderStore(tmp_path / "store")
    registry = Registry(sessions, store, f"corrupt-{mode}")
    first = lora_state(rng) if mode == "lora" else full_state(rng)
    info = registry.publish(first, parent=None)
    path = tmp_path / "store" / info.store_key
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit in the last tensor's bytes
    path.write_bytes(bytes(data))

    kwargs = {"lora_config": LORA_CONFIG} if mode == "lora" else {}
    adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode=mode, **kwargs)
    outcome = adapter.apply(info.version)
    assert not outcome.ok and "WeightsError" in outcome.detail
    assert standin.calls == [] and adapter.current() == (None, "")
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("*.safetensors"))

    # swap() re-hashes what it is handed: weights that do not match the hash never leave.
    with pytest.raises(ValueError, match="do not match"):
        adapter.swap(info.version, train_step(rng, first, 0.5), info.sha256)
    assert standin.calls == []


def _settings():
    from flywheel.settings import Settings

    return Settings()


# --- adapter lines: what the trainer publishes, the node bootstraps, and vLLM accepts --------------


def _tiny_linear_layers(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def test_the_trainers_adapter_versions_load_into_vllm(sessions, tmp_path: Path, tiny_model_dir: Path) -> None:
    """``trainer.lora_publish = "adapter"`` versions, published and loaded through the registry, pass the
    stand-in's vLLM checks (config, tensor names, the model's layers and their shapes); the node's
    zero adapter has exactly the trainer's names, shapes and dtype."""
    import copy

    from flywheel.lm import load_model
    from flywheel.settings import TrainerSettings
    from serving.node.vllm_files import zero_adapter_state
    from trainer.policy import Policy

    tiny, _ = load_model(tiny_model_dir)
    layers = _tiny_linear_layers(tiny)
    cfg = TrainerSettings(lora_rank=4, lora_publish="adapter")
    policy = Policy(copy.deepcopy(tiny), cfg)
    v0 = policy.export()
    zero = zero_adapter_state(tiny_model_dir, cfg.lora_rank, cfg.lora_targets)
    assert {k: (t.shape, t.dtype) for k, t in zero.items()} == {k: (t.shape, t.dtype) for k, t in v0.items()}
    assert all(not t.any() for k, t in zero.items() if ".lora_B." in k)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.02)  # what training does to B
    v1 = policy.export()

    registry = Registry(sessions, FolderStore(tmp_path / "store"), "adapter-line")
    i0 = registry.publish(v0, parent=None)
    i1 = registry.publish(v1, parent=0, parent_state=v0)
    lora_config = {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "target_modules": list(cfg.lora_targets)}
    with VllmStandIn(max_lora_rank=8, lora_modules=layers) as standin:
        adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", keep_versions=2,
                              lora_config=lora_config)
        for info in (i0, i1):
            outcome = adapter.apply(info.version)
            assert outcome.ok and outcome.changed, outcome
            loaded = standin.loras[f"adapter-line-v{info.version}"]
            assert loaded["sha256"] == info.sha256 and loaded["ignored"] == []
        assert adapter.model_names() == {0: "adapter-line-v0", 1: "adapter-line-v1"}

        # The same adapter for a smaller vLLM limit, or with the wrong rank in its config, is refused:
        # by vLLM (its message), or by the adapter before vLLM reads anything.
        strict = VllmStandIn(max_lora_rank=2, lora_modules=layers).start()
        try:
            small = VllmAdapter(strict.url, registry, tmp_path / "work-strict", mode="lora", lora_config=lora_config)
            outcome = small.apply(1)
            assert not outcome.ok and "LoRA rank 4 is greater than max_lora_rank 2" in outcome.detail
        finally:
            strict.stop()
        wrong = VllmAdapter(standin.url, registry, tmp_path / "work-wrong", mode="lora",
                            lora_config={**lora_config, "r": 8})
        calls = len(standin.calls)
        outcome = wrong.apply(1)
        assert not outcome.ok and "rank is 4" in outcome.detail and len(standin.calls) == calls


@pytest.mark.parametrize("version", ["0.18", "0.33"])
def test_the_standin_refuses_what_vllm_refuses(tmp_path: Path, rng, version: str) -> None:
    """The stand-in's LoRA checks are not vacuous: names vLLM cannot parse, modules the model has no
    LoRA layer for, and shapes that do not fit are refused with vLLM's messages, as 500
    ``InternalServerError`` (the engine's failure; tests/fixtures/vllm_standin.py cites where)."""
    layers = {f"model.layers.{i}.self_attn.{p}": (32, 32) for i in range(2) for p in ("q_proj", "v_proj")}
    good = lora_state(rng)

    def load(state: dict[str, torch.Tensor], name: str, standin: VllmStandIn) -> Any:
        folder = tmp_path / version / name
        folder.mkdir(parents=True)
        safetensors.torch.save_file(state, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, **LORA_CONFIG}))
        return httpx.post(f"{standin.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})

    with VllmStandIn(lora_modules=layers, vllm_version=version) as standin:
        assert load(good, "good", standin).status_code == 200 and standin.loras["good"]["ignored"] == []
        renamed = {k.replace(".lora_A.", ".lora_down."): v for k, v in good.items()}
        r = load(renamed, "renamed", standin)
        assert r.status_code == 500 and "is unsupported LoRA weight" in r.json()["error"]["message"]
        mlp = {k.replace("self_attn.q_proj", "mlp.gate_proj"): v for k, v in good.items()}
        r = load(mlp, "mlp", standin)
        assert r.status_code == 500 and "expected target modules in" in r.json()["error"]["message"]
        wide = {k: torch.cat([v, v], dim=1) if ".lora_A." in k else v for k, v in good.items()}
        r = load(wide, "wide", standin)
        assert r.status_code == 500 and "do not fit" in r.json()["error"]["message"]
        elsewhere = {k.replace("layers.1.", "layers.7."): v for k, v in good.items()}
        assert load(elsewhere, "elsewhere", standin).status_code == 200  # vLLM ignores modules it lacks
        assert r.json()["error"]["type"] == "InternalServerError"
        assert standin.loras["elsewhere"]["ignored"] == [f"model.layers.7.self_attn.{p}" for p in ("q_proj", "v_proj")]


def test_the_standins_pause_follows_vllms_scheduler(tmp_path: Path) -> None:
    """The stand-in pauses as vLLM's engine does: ``mode=wait`` answers once the completions in flight
    have finished, completions sent while paused start only after ``/resume``, ``abort`` ends those
    in flight at once, and each generation records the weights that decoded every token."""
    with VllmStandIn(served_model_name="m") as standin, httpx.Client(base_url=standin.url, timeout=30) as http:
        def complete(max_tokens: int) -> dict[str, Any]:
            return http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": max_tokens}).json()

        standin.token_delay_s = 0.1
        slow = threading.Thread(target=complete, args=(10,))
        slow.start()
        while standin.in_flight == 0:
            time.sleep(0.01)
        started = time.monotonic()
        assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
        assert time.monotonic() - started > 0.3 and standin.in_flight == 0  # it waited for the slow one
        slow.join(5)
        assert standin.generations[0].finish_reason == "length" and len(standin.generations[0].weights) == 10

        answers: list[dict[str, Any]] = []
        held = threading.Thread(target=lambda: answers.append(complete(2)))
        held.start()
        time.sleep(0.3)
        assert not answers and standin.in_flight == 0  # not scheduled while paused
        standin.weights_sha256 = "after-the-reload"
        http.post("/resume")
        held.join(5)
        assert answers[0]["choices"][0]["finish_reason"] == "length"
        assert standin.generations[1].weights == ["after-the-reload"] * 2

        aborted = threading.Thread(target=lambda: answers.append(complete(50)))
        aborted.start()
        while len(standin.generations) < 3 or not standin.generations[2].weights:  # a token decoded
            time.sleep(0.01)
        started = time.monotonic()
        assert http.post("/pause", params={"mode": "abort"}).status_code == 200
        aborted.join(5)
        assert time.monotonic() - started < 2 and answers[1]["choices"][0]["finish_reason"] == "abort"
        assert 0 < len(answers[1]["choices"][0]["token_ids"]) < 50
        http.post("/resume")


def test_a_restarted_lora_node_takes_over_what_vllm_holds_and_unloads_the_rest(
    sessions, tmp_path: Path, standin: VllmStandIn, rng
) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-restart")
    states, infos = publish_chain(registry, lora_state(rng), 2, rng)
    before = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", lora_config=LORA_CONFIG)
    assert before.apply(0).ok and before.apply(1).ok
    before.close()  # the node process ends; vLLM keeps both adapters

    after = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", lora_config=LORA_CONFIG)
    calls = len(standin.calls)
    assert after.wait_ready(threading.Event()) and after.apply(1).ok
    assert "/v1/load_lora_adapter" not in [c.path for c in standin.calls[calls:]]  # v1 taken as vLLM holds it
    assert after.unload_strays() == ["lora-restart-v0"] and after.unload_strays() == []
    assert sorted(standin.loras) == ["lora-restart-v1"] and not (tmp_path / "work" / "lora-restart-v0").exists()
    assert after.model_names() == {1: "lora-restart-v1"} and after.current() == (1, infos[1].sha256)


# --- what differs between vLLM 0.18 and 0.33, and the start-up checks ------------------------------


def test_a_partial_full_state_is_refused_before_vllm_which_would_take_it(sessions, tmp_path: Path,
                                                                          standin: VllmStandIn, rng) -> None:
    """vLLM reloads a file lacking some tensors with only a warning (the stand-in shows it); the
    adapter checks the names and shapes against the start-up weights and keeps serving what it had."""
    registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng, n=2)
    partial = {k: v for k, v in train_step(rng, states[1]).items() if k != "model.norm.weight"}
    info = registry.publish(partial, parent=None)
    folder = tmp_path / "direct"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(encode_full(partial))
    assert httpx.post(f"{standin.url}/collective_rpc", json={"method": "reload_weights", "kwargs": {
        "weights_path": str(folder)}}).status_code == 200  # vLLM itself takes it
    assert "model.norm.weight" in standin.reload_warnings[-1]
    httpx.post(f"{standin.url}/collective_rpc", json={"method": "reload_weights", "kwargs": {
        "weights_path": str(tmp_path / "base-model")}})
    standin.calls.clear()

    outcome = adapter.apply(info.version)
    assert not outcome.ok and outcome.version == 0
    assert "lacks 1: model.norm.weight" in outcome.detail and "not sent to vLLM" in outcome.detail
    assert standin.calls == [] and standin.weights_sha256 == infos[0].sha256
    assert adapter.apply(1).ok and adapter.current() == (1, infos[1].sha256)


@pytest.mark.parametrize("version", ["0.18", "0.33"])
def test_a_failed_prefix_cache_reset_is_a_failed_reload(sessions, tmp_path: Path, rng, version: str) -> None:
    """0.33's /reset_prefix_cache says {"success": false} while blocks are held: retried, then the
    reload fails and the previous version is restored; 0.18 says nothing either way."""
    with VllmStandIn(vllm_version=version) as standin:
        registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng, n=3)
        adapter.prepare()
        standin.fail_prefix_cache_resets = 1  # one false answer: the retry succeeds
        assert adapter.apply(1).ok and adapter.current() == (1, infos[1].sha256)
        standin.fail_prefix_cache_resets = 3
        outcome = adapter.apply(2)
        if version == "0.18":
            assert outcome.ok and adapter.current() == (2, infos[2].sha256)
            return
        assert not outcome.ok and outcome.version == 1
        assert '{"success": false}' in outcome.detail and "version 1 restored" in outcome.detail
        assert standin.weights_sha256 == infos[1].sha256 and adapter.current() == (1, infos[1].sha256)
        assert standin.weight_version == "full-line-v1" and not standin.paused


@pytest.mark.parametrize("version", ["0.18", "0.33"])
def test_the_adapter_labels_vllms_weights_where_vllm_has_labels(sessions, tmp_path: Path, rng, version: str) -> None:
    with VllmStandIn(vllm_version=version) as standin:
        registry, states, infos, adapter = _full_setup(sessions, tmp_path, standin, rng, n=2)
        adapter.prepare()
        assert adapter.weight_versions is (version == "0.33")
        assert adapter.apply(1).ok
        paths = [c.path for c in standin.calls]
        if version == "0.33":
            assert standin.weight_version == "full-line-v1"
            assert paths[-3:] == ["/reset_prefix_cache", "/update_weight_version", "/resume"]  # labelled while paused
            r = httpx.post(f"{standin.url}/v1/completions", json={"model": "base-model", "prompt": "x",
                                                                   "max_tokens": 3, "return_weight_versions": True})
            assert r.json()["choices"][0]["weight_versions"] == [{"version": "full-line-v1", "start": 0, "end": 3}]
        else:
            assert "/update_weight_version" not in paths and standin.calls[0].path == "/weight_info"


def test_a_lora_load_failure_is_vllms_500_and_keeps_the_previous_version(sessions, tmp_path: Path, rng) -> None:
    """A real refusal, not an injected one: vLLM's max LoRA rank below the adapter's."""
    with VllmStandIn(max_lora_rank=16) as standin:
        registry = Registry(sessions, FolderStore(tmp_path / "store"), "lora-500")
        small = lora_state(rng, rank=4)
        info0 = registry.publish(small, parent=None)
        adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="lora", lora_config=LORA_CONFIG)
        assert adapter.apply(0).ok
        standin.max_lora_rank = 2
        info1 = registry.publish(lora_state(rng, rank=4), parent=None)
        outcome = adapter.apply(info1.version)
        assert not outcome.ok and outcome.version == 0
        assert "HTTP 500" in outcome.detail and "greater than max_lora_rank" in outcome.detail
        assert adapter.current() == (0, info0.sha256) and not (tmp_path / "work" / f"lora-500-v{info1.version}").exists()


@pytest.mark.parametrize("version", ["0.18", "0.33"])
def test_the_api_key_reaches_vllm_and_guards_what_vllm_guards(sessions, tmp_path: Path, rng, version: str) -> None:
    with VllmStandIn(api_key="s3cret", vllm_version=version) as standin:
        assert httpx.get(f"{standin.url}/v1/models").status_code == 401
        assert httpx.get(f"{standin.url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert httpx.get(f"{standin.url}/v2/anything").status_code == (401 if version == "0.33" else 404)
        assert httpx.post(f"{standin.url}/resume").status_code == 200  # dev routes: no authentication
        registry = Registry(sessions, FolderStore(tmp_path / "store"), "keyed")
        publish_chain(registry, lora_state(rng), 1, rng)
        keyless = VllmAdapter(standin.url, registry, tmp_path / "w1", mode="lora", lora_config=LORA_CONFIG)
        outcome = keyless.apply(0)
        assert not outcome.ok and "HTTP 401" in outcome.detail
        adapter = VllmAdapter(standin.url, registry, tmp_path / "w2", mode="lora", lora_config=LORA_CONFIG,
                              api_key="s3cret")
        assert adapter.apply(0).ok and "keyed-v0" in standin.loras
        adapter.check_logprobs_mode()


@pytest.mark.parametrize("scale", [1.0, 40.0], ids=["spread", "peaked"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_probe_tells_raw_from_processed_logprobs(tmp_path: Path, mode: str, scale: float) -> None:
    """Against the stand-in's canned logits in each mode, a spread and a peaked model, with a
    generation_config.json that would set top_k and temperature for a request that left them out."""
    from serving.node.vllm_probe import LogprobsModeError

    with VllmStandIn(logprobs_mode=mode, logit_scale=scale, generation_config={"top_k": 2, "temperature": 0.7}) as s:
        adapter = VllmAdapter(s.url, _NoRegistry(), tmp_path, mode="full", served_model_name="base-model")
        if mode == "processed_logprobs":
            adapter.check_logprobs_mode()
        else:
            with pytest.raises(LogprobsModeError, match="--logprobs-mode processed_logprobs"):
                adapter.check_logprobs_mode()
        assert all(c.body["temperature"] in (1.0, 2.0) and c.body["top_p"] == 1.0 for c in s.calls)


def test_the_probe_refuses_what_it_cannot_decide() -> None:
    from serving.node.vllm_probe import classify

    tie = [("token_id:1", -0.6931), ("token_id:2", -0.6931)]  # two tied tokens, no other mass
    assert classify(tie, tie) is None
    assert classify([("token_id:1", -0.1), ("token_id:2", -2.5)], [("token_id:1", -0.1), ("token_id:3", -2.5)]) is None
    raw = [("token_id:1", -0.01), ("token_id:2", -30.0)]
    assert classify(raw, raw) == "raw"  # peaked: the processed prediction is (-3e-7, -15)
    assert classify(raw, [("token_id:1", -3e-7), ("token_id:2", -15.0)]) == "processed"


class _NoRegistry:
    model_line = "probe-line"


def test_the_standins_logprobs_follow_vllms_sampler() -> None:
    """Hand-computed: logits (0, -0.95, -1.9, ...): raw is their log-softmax whatever the request;
    processed at temperature 2 with top_k 2 is the log-softmax of (0, -0.475); greedy ignores temperature."""
    import math

    from tests.fixtures import vllm_sampler

    logits = vllm_sampler.canned_logits(5)
    assert vllm_sampler.top(logits, 3) == [5, 6, 7] and logits[6] == pytest.approx(-0.95)
    processed = vllm_sampler.processed_logprobs(logits, {"temperature": 2.0, "top_k": 2})
    gap = (logits[5] - logits[6]) / 2
    assert processed[5] == pytest.approx(-math.log1p(math.exp(-gap)))
    assert sum(1 for v in processed if v != -math.inf) == 2
    assert vllm_sampler.processed_logprobs(logits, {"temperature": 0.0, "top_k": 2}) == vllm_sampler.log_softmax(logits)
    top_p = vllm_sampler.processed_logprobs(logits, {"temperature": 1.0, "top_p": 0.5})
    # The top token holds 0.369 of the mass, the top two 0.511: top_p 0.5 keeps those two.
    assert top_p[5] == pytest.approx(-math.log1p(math.exp(-0.95))) and vllm_sampler.wire(top_p[7]) == -9999.0
