"""Data-parallel training under ``torchrun``: one small object the loop calls, a no-op in one process.

Launched by ``torchrun --nproc_per_node N ...`` the trainer runs N ranks; :meth:`Dist.from_env` reads
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; the only place it is read) and
joins the process group: gloo on CPU, NCCL on CUDA (one GPU per ``LOCAL_RANK``). Without torchrun,
or with ``WORLD_SIZE=1``, it returns the single-process :class:`Dist`, whose every method is the
plain single-process operation, so ``train()`` has one code path.

Invariants the loop keeps (how: docs/trainer.md):

- Rank 0 decides. It alone reads the bus, keeps the buffer, writes checkpoints and publishes; it
  hands each step's whole batch to every rank (:meth:`Dist.broadcast_object`); every rank trains
  its :meth:`Dist.shard` of it. Anything computed over the whole batch (``turn_values``: legacy
  baselines are batch-relative) is computed on the whole batch, on every rank, before sharding.
- Every collective is entered by every rank, in the same order: the wrapped model's forward and
  backward (each pass all-gathers and reduces), the reductions, the state-dict gathers and loads.
  A rank with fewer micro-batches than another, or none, runs :func:`placeholder_batch` passes
  (no trainable token: zero loss, zero gradient) up to :meth:`Dist.all_reduce_max` of the counts.
- Gradients equal single-process gradients. The loss is a token mean over the whole optimizer step:
  with ``N = all_reduce_sum(trainable tokens of this rank)``, each rank back-propagates
  ``local_token_sum * grad_scale / N``. The gradient reduction (FSDP2 reduce-scatter, DDP
  all-reduce) averages over ranks, dividing by ``world_size``, which ``grad_scale = world_size``
  undoes: the reduced gradient is ``sum over ranks of grad(local_token_sum) / N``, the gradient of
  the step's token mean in one process, up to the order of the summation.
- All ranks start from the same weights: rank 0's (:meth:`Dist.wrap` broadcasts them one tensor at
  a time; the other ranks start from a model without weights, :meth:`Dist.start_model`), or each
  rank's own rows of the same safetensors files (``Dist.wrap(model, files)``; no rank need hold
  the weights), or a sharded checkpoint loaded after wrapping.
- The gathered checkpoint format is the single process's. :meth:`Dist.full_state_dict` is
  ``{name: CPU tensor}`` of every parameter in the master dtype (``named_parameters`` names, tied
  weights once: what ``Policy.master_state`` gives), :meth:`Dist.optimizer_state_dict` is what
  ``optimizer.state_dict()`` gives in one process (parameters keyed by index); both are complete
  on rank 0 and ``{}`` on the others. The ``load_*`` methods take them on rank 0 and broadcast.
  Sharded checkpoints (``trainer.sharded_versions``) never gather: :meth:`save_sharded_state` and
  :meth:`load_sharded_state` write and read each rank's own shards with torch DCP, which reshards
  on load, so either kind resumes with any number of ranks.

Wrapping (:meth:`Dist.wrap`): FSDP2, ``torch.distributed.fsdp.fully_shard`` on every transformer
block (the classes named by the model's ``_no_split_modules``) and then on the root, parameters
sharded as fp32 DTensors (the master weights), gradients reduce-scattered; DDP where FSDP2 is not
available or asked for. With torch 2.13 both work on CPU over gloo: forward, backward, clipping,
AdamW, full state dicts in both directions (checked by ``python -m trainer.selftest``,
run by tests/integration/test_trainer_distributed.py with 2 processes against 1).

CUDA (NCCL, bf16 compute, fp32 master): FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, i.e. bf16 all-gathered compute copies of the fp32 shards and fp32 gradient
reduction; DDP and the single process run the forward under :meth:`Dist.autocast` (bf16). This
branch is written to the same contract but not exercised by the test suite (no GPU in CI); on
CPU everything is fp32. With bf16 compute, 1-rank and N-rank losses agree to bf16 precision only.

The process group's collectives time out (torch's default: 10 minutes on NCCL, 30 on gloo): while
the bus is idle, rank 0 keeps the other ranks in step with a small broadcast per poll (nothing to
do, a batch, or stop) rather than leaving them blocked in a collective.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from flywheel.lm import load_state, load_weights, pair_state, persistent_buffers, skeleton_model
from flywheel.weightnames import to_model
from trainer.batch import Batch
from trainer.rows import read_rows

try:  # public since torch 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch: DDP only
    fully_shard = None  # type: ignore[assignment]

T = TypeVar("T")
Number = TypeVar("Number", int, float, torch.Tensor)
Wrapper = Literal["none", "fsdp2", "ddp"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the job and the collectives the loop needs (module docstring).

    The default instance is the single process: rank 0 of 1, nothing wrapped, no communication.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: How :meth:`wrap` wraps the model: ``none`` in one process, else ``fsdp2`` or ``ddp``.
    wrapper: Wrapper = "none"
    #: bf16 compute with fp32 master weights (the CUDA default).
    bf16: bool = False

    @classmethod
    def from_env(
        cls,
        device: str | torch.device = "cpu",
        *,
        wrapper: Literal["auto", "fsdp2", "ddp"] = "auto",
        bf16: bool | None = None,
    ) -> Dist:
        """Join torchrun's process group (gloo on CPU, NCCL on CUDA), or the single process when
        ``WORLD_SIZE`` is unset or 1. ``device="cuda"`` means this rank's GPU (``LOCAL_RANK``);
        ``wrapper="auto"`` is FSDP2 where this torch has it, else DDP; ``bf16`` defaults to
        ``device`` being CUDA. Call :meth:`close` (or use the Dist as a context manager) at the end."""
        env = os.environ
        device = torch.device(device)
        bf16 = device.type == "cuda" if bf16 is None else bf16
        world_size = int(env.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls(device=device, bf16=bf16)
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        if not tdist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            tdist.init_process_group(backend, rank=rank, world_size=world_size,
                                     device_id=device if device.type == "cuda" else None)
        if wrapper == "auto":
            wrapper = "fsdp2" if fully_shard is not None else "ddp"
        elif wrapper == "fsdp2" and fully_shard is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard; use wrapper='ddp'")
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device, wrapper=wrapper, bf16=bf16)

    # --- who am I ------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """More than one process: collectives are real."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: reads the bus, checkpoints, publishes, logs."""
        return self.rank == 0

    @property
    def grad_scale(self) -> float:
        """Factor on each rank's loss that undoes the gradient reduction's mean over ranks."""
        return float(self.world_size)

    def close(self) -> None:
        """Leave the process group (every rank calls it; a no-op in one process)."""
        if self.enabled and tdist.is_initialized():
            tdist.destroy_process_group()

    def __enter__(self) -> Dist:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the model -----------------------------------------------------------------------------

    def start_model(self, path: str | Path) -> torch.nn.Module:
        """The model of the local directory ``path`` as this rank starts from it: read whole
        (``lm.load_weights``) on rank 0 and in one process; on any other rank only its structure
        (``lm.skeleton_model``, no weights), since :meth:`wrap` gives it rank 0's."""
        return load_weights(path) if self.is_main else skeleton_model(path)

    def wrap(self, model: torch.nn.Module, weights: Sequence[str | Path] | None = None, *,
             loaded_later: bool = False) -> torch.nn.Module:
        """``model`` on this rank's device, data-parallel: FSDP2 per transformer block then root
        (the same object, its parameters now DTensor shards), or a DDP wrapper; in one process,
        just moved. Build the optimizer from the returned model's parameters, after this.

        Where the weights come from: rank 0's, by default; another rank may hand in a model without
        weights (:meth:`start_model`), which then never holds more than its shard and one whole
        tensor at a time under FSDP2 (under DDP every rank holds the model anyway). With
        ``weights`` (safetensors files holding every parameter under its ``named_parameters``
        name: a version rebuilt into a file, a model folder's shards), every rank, rank 0
        included, may hand in a model without weights: each reads its own rows of each tensor
        from the files (mapped, so only those pages are read) and nothing is broadcast; ranks on
        several hosts must see the files at the same path (a shared filesystem, as sharded
        checkpoints need). With ``loaded_later`` the caller loads every parameter next (a sharded
        checkpoint, :meth:`load_sharded_state`): the weights are left as they are, uninitialised
        for a model without any, and nothing is read or sent."""
        meta = any(t.is_meta for t in model.parameters())
        broadcast = weights is None and not loaded_later  # rank 0's weights, sent tensor by tensor
        if meta and self.is_main and broadcast:
            raise ValueError("rank 0 must hold the weights every rank starts from")
        if any(b.is_meta for b in model.buffers()):
            raise ValueError("a model's buffers must be real (lm.skeleton_model computes them from the config)")
        if meta:
            _materialize(model, self.device)
        else:
            model = model.to(self.device)
        if not self.enabled or self.wrapper == "ddp":  # every rank holds the whole model
            if weights is not None:
                read_rows(model, weights)
            if not self.enabled:
                return model
            # DDP's constructor broadcasts rank 0's parameters and buffers.
            return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # Rank 0's whole tensors, kept past sharding: every rank takes its shard of each from them.
        whole = dict(model.named_parameters()) if self.is_main and broadcast else {}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # bf16: all-gather fp32 shards as bf16 compute copies; reduce gradients in fp32.
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if self.bf16 else MixedPrecisionPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        names = [name for name, _ in model.named_parameters()]
        if len(set(map(tuple, self.all_gather_object(names)))) != 1:  # else the broadcasts below would pair wrongly
            raise RuntimeError("ranks built different models: their parameter names differ")
        if weights is not None:
            read_rows(model, weights)
        if not broadcast:
            return model
        with torch.no_grad():
            for name, param in model.named_parameters():  # one whole tensor in flight at a time
                tensor = whole.pop(name) if self.is_main else torch.empty(param.shape, dtype=param.dtype, device=self.device)
                tdist.broadcast(tensor, src=0)
                if not self.is_main:  # rank 0's shards are its own already
                    piece = distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(piece.to_local())
                del tensor
            for buffer in model.buffers():  # not sharded (rotary frequencies)
                tdist.broadcast(buffer, src=0)
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass: bf16 autocast where bf16 is on and FSDP2 does not already
        compute in bf16 (DDP, one process); otherwise nothing."""
        if self.bf16 and self.wrapper != "fsdp2":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: with sharded gradients the norm
        is the global one (the same on every rank). Returns the norm before clipping."""
        params = [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # --- the data ------------------------------------------------------------------------------

    def shard(self, items: Sequence[T], cost: Callable[[T], float] | None = None) -> list[T]:
        """This rank's share of ``items``, in their order; the shares partition ``items`` and are
        the same on every rank's call. Without ``cost``: every ``world_size``-th item from
        ``rank``. With it: greedily balanced (heaviest first to the least loaded rank, ties to
        fewer items then lower rank), so ranks finish a step together. Either way every rank gets
        a list, non-empty when there are at least ``world_size`` items."""
        if not self.enabled:
            return list(items)
        if cost is None:
            return list(items[self.rank :: self.world_size])
        costs = [float(cost(item)) for item in items]
        load, count, owner = [0.0] * self.world_size, [0] * self.world_size, [0] * len(items)
        for i in sorted(range(len(items)), key=lambda i: (-costs[i], i)):
            r = min(range(self.world_size), key=lambda r: (load[r], count[r], r))
            owner[i], load[r], count[r] = r, load[r] + costs[i], count[r] + 1
        return [item for item, r in zip(items, owner) if r == self.rank]

    def all_reduce_sum(self, x: Number) -> Number:
        """The sum of ``x`` over ranks, on every rank (an int, a float or a tensor, as given; a
        tensor comes back as a new tensor on its own device)."""
        return self._all_reduce(x, tdist.ReduceOp.SUM)

    def all_reduce_max(self, x: Number) -> Number:
        """The maximum of ``x`` over ranks (e.g. the micro-batch count every rank must run)."""
        return self._all_reduce(x, tdist.ReduceOp.MAX)

    def _all_reduce(self, x: Number, op: tdist.ReduceOp) -> Number:
        if isinstance(x, torch.Tensor):
            out = x.detach().clone()
            if self.enabled:
                moved = out.to(self._comm_device)
                tdist.all_reduce(moved, op=op)
                out = moved.to(x.device)
            return out  # type: ignore[return-value]
        if not self.enabled:
            return x
        t = torch.tensor(x, dtype=torch.int64 if isinstance(x, int) else torch.float64, device=self._comm_device)
        tdist.all_reduce(t, op=op)
        return type(x)(t.item())  # type: ignore[return-value]

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` (anything picklable) on every rank; what the others pass is ignored."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        tdist.broadcast_object_list(box, src=0, device=self._comm_device)
        return box[0]  # type: ignore[return-value]

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (e.g. parity differences
        for quantiles over the whole step)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # --- full (unsharded) states, for the checkpoint and for publishing -------------------------

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter, whole, as a CPU tensor in the master dtype (fp32), on rank 0 (``{}``
        on the others; every rank calls it). Names and tied weights as ``named_parameters``."""
        if not self.enabled:
            return {name: p.detach().to("cpu", copy=True) for name, p in unwrap(model).named_parameters()}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return {}
        return {name: full[name] for name, _ in unwrap(model).named_parameters()}  # no buffers, tied once

    def load_full_state(self, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Load a :meth:`full_state_dict` (or a bf16 export with the same names, cast to the
        master dtype; its persistent buffers too, where it has them) held by rank 0 into the
        wrapped model; every rank calls it, the others' ``state`` is ignored. Names and shapes must
        match (``KeyError``/``ValueError`` otherwise; raised on rank 0, which ends the job:
        torchrun stops the other ranks)."""
        if not self.enabled:
            load_state(unwrap(model), dict(state))
            return
        full: dict[str, torch.Tensor] = {}
        if self.is_main:
            plain = unwrap(model)
            buffers = persistent_buffers(plain)  # an export's: sent with the parameters
            # An export's checkpoint names are the model's here; each tensor's source, checked.
            sources = {id(t): src for _, t, src in pair_state(dict(plain.named_parameters()), buffers, to_model(plain, state))}
            for name, t in [*plain.named_parameters(remove_duplicate=False), *buffers.items()]:  # tied: every alias
                if id(t) in sources:  # a buffer the state lacks keeps its value
                    full[name] = sources[id(t)].to(t.dtype)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, full, options=options)

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What ``optimizer.state_dict()`` gives in one process (whole tensors on CPU, parameters
        keyed by their index in the optimizer's groups), on rank 0; ``{}`` on the others."""
        if not self.enabled:
            return optimizer.state_dict()
        by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return {}
        index = {name: i for i, name in enumerate(_optimizer_names(model, optimizer))}
        # The hyperparameters are the same on every rank: this rank's plain param_groups are the
        # single-process ones exactly (parameters as indices, betas a tuple).
        return {"state": {index[name]: s for name, s in by_name["state"].items()},
                "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load an :meth:`optimizer_state_dict` held by rank 0 (the others' is ignored) into the
        optimizer of the wrapped model; every rank calls it."""
        if not self.enabled:
            optimizer.load_state_dict(dict(state))
            return
        by_name: dict[str, Any] = {}
        if self.is_main:
            names = _optimizer_names(model, optimizer)
            by_name = {
                "state": {names[i]: s for i, s in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
            }
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optimizer, by_name, options=options)
        # The loader hands hyperparameters back through lists (betas a list): set them as given,
        # so that the next optimizer_state_dict() is the single-process one exactly.
        groups = self.broadcast_object(list(state["param_groups"]) if self.is_main else None)
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


    # --- sharded states (torch DCP), for sharded checkpoints -------------------------------------

    def save_sharded_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Write the master weights and the optimizer state under ``path`` (a folder), each rank its
        own FSDP2 shards (``torch.distributed.checkpoint``: one file per rank and rank 0's
        ``.metadata``, fsynced); no rank gathers either state. Every rank calls it."""
        dcp.save(self._sharded_states(model, optimizer), checkpoint_id=path, no_dist=not self.enabled)

    def load_sharded_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Load a :meth:`save_sharded_state` folder into the wrapped model and its optimizer, with
        any number of ranks (DCP reshards: each rank reads the slices of its own shards). Every
        rank calls it."""
        state = self._sharded_states(model, optimizer)
        dcp.load(state, checkpoint_id=path, no_dist=not self.enabled)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    @staticmethod
    def _sharded_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each index of ``optimizer.state_dict()`` (its groups' order)."""
    name_of = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


#: The single process (rank 0 of 1): what ``train_step`` uses outside torchrun.
SINGLE = Dist()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its DDP wrapper (an FSDP2 model is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a model without weights (``meta`` parameters) uninitialised memory on ``device``, its
    real buffers kept (``Module.to_empty`` would blank them) and its tied weights tied again
    (``to_empty`` allocates each use of a shared parameter apart)."""
    kept = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in kept:
                b.copy_(kept[name])
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: instances of the classes that a Hugging Face model
    (wrapped by peft or not) names in ``_no_split_modules``; none for other models (then only the
    root is sharded: correct, with one all-gather of everything)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def placeholder_batch() -> Batch:
    """A one-row batch with no trainable token: the pass a rank without (more) data runs so that
    its collectives pair with the other ranks' (zero loss, zero gradient)."""
    zeros = torch.zeros(1, 2)
    return Batch(tokens=torch.zeros(1, 2, dtype=torch.long), attention=torch.ones(1, 2, dtype=torch.long),
                 positions=torch.arange(2)[None, :], logp_behaviour=zeros, mask=zeros.clone(), advantages=zeros.clone(),
                 sample_index=torch.zeros(1, 2, dtype=torch.long))
