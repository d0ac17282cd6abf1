"""A model's tensors under its checkpoint's names and layout, and back: transformers' weight conversions.

Transformers 5 loads some checkpoints into parameters laid out otherwise than the files hold them,
by the conversions ``transformers.conversion_mapping`` registers per model type, and
``save_pretrained`` reverts them. The case that matters here is the mixture of experts (Mixtral,
Qwen2/3-MoE, DeepSeek and the rest): the files hold one tensor per expert and projection
(``model.layers.0.mlp.experts.3.gate_proj.weight``), the model two fused parameters per layer
(``mlp.experts.gate_up_proj`` of shape ``[experts, 2 × intermediate, hidden]``,
``mlp.experts.down_proj``).

A version holds what a node's model folder holds, under the folder's names: a vLLM node registers
its v0 from those files and its loader expects their names, so every version of the line must
use them too. :func:`to_checkpoint` turns a state under the model's names (its
``named_parameters`` and persistent buffers) into the checkpoint's, :func:`to_model` the other way.
For a model without conversions (Llama, Gemma) both return the state they are given.

The conversions are the model's registered ones without the legacy renamings
(``get_model_conversion_mapping(model, add_legacy=False)``, as ``save_pretrained`` uses for a model
it did not load), so a model built from its config and one loaded from its folder map alike.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    MergeModulelist,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    apply_converters,
    apply_renamings,
    dot_natural_key,
    rename_source_key,
)

State = Mapping[str, torch.Tensor]


class _Conversions(NamedTuple):
    """A model's transforms, looked up once: checkpoint -> model (``forward``) and back."""

    forward: list[WeightTransform]
    reverse: list[WeightTransform]


_FOUND: weakref.WeakKeyDictionary[torch.nn.Module, _Conversions] = weakref.WeakKeyDictionary()
_FOUND_LOCK = threading.Lock()


def _found(model: torch.nn.Module) -> _Conversions:
    """``model``'s conversions, from transformers the first time (a walk of its modules), kept for
    as long as the model lives: exports, loads and the per-tensor calls of the sharded publisher
    and the rows reader ask for them again and again."""
    with _FOUND_LOCK:
        found = _FOUND.get(model)
        if found is None:
            forward = []
            if hasattr(model, "config"):  # not a transformers model (a test's toy): none
                forward = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                           if not isinstance(t, PrefixChange)]  # no prefix games: the names are the model's
            found = _FOUND[model] = _Conversions(forward, [t.reverse_transform() for t in forward[::-1]])
        return found


def conversions(model: torch.nn.Module) -> list[WeightTransform]:
    """The transforms that take ``model``'s checkpoint to its parameters (empty: the names are the
    checkpoint's). A module that is not a transformers model (a test's toy) has none."""
    return _found(model).forward


def to_checkpoint(model: torch.nn.Module, state: State) -> dict[str, torch.Tensor]:
    """``state`` (the model's names and shapes) under the checkpoint's names and shapes: fused
    experts split into one tensor per expert and projection. Views where the conversion allows
    (a split), copies where it does not (a transpose); a caller that needs contiguous tensors
    makes them so. ``state`` itself, as a new dict, when the model has no conversions."""
    reverse = _found(model).reverse
    if not reverse:
        return dict(state)
    return _apply(model, state, reverse, reverse=True)


