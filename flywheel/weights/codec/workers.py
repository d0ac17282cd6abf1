"""The codec's threads: a small pool that codes tensors in parallel, and per-thread zstd contexts.

The numba kernels, zstd and hashlib release the GIL, so tensors of one state hash, encode and decode
in parallel. Nothing here changes a result: only how fast it comes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zstandard

#: The zstd level of every compressor in the codec.
ZSTD_LEVEL = 3
# Below this many elements in total a state is coded on one thread.
_PARALLEL_MIN_ELEMENTS = 1 << 18
_WORKERS = 2

_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def zstd_contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """This thread's zstd contexts (they are not thread-safe; creating them costs more than small
    tensors take to code)."""
    pair = getattr(_LOCAL, "zstd", None)
    if pair is None:
        pair = _LOCAL.zstd = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return pair


def _pool() -> ThreadPoolExecutor:
    """The module's thread pool, started on first use (and again in a forked child)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="flywheel-codec"))
        return _POOL[1]


def map_tensors(fn: Any, items: list[Any], sizes: list[int]) -> list[Any]:
    """``map`` over tensors (``sizes``: their elements), on a small thread pool when the work is big
    enough (the kernels, zstd and hashlib release the GIL), largest first so the threads finish
    together."""
    if sum(sizes) < _PARALLEL_MIN_ELEMENTS or len(items) < 2:
        return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    futures = {i: _pool().submit(fn, items[i]) for i in order}
    return [futures[i].result() for i in range(len(items))]
