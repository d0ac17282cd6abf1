"""Each rank's rows of a model's parameters, read from safetensors files: FSDP2's split of dim 0, by name or by expert.

:func:`read_rows` fills the parameters of a model wrapped by :meth:`trainer.distributed.Dist.wrap`
(plain tensors in one process or under DDP, ``Shard(0)`` DTensors under FSDP2) from files that
hold every parameter: a version rebuilt into a file, a model folder's shards. Each rank maps the
files and copies only its own rows, so only those pages are read. Files that hold a parameter under
its checkpoint's names and layout instead (``flywheel.weightnames``: a mixture of experts'
per-expert tensors) are read by the pieces of this rank's rows where those are whole experts,
else whole, one parameter at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from flywheel.weightnames import pieces, row_pieces, to_model
from flywheel.weights.codec.tensorfile import TensorFiles


def read_rows(model: torch.nn.Module, paths: Sequence[str | Path]) -> None:
    """Copy into each parameter of ``model`` what this rank holds of it (all of a plain tensor; a
    DTensor ``Shard(0)`` shard's rows) from the safetensors files ``paths``, which must hold every
    parameter by name with its shape (``KeyError``/``ValueError`` otherwise); values are cast to
    the parameter's dtype (a bf16 version into the fp32 master). A parameter the files hold under
    the checkpoint's names and layout instead (``flywheel.weightnames``: a mixture of experts'
    per-expert tensors) is put together from them, one parameter at a time: from this rank's
    experts alone where its rows are whole experts, else whole, and its rows taken from that."""
    missing = [os.fspath(p) for p in paths if not os.path.exists(p)]
    if missing:  # another host's file: the folder is not shared
        raise FileNotFoundError(f"this rank cannot see {missing}: every rank reads its rows of the same files, "
                                "so ranks on several hosts need them on a filesystem they share")
    with TensorFiles(list(paths)) as files, torch.no_grad():
        for name, param in model.named_parameters():
            local, start = _local_rows(name, param)
            with _rows(model, name, param, files, paths, start, local.shape[0]) as rows:
                local.copy_(rows)


@contextlib.contextmanager
def _rows(model: torch.nn.Module, name: str, param: torch.Tensor, files: TensorFiles, paths: Sequence[str | Path],
          start: int | None, count: int) -> Iterator[torch.Tensor]:
    """Rows ``start:start + count`` of parameter ``name`` as ``files`` hold it (all of it when
    ``start`` is None): a view of its tensor; or, where the files hold the checkpoint's pieces of
    it (``flywheel.weightnames``), the rows put together from the pieces they are made of (a
    mixture of experts: this rank's experts only, ``row_pieces``), else from all of its pieces,
    one parameter at a time."""
    shape = tuple(param.shape)
    if name in files.index:
        info = files.index[name]
        if tuple(info.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(info.shape)} in the file, {shape} in the model")
        with files.view(name) as whole:
            yield whole if start is None else whole[start:start + count]
        return
    sources = None if start is None else row_pieces(model, name, shape, param.dtype, start, start + count)
    only_rows = sources is not None
    if sources is None:
        sources = list(pieces(model, name, shape, param.dtype))
    absent = [s for s in sources if s not in files.index]
    if absent:
        raise KeyError(f"{absent[0]} is not in {[os.fspath(p) for p in paths]}")
    want = (count, *shape[1:]) if only_rows else shape
    if not sources:  # a rank with no rows of it
        yield torch.empty(want, dtype=param.dtype)
        return
    with contextlib.ExitStack() as views:
        held = {s: views.enter_context(files.view(s)) for s in sources}
        built = to_model(model, held)[name]
        if tuple(built.shape) != want:
            raise ValueError(f"{name}: shape {tuple(built.shape)} from the files' {sources[:2]}..., {want} wanted")
        del held
        yield built if only_rows or start is None else built[start:start + count]


def _local_rows(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """This rank's part of ``param`` and the first row of it in the whole tensor (``None``: all of
    it). FSDP2 shards dim 0 as ``torch.chunk`` does: ``ceil(rows / ranks)`` rows a rank, the last
    ranks short or empty."""
    if not isinstance(param, DTensor):
        return param.data, None
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(f"{name}: only a 1-D mesh sharding dim 0 is read by rows, not {placements}")
    rows, ranks = param.shape[0], mesh.size()
    chunk = -(-rows // ranks)
    start = min(mesh.get_local_rank() * chunk, rows)
    local = param.to_local()
    if local.shape[0] != min(chunk, rows - start):
        raise RuntimeError(f"{name}: a shard of {local.shape[0]} rows where torch.chunk gives {min(chunk, rows - start)}")
    return local, start
