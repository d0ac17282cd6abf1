"""The files a vLLM node reads versions from: a version's folder written atomically, a LoRA
adapter's config and rank, and version 0 of an adapter line.

A full version is ``model.safetensors``; a LoRA version is ``adapter_model.safetensors`` plus
``adapter_config.json``, as PEFT saves them and vLLM's LoRA loader reads them. Folders are written
under a temporary name, fsynced and renamed into place, so vLLM never reads half a version.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from flywheel.weights.codec.state import encode_full, state_sha256
from flywheel.weights.codec.tensorfile import weight_files

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS = "model.safetensors"


def materialise(folder: Path, state: State, sha256: str, *, adapter_config: dict[str, Any] | None = None) -> Path:
    """``folder`` holding ``state`` (and the adapter config), written atomically; an existing
    folder is reused only when its weights hash to ``sha256``."""
    weights_name = ADAPTER_WEIGHTS if adapter_config is not None else FULL_WEIGHTS
    if folder.is_dir():
        try:
            if state_sha256(safetensors.torch.load_file(folder / weights_name)) == sha256:
                return folder
        except Exception as exc:  # unreadable leftovers: rewritten below
            log.warning("rewriting %s: %s", folder, exc)
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        write_synced(tmp / weights_name, encode_full(state))
        if adapter_config is not None:
            write_synced(tmp / ADAPTER_CONFIG, json.dumps(adapter_config, indent=2, sort_keys=True).encode())
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def adapter_config(state: State, lora_config: dict[str, Any]) -> dict[str, Any]:
    """The ``adapter_config.json`` vLLM reads with ``state``: PEFT's LoRA keys, ``lora_config`` and the rank."""
    config = {"peft_type": "LORA", "bias": "none", "task_type": "CAUSAL_LM", **lora_config}
    rank = lora_rank(state)
    if "r" not in config:
        config["r"] = rank
    elif int(config["r"]) != rank:  # vLLM would load it and scale by lora_alpha / r: silently wrong
        raise ValueError(f"the adapter's rank is {rank}, the configured r is {config['r']} (trainer.lora_rank)")
    return config


def check_lora_state(state: State) -> None:
    if not state or not all(".lora_A." in n or ".lora_B." in n for n in state):
        raise ValueError("not a PEFT LoRA adapter state: every tensor name must contain .lora_A. or .lora_B.")


def lora_rank(state: State) -> int:
    ranks = {int(t.shape[0]) for n, t in state.items() if ".lora_A." in n}
    if len(ranks) != 1:
        raise ValueError(f"LoRA A matrices disagree on the rank: {sorted(ranks)}")
    return ranks.pop()


def zero_adapter_state(model_dir: str | os.PathLike[str], r: int, target_modules: list[str] | tuple[str, ...],
                       *, seed: int = 0) -> State:
    """Version 0 of an adapter line: a PEFT LoRA adapter for the model in ``model_dir`` that changes
    nothing (``B`` = 0), with ``A`` drawn as PEFT draws it (uniform in +-1/sqrt(fan_in), seeded), so
    training can move ``B``. Names are PEFT's (``base_model.model.<module>.lora_A.weight``), for every
    2-D ``<module>.weight`` in the model's ``*.safetensors`` whose module name ends with a target (as
    PEFT matches ``target_modules``; linear layers only). Only the file headers are read."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for shard in weight_files(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    if not shapes:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    modules = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and any(module == t or module.endswith(f".{t}") for t in target_modules):
            if len(shape) != 2:
                raise ValueError(f"{name} has shape {shape}: LoRA targets must be linear layers")
            modules[module] = shape
    if not modules:
        raise ValueError(f"no weight in {model_dir} matches the LoRA targets {list(target_modules)}")
    g = torch.Generator().manual_seed(seed)
    state: State = {}
    for module, (out_features, in_features) in sorted(modules.items()):
        bound = 1.0 / in_features ** 0.5  # kaiming_uniform_(a=sqrt(5)), PEFT's init of lora_A
        a = (torch.rand(r, in_features, generator=g) * 2 - 1) * bound
        state[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        state[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out_features, r, dtype=torch.bfloat16)
    return state


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
