"""The policy being trained: full-parameter or LoRA, its fp32 master and its bf16 export.

- Full-parameter (``trainer.lora_rank`` = 0): every parameter trains; the fp32 master is the
  model's parameters; a version is their bf16 export.
- LoRA (``trainer.lora_rank`` > 0, peft): the weights the trainer started from are frozen and
  low-rank adapters ``B @ A`` (``B`` starts at zero, so the first export equals the start) train on
  ``trainer.lora_targets``. A version is the *merged* bf16 export, ``W + scale * B @ A`` under the
  base model's parameter names, so every node and engine serves it as plain weights (and the
  registry's deltas apply unchanged). The fp32 master is the whole wrapped model (frozen base and
  adapters), so a checkpoint resumes exactly.

Both expose the same few operations to the loop (:class:`Policy`), so ``trainer/train.py`` never
branches on the mode.
"""

from __future__ import annotations

from typing import Any

import torch

from flywheel.settings import TrainerSettings
from flywheel.tinymodel.sampling import export_state, load_state

_PEFT_PREFIX = "base_model.model."


class Policy:
    """The trained model and what the loop needs from it (module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerSettings):
        self.lora = cfg.lora_rank > 0
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
        """The version's weights: bf16 CPU tensors under the base model's parameter names."""
        if not self.lora:
            return export_state(self.model)
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
            return {k: v.detach().to(device="cpu", dtype=torch.bfloat16).contiguous() for k, v in out.items()}

    def load_published(self, state: dict[str, Any]) -> None:
        """Start from a published version's weights (base names); LoRA adapters start at zero."""
        if not self.lora:
            load_state(self.model, state)
            return
        params = {_base_name(n): p for n, p in self.model.named_parameters() if ".lora_" not in n}
        missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys()
        if missing or unexpected:
            raise KeyError(f"state does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
            for name, p in self.model.named_parameters():
                if ".lora_B." in name:
                    p.zero_()


def _base_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``."""
    return peft_name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
