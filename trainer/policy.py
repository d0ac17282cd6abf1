"""The policy being trained: full-parameter or LoRA, its fp32 master and its bf16 export.

- Full-parameter (``trainer.lora_rank`` = 0): every parameter trains; the fp32 master is the
  model's parameters; a version is their bf16 export.
- LoRA (``trainer.lora_rank`` > 0, peft): the weights the trainer started from are frozen and
  low-rank adapters ``B @ A`` (``B`` starts at zero, so the first export equals the start) train on
  ``trainer.lora_targets``. The fp32 master is the whole wrapped model (frozen base and adapters),
  so a checkpoint resumes exactly. What a version is depends on ``trainer.lora_publish``:

  - ``merged``: the merged bf16 export, ``W + scale * B @ A`` under the base model's parameter
    names (and the persistent buffers, as ``flywheel.lm.export_state`` has them; the checkpoint's
    names where transformers fuses a mixture of experts' tensors), so every node
    and engine serves it as plain weights. Starting from a published version
    loads it as the frozen base, with the adapters at zero.
  - ``adapter``: the adapter state only, bf16, under the names ``peft.get_peft_model_state_dict``
    gives (``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``: what PEFT saves in
    ``adapter_model.safetensors`` and vLLM's LoRA loader reads). The base is ``model.path``, fixed
    for the line; version 0 is the freshly initialised adapter (``B`` = 0, so it serves the base
    exactly, and a random ``A``, so training can move ``B``). Starting from a published version
    loads it into the adapters; the base stays what ``model.path`` holds.

  Either way the registry's deltas and hashes apply unchanged: a version is a plain state dict.

Both expose the same few operations to the loop (:class:`Policy`), so ``trainer/train.py`` never
branches on the mode.
"""

from __future__ import annotations

from typing import Any

import torch

from flywheel.lm import buffer_state, export_state, load_state, pair_state, persistent_buffers
from flywheel.settings import TrainerSettings
from flywheel.weightnames import to_checkpoint, to_model
from flywheel.weights.codec.state import state_sha256

_PEFT_PREFIX = "base_model.model."


class Policy:
    """The trained model and what the loop needs from it (module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerSettings):
        self.lora = cfg.lora_rank > 0
        #: Versions are the adapter state (``trainer.lora_publish = "adapter"``), not merged weights.
        self.adapter = self.lora and cfg.lora_publish == "adapter"
        if self.lora:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                target_modules=list(cfg.lora_targets), bias="none",
            )
            model = get_peft_model(model, config)
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        self.model = model

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def master_state(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of every parameter (the wrapped model's names), for the checkpoint."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    def load_master(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`master_state` exactly (names and shapes must match this mode)."""
        load_state(self.model, state)

    def export(self) -> dict[str, torch.Tensor]:
        """The version's weights as bf16 CPU tensors: under the base model's parameter names, or
        the adapter state under PEFT's names (``adapter`` mode)."""
        if not self.lora:
            return export_state(self.model)
        if self.adapter:
            return {k: v.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
                    for k, v in self._adapter_tensors().items()}
        from peft.tuners.lora import LoraLayer

        with torch.no_grad():
            out: dict[str, torch.Tensor] = {}
            for name, p in self.model.named_parameters():
                if ".lora_" not in name:
                    out[_base_name(name)] = p
            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer):
                    key = _base_name(name) + ".weight"
                    out[key] = module.base_layer.weight + module.get_delta_weight("default").to(out[key].dtype)
            state = {k: v.detach().to(device="cpu", dtype=torch.bfloat16) for k, v in out.items()}
            state.update({_base_name(n): b for n, b in buffer_state(self.model).items()})
            return {k: v.contiguous() for k, v in to_checkpoint(self.model.get_base_model(), state).items()}

    def is_version(self, exported: dict[str, torch.Tensor], sha256: str) -> bool:
        """Whether ``exported`` (this policy's :meth:`export`) is the version whose state hash is
        ``sha256``: with its persistent buffers, or without them for a version published before
        versions carried them (a restart across that upgrade finds its own version so)."""
        if state_sha256(exported) == sha256:
            return True
        buffers = {_base_name(n) for n in persistent_buffers(self.model)}
        without = {k: v for k, v in exported.items() if k not in buffers}
        return len(without) < len(exported) and state_sha256(without) == sha256

    def load_published(self, state: dict[str, Any]) -> None:
        """Start from a published version: its weights (base names; LoRA adapters start at zero),
        or in ``adapter`` mode its adapter state (the base stays ``model.path``)."""
        if not self.lora:
            load_state(self.model, state)
            return
        if self.adapter:
            self._load_adapter(state)
            return
        params = {_base_name(n): p for n, p in self.model.named_parameters() if ".lora_" not in n}
        buffers = {_base_name(n): b for n, b in persistent_buffers(self.model).items()}
        with torch.no_grad():
            for _, target, src in pair_state(params, buffers, to_model(self.model.get_base_model(), state)):
                target.copy_(src)
            for name, p in self.model.named_parameters():
                if ".lora_B." in name:
                    p.zero_()

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter state under PEFT's saved names (views of the parameters). No embedding layers
        are saved (``save_embedding_layers=False``: ``"auto"`` would look the base model up online)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model, save_embedding_layers=False)

    def _load_adapter(self, state: dict[str, Any]) -> None:
        """Copy an adapter version into the LoRA parameters; the names and shapes must be this
        model's (a line of merged or full versions is refused with a message saying so)."""
        from peft import set_peft_model_state_dict

        own = self._adapter_tensors()
        missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
        if missing or unexpected:
            kind = "an adapter" if all(".lora_" in k for k in state) else "full model weights, not a LoRA adapter"
            raise ValueError(
                f"the published version holds {kind} that does not match this trainer's LoRA adapters "
                f"(trainer.lora_publish = 'adapter', r={self.model.peft_config['default'].r}): "
                f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]} "
                f"({len(missing)} and {len(unexpected)} in all). A line keeps one kind of version: "
                "use a new model.line, or the trainer.lora_* settings the line was published with.")
        wrong = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
        if wrong:
            raise ValueError(f"adapter shapes differ from this trainer's (trainer.lora_rank?): "
                             f"{[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in wrong[:4]]}")
        set_peft_model_state_dict(self.model, {k: state[k] for k in own})
        loaded = self._adapter_tensors()
        if not all(torch.equal(loaded[k].to(torch.bfloat16), state[k].to(torch.bfloat16)) for k in own):
            raise RuntimeError("peft did not load the adapter state into the LoRA parameters")


def _base_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``."""
    return peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
