"""How the trained model's blocks compute: activation checkpointing and ``torch.compile``, by setting.

:func:`prepare` applies ``trainer.activation_checkpointing`` and ``trainer.compile`` to the
transformer blocks (``trainer.distributed.transformer_blocks``) of the model before it is wrapped
for data parallelism; neither changes a value the model computes.

- Activation checkpointing (``trainer.activation_checkpointing``): ``block`` runs each block's
  forward under non-reentrant ``torch.utils.checkpoint`` while gradients are on, so the backward
  recomputes the block's activations from its input instead of keeping them (memory per block is
  ``tokens x hidden`` instead of the block's dozen intermediates, for one more forward of the
  block: about a third more compute); ``mlp`` does that to the block's MLP only, whose gate, up,
  activation and product (4 x intermediate size per token, over half of what a block keeps) are
  the bulk of the memory, while its recompute is a small share of the step (attention is not
  recomputed). A block without an ``mlp`` module is checkpointed whole. FSDP2 gathers a block's
  parameters again for the recompute as for any backward.
- ``torch.compile``: each block's MLP (its only part with no data-dependent control flow: packed
  attention loops over segments, which would recompile for every batch) is compiled with dynamic
  shapes. Where compiling fails (no C++ compiler, an unsupported op or backend) the MLP runs
  eagerly from then on and the failure is logged once; a failure inside a compiled backward is
  not caught.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from flywheel.settings import TrainerSettings
from trainer.distributed import transformer_blocks

log = logging.getLogger("flywheel.trainer")


def prepare(model: torch.nn.Module, cfg: TrainerSettings) -> torch.nn.Module:
    """``model`` (the same object) with its blocks checkpointed and/or compiled as ``cfg`` says."""
    for block in transformer_blocks(model):
        mlp = getattr(block, "mlp", None)
        if cfg.compile and isinstance(mlp, torch.nn.Module):
            mlp.forward = Compiled(mlp.forward)
        if cfg.activation_checkpointing == "block" or (cfg.activation_checkpointing == "mlp" and mlp is None):
            block.forward = Checkpointed(block.forward)
        elif cfg.activation_checkpointing == "mlp":
            mlp.forward = Checkpointed(mlp.forward)
    return model


class Checkpointed:
    """A block's forward that keeps only its inputs for the backward (module docstring)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class Compiled:
    """``torch.compile(forward)``, falling back to ``forward`` for good on the first failure."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.eager = forward
        self.compiled: Callable[..., Any] | None = torch.compile(forward, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: run eagerly instead
                log.warning("torch.compile failed (%s: %s); running eagerly", type(exc).__name__, str(exc)[:300])
                self.compiled = None
        return self.eager(*args, **kwargs)
