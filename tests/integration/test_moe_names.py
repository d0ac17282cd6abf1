"""Mixtures of experts, which transformers 5 loads into fused parameters (``mlp.experts.gate_up_proj``)
while their checkpoint holds one tensor per expert (``mlp.experts.3.gate_proj.weight``): versions
hold the checkpoint's names and layout (flywheel/weightnames.py), so a base version a node
registers from its folder loads into the trainer, every export (whole, merged LoRA, sharded) is
what the folder's files would be, a model without weights reads its rows from those files, and
loads take either layout back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.lm import export_state, load_state, load_weights, skeleton_model
from flywheel.weightnames import conversions, row_pieces, to_checkpoint, to_model
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.codec.tensorfile import weight_files
from tests.integration.test_persistent_buffers import node_registry
from trainer.distributed import SINGLE
from trainer.shard_publish import ShardedPublisher

pytestmark = pytest.mark.integration

MOE = {
    "qwen3_moe": {"moe_intermediate_size": 16, "num_experts": 12, "num_experts_per_tok": 2, "head_dim": 8},
    "mixtral": {"num_local_experts": 12, "num_experts_per_tok": 2},
}


def moe_folder(path: Path, model_type: str = "qwen3_moe") -> dict[str, torch.Tensor]:
    """A tiny mixture of experts saved in bf16 at ``path`` (12 experts, so natural order matters:
    ``experts.10`` comes after ``experts.2``); returns what its file holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False, **MOE[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_an_export_is_the_checkpoint_and_loads_back_either_way(tmp_path: Path, model_type: str) -> None:
    files = moe_folder(tmp_path / "model", model_type)
    model = load_weights(tmp_path / "model")
    fused = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    assert conversions(model) and fused.keys() != files.keys(), "nothing fused: the test would prove nothing"
    assert any(".experts.10." in n for n in files)

    exported = export_state(model)
    assert exported.keys() == files.keys()
    assert [n for n in files if not torch.equal(exported[n], files[n])] == []
    assert all(t.is_contiguous() for t in exported.values())

    back = to_model(model, exported)  # the checkpoint's layout, fused again
    assert back.keys() == fused.keys() and [n for n in fused if not torch.equal(back[n], fused[n])] == []
    assert to_model(model, fused).keys() == fused.keys()  # the model's own names pass as they are
    assert to_checkpoint(model, fused).keys() == files.keys()

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_state(model, exported)  # a version, per expert
    assert state_sha256(export_state(model)) == state_sha256(files)
    load_state(model, {n: p.detach().clone() for n, p in model.named_parameters()})  # a master state, fused

    short = {n: t for n, t in exported.items() if ".experts.3." not in n}
    with pytest.raises(ValueError, match="experts"):  # eleven experts stacked: not the model's shape
        load_state(model, short)


def test_a_trainer_starts_from_a_nodes_base_and_its_versions_load_where_the_folder_does(tmp_path: Path) -> None:
    files = moe_folder(tmp_path / "model")
    registry, v0 = node_registry(tmp_path, "moe")  # the folder's tensors, one per expert

    model = load_weights(tmp_path / "model")
    with torch.no_grad():
        model.get_parameter("model.layers.0.mlp.experts.gate_up_proj").zero_()  # so the load must set it
    load_state(model, registry.load(v0.version))  # refused before: unexpected per-expert names
    assert state_sha256(export_state(model)) == v0.sha256

    # A step moves one fused tensor: the delta is per expert, and a node's load rebuilds the model.
    with torch.no_grad():
        model.get_parameter("model.layers.1.mlp.experts.down_proj")[5].mul_(2.0)  # exact in bf16
    v1 = registry.publish(export_state(model), parent=0, parent_state=registry.load(0))
    assert v1.kind == "delta" and registry.load(v1.version).keys() == files.keys()
    fresh = load_weights(tmp_path / "model")
    load_state(fresh, registry.load(v1.version))
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)

    # Sharded versions (one process: the publisher's own export) hold the same tensors.
    shards = ShardedPublisher(SINGLE, model, registry.store, "moe", registry, workdir=tmp_path / "shards")
    shards.start(model)
    assert shards.held_sha256() == v1.sha256
    with torch.no_grad():
        model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")[11].mul_(0.5)
    v2 = shards.publish(model, parent=v1.version, train_step=2)
    assert v2.kind == "delta" and v2.sha256 == state_sha256(export_state(model))
    assert registry.load(v2.version).keys() == files.keys()


def test_a_model_without_weights_reads_its_fused_rows_from_the_folder(tmp_path: Path) -> None:
    """The sharded trainer's start and the FSDP2 KL reference read each parameter from the folder's
    files by rows: a fused parameter is put together from its experts' tensors."""
    moe_folder(tmp_path / "model")
    whole = load_weights(tmp_path / "model").state_dict()
    model = SINGLE.wrap(skeleton_model(tmp_path / "model"), weight_files(tmp_path / "model"))
    got = model.state_dict()
    assert got.keys() == whole.keys()
    assert [n for n in whole if not torch.equal(got[n], whole[n])] == []


def test_a_ranks_rows_of_the_fused_experts_come_from_its_own_experts(tmp_path: Path) -> None:
    """Under FSDP2 a rank's rows of a fused expert tensor are whole experts: ``row_pieces`` names
    the checkpoint tensors of just those, and they make exactly those rows. A tensor nothing
    converts, or one whose rows are not experts, has none."""
    files = moe_folder(tmp_path / "model")
    model = load_weights(tmp_path / "model")
    fused = [(n, p) for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4
    for name, p in fused:
        rows = row_pieces(model, name, p.shape, p.dtype, 9, 12)
        assert rows is not None and {r.split(".experts.")[1].split(".")[0] for r in rows} == {"9", "10", "11"}
        assert len(rows) == (6 if name.endswith("gate_up_proj") else 3)
        built = to_model(model, {r: files[r] for r in rows})[name]
        assert torch.equal(built, p.detach().to(torch.bfloat16)[9:12])
        assert row_pieces(model, name, p.shape, p.dtype, 4, 4) == []
    weight = model.get_parameter("model.embed_tokens.weight")
    assert row_pieces(model, "model.embed_tokens.weight", weight.shape, weight.dtype, 0, 2) is None


def test_a_merged_lora_policy_loads_and_publishes_the_checkpoints_names(tmp_path: Path) -> None:
    from flywheel.settings import TrainerSettings
    from trainer.policy import Policy

    files = moe_folder(tmp_path / "model")
    policy = Policy(load_weights(tmp_path / "model"), TrainerSettings(lora_rank=2, lora_publish="merged"))
    with torch.no_grad():
        policy.model.get_parameter("base_model.model.model.layers.1.mlp.experts.down_proj").zero_()
    policy.load_published(files)
    merged = policy.export()  # the adapters start at zero: the base, exactly
    assert merged.keys() == files.keys()
    assert [n for n in files if not torch.equal(merged[n], files[n])] == []