def pieces(model: torch.nn.Module, name: str, shape: Sequence[int],
           dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The checkpoint's tensors that the model's tensor ``name`` (of ``shape`` and ``dtype``) is
    made of, with their dtypes and shapes, computed on the ``meta`` device (nothing allocated):
    ``{name: (dtype, shape)}`` itself where nothing converts it."""
    meta = to_checkpoint(model, {name: torch.empty(tuple(shape), dtype=dtype, device="meta")})
    return {piece: (t.dtype, tuple(t.shape)) for piece, t in meta.items()}


def row_pieces(model: torch.nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype,
               start: int, stop: int) -> list[str] | None:
    """The checkpoint's tensors that rows ``start:stop`` of the model's tensor ``name`` are made of,
    where its conversion stacks them along dim 0 and leaves that dimension alone after (a mixture
    of experts: row ``i`` is expert ``i`` of each projection, ``MergeModulelist(dim=0)`` then a
    ``Concatenate`` along dim 1): :func:`to_model` of just those gives exactly those rows. None
    where the conversion is anything else (read the whole tensor then)."""
    renamings, converters = _kinds(conversions(model))
    groups: dict[str, list[str]] = {}
    used: set[int] = set()
    for piece in pieces(model, name, shape, dtype):
        renamed, pattern = rename_source_key(piece, renamings, converters)
        if renamed != name or pattern is None:
            return None
        used.update(id(c) for c in converters if pattern in c.source_patterns)
        groups.setdefault(pattern, []).append(piece)
    if len(used) != 1:
        return None
    ops = next(c for c in converters if id(c) in used).operations
    stacks = isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    if not stacks or not all(isinstance(op, (Concatenate, Chunk)) and op.dim != 0 for op in ops[1:]):
        return None
    if any(len(group) != shape[0] for group in groups.values()):
        return None
    return [piece for group in groups.values() for piece in sorted(group, key=dot_natural_key)[start:stop]]


def to_model(model: torch.nn.Module, state: State) -> dict[str, torch.Tensor]:
    """``state`` (a checkpoint's names and shapes, as :func:`to_checkpoint` gives them) under the
    model's: per-expert tensors fused into the model's parameters. A name the conversions do not
    match passes as it is, so a state already under the model's names comes back unchanged. A
    converter that cannot be fed (an expert missing) raises ``KeyError`` naming the tensor."""
    transforms = conversions(model)
    if not transforms:
        return dict(state)
    return _apply(model, state, transforms, reverse=False)


def _apply(model: torch.nn.Module, state: State, transforms: list[WeightTransform], *, reverse: bool) -> dict[str, torch.Tensor]:
    """What ``transformers`` does to a whole state dict when it loads (``reverse=False``) or saves
    (``reverse=True``) one, without its loading machinery (devices, quantizers, thread pools):
    group each key's tensor into its target's converter, then convert each target."""
    renamings, converters = _kinds(transforms)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    targets: dict[str, WeightTransform] = {}
    for key, tensor in sorted(state.items(), key=lambda kv: dot_natural_key(kv[0])):  # experts in order: 2 < 10
        # Loading renames, then converts; saving converts, and renames a converter's outputs once
        # they exist (their names come out of ``convert``), as ``revert_weight_conversion`` does.
        renamed, pattern = apply_converters(key, converters) if reverse else rename_source_key(key, renamings, converters)
        if pattern is not None:
            target = targets.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        else:
            renamed = apply_renamings(key, renamings) if reverse else renamed
            target, pattern = targets.setdefault(renamed, WeightRenaming(key, renamed)), key
        target.add_tensor(renamed, key, pattern, tensor)
    out: dict[str, torch.Tensor] = {}
    for first, target in targets.items():
        try:
            realized = target.convert(first, model=model, config=getattr(model, "config", None))
        except Exception as exc:  # a group short of a tensor: stack/cat/chunk fail on what is there
            raise KeyError(f"{first}: its tensors do not make the {'checkpoint' if reverse else 'model'}'s "
                           f"({sorted(target.layer_targets.get(first, ()))[:4]}...): {exc}") from exc
        for name, value in realized.items():
            value = value[0] if isinstance(value, list) else value
            if isinstance(target, WeightConverter) and reverse:
                name = apply_renamings(name, renamings)
            if name in out:
                raise KeyError(f"{name}: two tensors of the state convert to it")
            out[name] = value
    return out


def _kinds(transforms: list[WeightTransform]) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    """The renamings and the converters among ``transforms``, each in order."""
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])
