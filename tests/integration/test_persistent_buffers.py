"""Models that keep trained values in persistent buffers (in the checkpoint, not parameters: Gemma 4's
``layer_scalar``, a MoE router's ``e_score_correction_bias``): they reach a model built without
weights, a trainer starts from a base version that holds them (as a vLLM node registers it, every
tensor of its folder), and every version it publishes, whole or sharded, carries them unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.lm import export_state, load_state, load_weights, persistent_buffers, skeleton_model
from flywheel.weights.codec.state import decode_full, state_sha256
from flywheel.weights.codec.tensorfile import weight_files
from flywheel.weights.registry import Registry, VersionInfo
from flywheel.weights.store import FolderStore
from trainer.distributed import SINGLE
from trainer.shard_publish import ShardedPublisher

pytestmark = pytest.mark.integration


def gemma_folder(path: Path) -> dict[str, torch.Tensor]:
    """A tiny ``gemma4_text`` saved in bf16 at ``path``, its layer scalars set to trained-looking
    values (not the config's 1.0); returns those values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma4_text", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=64,
                                  vocab_size_per_layer_input=64, hidden_size_per_layer_input=8)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config)
    persistent = persistent_buffers(built)
    assert persistent, "the model has no persistent buffer: the tests would prove nothing"
    with torch.no_grad():
        for b in persistent.values():
            assert torch.equal(b, torch.ones_like(b))  # the config's initial value
            b.copy_(torch.randn(b.shape) + 2)
    built.to(torch.bfloat16).save_pretrained(path)
    return {n: b.to(torch.bfloat16).float() for n, b in persistent.items()}


def test_a_checkpoints_persistent_buffers_reach_a_model_without_weights(tmp_path: Path) -> None:
    """A model without weights (``lm.skeleton_model``, then its parameters read from the files)
    starts with the checkpoint's buffer values, as loading the folder does."""
    trained = gemma_folder(tmp_path / "model")
    whole = load_weights(tmp_path / "model")
    model = SINGLE.wrap(skeleton_model(tmp_path / "model"), weight_files(tmp_path / "model"))
    want, got = whole.state_dict(), model.state_dict()
    assert set(got) == set(want)
    assert {n: torch.equal(got[n], want[n]) for n in want} == {n: True for n in want}
    assert all(torch.equal(got[n], value) for n, value in trained.items())


def node_registry(tmp_path: Path, line: str) -> tuple[Registry, VersionInfo]:
    """A registry in ``tmp_path`` and its v0 as a vLLM node registers it from the model folder
    ``tmp_path / "model"``: every tensor of the folder's file, under the file's names."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    registry = Registry(make_session_factory(make_engine(url)), FolderStore(tmp_path / "store"), line, full_every=50)
    return registry, registry.ensure_base(decode_full((tmp_path / "model" / "model.safetensors").read_bytes()),
                                          reason="node")


def test_versions_carry_the_persistent_buffers_on_every_publish_path(tmp_path: Path) -> None:
    trained = gemma_folder(tmp_path / "model")
    registry, v0 = node_registry(tmp_path, "g4")  # the buffers included
    assert trained.keys() <= registry.load(0).keys()

    # A trainer starts from it (load_state refused the buffers' names before versions carried them).
    model = load_weights(tmp_path / "model")
    with torch.no_grad():
        for b in persistent_buffers(model).values():
            b.zero_()  # so the load below must set them
    load_state(model, registry.load(v0.version))
    assert all(torch.equal(model.get_buffer(n), value) for n, value in trained.items())
    exported = export_state(model)
    assert all(torch.equal(exported[n], value) for n, value in trained.items())  # as held: exact
    with pytest.raises(KeyError, match="unexpected"):
        load_state(model, {**exported, "model.not_a_buffer": torch.zeros(1)})

    # A whole version after a step: the buffers ride along, unchanged.
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    v1 = registry.publish(export_state(model), parent=0, parent_state=registry.load(0))
    assert all(torch.equal(registry.load(v1.version)[n].float(), value) for n, value in trained.items())

    # Sharded versions (one process here: the publisher's own export) hold exactly the whole
    # export's tensors: the shard the publisher starts from composes to v1's hash.
    shards = ShardedPublisher(SINGLE, model, registry.store, "g4", registry, workdir=tmp_path / "shards")
    shards.start(model)
    assert shards.held_sha256() == v1.sha256
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    v2 = shards.publish(model, parent=v1.version, train_step=2)
    assert v2.kind == "delta" and v2.sha256 == state_sha256(export_state(model))
    loaded = registry.load(v2.version)
    assert all(torch.equal(loaded[n].float(), value) for n, value in trained.items())
    fresh = load_weights(tmp_path / "model")
    load_state(fresh, loaded)
    assert state_sha256(export_state(fresh)) == v2.sha256


def test_a_merged_lora_policy_starts_from_and_publishes_the_buffers(tmp_path: Path) -> None:
    """``trainer.lora_publish = "merged"``: the policy loads a base version holding the buffers and
    its merged exports carry them under the base model's names, as the whole export does."""
    from flywheel.settings import TrainerSettings
    from trainer.policy import Policy

    trained = gemma_folder(tmp_path / "model")
    base = decode_full((tmp_path / "model" / "model.safetensors").read_bytes())
    policy = Policy(load_weights(tmp_path / "model"), TrainerSettings(lora_rank=2, lora_publish="merged"))
    with torch.no_grad():
        for b in persistent_buffers(policy.model).values():
            b.zero_()  # so the load below must set them
    policy.load_published(base)
    merged = policy.export()
    assert all(torch.equal(merged[n], value) for n, value in trained.items())
    assert merged.keys() == export_state(load_weights(tmp_path / "model")).keys()


def test_a_restart_finds_its_version_published_before_versions_carried_the_buffers(tmp_path: Path) -> None:
    """A trainer restarted from a checkpoint checks that the version carrying its token is its
    export. A version published before exports carried the buffers (parameters only) still counts;
    other weights do not."""
    from flywheel.settings import TrainerSettings
    from trainer.policy import Policy

    trained = gemma_folder(tmp_path / "model")
    policy = Policy(load_weights(tmp_path / "model"), TrainerSettings())
    exported = policy.export()
    params_only = {k: v for k, v in exported.items() if k not in trained}
    assert len(params_only) < len(exported)
    assert policy.is_version(exported, state_sha256(exported)) and policy.is_version(exported, state_sha256(params_only))
    nudged = {**params_only, next(iter(params_only)): next(iter(params_only.values())) + 1}
    assert not policy.is_version(exported, state_sha256(nudged))
    assert not policy.is_version(exported, state_sha256({k: v for k, v in exported.items() if k != next(iter(params_only))}))
