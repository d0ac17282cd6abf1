"""Safetensors files read and written one tensor at a time, so memory never holds a whole state.

:class:`TensorReader` parses a file's header (checked: a bad file raises :class:`.state.DeltaError`,
a ``ValueError``) and maps one tensor at a time (threads may map at once; a tensor's pages leave
the process when its block ends, so they never add up to the file). :class:`TensorWriter` lays
out a file from the tensors' names, dtypes and shapes first, then takes each tensor's bytes in any
order, from any thread (``pwrite`` at its offset). Together they are what a delta between two
100 GB files needs: peak memory is a few of the largest tensors, whatever the model's size.
:class:`StateReader` reads a state already in memory the same way, for the same coders.

The format (https://github.com/huggingface/safetensors): ``u64`` little-endian header length, a
JSON header mapping names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
data after the header; ``__metadata__`` a string map), then the data. Files written here pad the
header with spaces to a multiple of 8 bytes, as the reference writer does. Little-endian hosts.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flywheel.weights.codec.directio import DirectFile, write_all
from flywheel.weights.codec.state import DeltaError

#: safetensors dtype names and the torch dtypes they are.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is not a checkpoint's.
_HEADER_LIMIT = 100 << 20
_LOCAL = threading.local()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: where its bytes are (``offset`` from the file's start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def scratch(nbytes: int, slot: int = 0) -> np.ndarray:
    """This thread's reusable buffer number ``slot`` (0 or 1), ``nbytes`` long (grown, never shrunk):
    where a decoder builds a tensor before it is written out; two let a chain of deltas decode a
    tensor from the previous step's result into the other."""
    buffers = getattr(_LOCAL, "scratch", None)
    if buffers is None:
        buffers = _LOCAL.scratch = [None, None]
    buf = buffers[slot]
    if buf is None or buf.size < nbytes:
        buffers[slot] = None  # free the old one before taking the new
        buf = buffers[slot] = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` files of a model folder (its shards; a version's, the one vLLM started
    from, a trainer's model), in name order; ``ValueError`` when it has none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


class TensorReader:
    """The tensors of one safetensors file, read on demand; ``index`` maps names to :class:`TensorInfo`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.index, self.metadata = self._parse(os.fstat(self._fd).st_size)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _parse(self, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        what = f"{self.path}: not a safetensors file"
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise DeltaError(f"{what} (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            raise DeltaError(f"{what} (header of {length} bytes in a file of {size})")
        try:
            header = json.loads(os.pread(self._fd, length, 8).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DeltaError(f"{what} ({exc})") from exc
        if not isinstance(header, dict):
            raise DeltaError(f"{what} (header is not an object)")
        metadata = header.pop("__metadata__", None) or {}
        data = 8 + length
        index: dict[str, TensorInfo] = {}
        for name, spec in header.items():
            try:
                dtype = DTYPES[spec["dtype"]]
                shape = tuple(int(d) for d in spec["shape"])
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise DeltaError(f"{what} (entry {name!r}: {exc!r})") from exc
            nbytes = math.prod(shape) * dtype.itemsize
            if any(d < 0 for d in shape) or not 0 <= begin <= end <= size - data or end - begin != nbytes:
                raise DeltaError(f"{what} (entry {name!r}: offsets {begin}..{end} for {nbytes} bytes "
                                 f"of data {size - data} long)")
            index[name] = TensorInfo(name, dtype, shape, data + begin, nbytes)
        return index, metadata if isinstance(metadata, dict) else {}

    @contextlib.contextmanager
    def view(self, name: str) -> Iterator[torch.Tensor]:
        """Tensor ``name`` over a private mapping of its bytes (no copy), valid inside the block;
        its pages leave the process's memory when the block ends."""
        info = self.index[name]
        if info.nbytes == 0:
            yield torch.empty(info.shape, dtype=info.dtype)
            return
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fd, info.offset + info.nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        try:
            flat = np.frombuffer(mapping, dtype=np.uint8, count=info.nbytes, offset=info.offset - start)
            yield torch.from_numpy(flat).view(info.dtype).reshape(info.shape)
        finally:
            del flat
            try:
                mapping.close()
            except BufferError:  # the caller kept a view: drop the pages at least (they refault from the file)
                mapping.madvise(mmap.MADV_DONTNEED)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, copied into memory of its own."""
        with self.view(name) as t:
            return t.clone()


class TensorFiles:
    """The tensors of several safetensors files (a model folder's shards) as one: ``index`` over
    all of them, :meth:`view` from whichever holds the name. A name in two files is refused."""

    def __init__(self, paths: list[str | os.PathLike[str]]) -> None:
        self.readers: list[TensorReader] = []
        self.index: dict[str, TensorInfo] = {}
        self._owner: dict[str, TensorReader] = {}
        try:
            for path in paths:
                reader = TensorReader(path)
                self.readers.append(reader)
                for name, info in reader.index.items():
                    if name in self.index:
                        raise DeltaError(f"tensor {name!r} is in both {self._owner[name].path} and {reader.path}")
                    self.index[name], self._owner[name] = info, reader
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def view(self, name: str) -> contextlib.AbstractContextManager[torch.Tensor]:
        """As :meth:`TensorReader.view`."""
        return self._owner[name].view(name)


class StateReader:
    """A state in memory read as :class:`TensorReader` reads a file (``index``, :meth:`view`): what
    the streaming coders take when the tensors are already at hand (any device: each is viewed on
    the CPU, contiguous)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state
        self.index = {n: TensorInfo(n, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()) for n, t in state.items()}

    @contextlib.contextmanager
    def view(self, name: str) -> Iterator[torch.Tensor]:
        yield self._state[name].detach().cpu().contiguous()


class TensorWriter:
    """A safetensors file laid out from ``(name, dtype, shape)`` in that order; :meth:`write` each
    tensor once, in any order and from any thread; :meth:`close` checks every one was written.
    ``direct``: write around the page cache (:class:`.directio.DirectFile`), for an output nobody
    reads right after (the file is then on the device, not in memory; same bytes)."""

    def __init__(self, fd: int, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, *, direct: bool = False) -> None:
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        self._at: dict[str, tuple[int, int]] = {}
        #: name -> (dtype, shape), as laid out.
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {n: (d, tuple(s)) for n, d, s in layout}
        offset = 0
        for name, dtype, shape in layout:
            if dtype not in _NAMES:
                raise DeltaError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._at[name] = (offset, nbytes)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._fd = fd
        self._data = 8 + len(text)
        self._pending = set(self._at)
        self._lock = threading.Lock()
        self.size = self._data + offset
        os.ftruncate(fd, self.size)
        self._out = DirectFile(fd, self.size) if direct else None
        self._put(struct.pack("<Q", len(text)) + text, 0)

    @property
    def direct(self) -> bool:
        """Whether the writes bypass the page cache (asked for, and the filesystem allows it)."""
        return self._out is not None and self._out.direct

    def _put(self, data: bytes | memoryview, offset: int) -> None:
        if self._out is not None:
            self._out.pwrite(memoryview(data), offset)
        else:
            write_all(self._fd, data, offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, nbytes = self._at[name]
        t = tensor.detach().cpu().contiguous()
        if t.numel() * t.element_size() != nbytes:
            raise DeltaError(f"tensor {name!r}: {t.numel() * t.element_size()} bytes where the layout has {nbytes}")
        if nbytes:
            self._put(memoryview(t.reshape(-1).view(torch.uint8).numpy()), self._data + offset)
        with self._lock:
            self._pending.discard(name)

    def close(self) -> None:
        if self._pending:
            if self._out is not None:
                self._out.close()
            raise DeltaError(f"{len(self._pending)} tensor(s) never written, e.g. {sorted(self._pending)[0]!r}")
        if self._out is not None:
            self._out.finish()


class Discard:
    """A writer (as :class:`TensorWriter`, any layout) that keeps nothing: what a check decodes into
    when only the hashes matter (:func:`.streaming.check_delta`, :meth:`.anchor.AnchorReader.decode_into`)."""

    def __init__(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {n: (d, tuple(s)) for n, d, s in layout}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.layout:
            raise DeltaError(f"tensor {name!r} is not in the layout")

    def close(self) -> None:
        pass

