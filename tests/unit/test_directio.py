"""Direct writes: any offsets and lengths, from several threads, give exactly the bytes written
(on the temp folder's real filesystem, which refuses misaligned O_DIRECT), and a filesystem that
refuses direct I/O, at open or halfway, gets the same bytes through the page cache."""

from __future__ import annotations

import errno
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.weights.codec import directio
from flywheel.weights.codec.directio import BLOCK, DirectFile

pytestmark = pytest.mark.unit


def pieces(rng: random.Random, size: int) -> list[tuple[int, bytes]]:
    """``size`` bytes cut at random points (a few inside one block, some aligned, one longer than
    the staging buffer), each piece random bytes."""
    cuts = {0, size, 3, BLOCK, 2 * BLOCK, 2 * BLOCK + 1, 9 * BLOCK - 7, size - 1, size - BLOCK}
    cuts |= {rng.randrange(size) for _ in range(40)}
    if size > 4 * directio._STAGE:  # one piece of more than twice the staging buffer, in the middle
        cuts = {c for c in cuts if abs(c - size // 2) >= directio._STAGE}
    cuts = sorted(c for c in cuts if 0 <= c <= size)
    return [(a, rng.randbytes(b - a)) for a, b in zip(cuts, cuts[1:]) if b > a]


def write(path: Path, parts: list[tuple[int, bytes]], size: int) -> DirectFile:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        out = DirectFile(fd, size)
        order = list(parts)
        random.Random(len(parts)).shuffle(order)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: out.pwrite(memoryview(p[1]), p[0]), order))
        out.finish()
        os.fsync(fd)
    finally:
        os.close(fd)
    return out


def faulty_direct_writes(monkeypatch: pytest.MonkeyPatch, fault: int, after: int = 1) -> list[int]:
    """From the ``after``-th direct write on, the kernel answers ``fault`` (an errno) to every write
    through a descriptor :func:`directio.open_direct` opened; returns the count of direct writes
    tried, ``[n]`` (0: the platform has no O_DIRECT)."""
    direct_fds: set[int] = set()
    real_open, real_pwrite = directio.open_direct, os.pwrite
    calls = [0]

    def tracked_open(fd: int) -> int | None:
        got = real_open(fd)
        if got is not None:
            direct_fds.add(got)
        return got

    def faulty(fd: int, data: memoryview, offset: int) -> int:
        if fd in direct_fds:
            calls[0] += 1
            if calls[0] >= after:
                raise OSError(fault, os.strerror(fault))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(directio, "open_direct", tracked_open)
    monkeypatch.setattr(directio.os, "pwrite", faulty)
    return calls


@pytest.mark.parametrize("size", [1, BLOCK - 5, BLOCK, 5 * BLOCK + 17, 4 * directio._STAGE + 3 * BLOCK + 11])
def test_scattered_writes_give_exactly_their_bytes(tmp_path: Path, size: int) -> None:
    rng = random.Random(size)
    parts = pieces(rng, size)
    out = write(tmp_path / "f", parts, size)
    assert (tmp_path / "f").read_bytes() == b"".join(data for _, data in parts)
    if hasattr(os, "O_DIRECT"):
        assert out.direct  # this filesystem takes O_DIRECT: the writes went around the page cache


def test_a_filesystem_without_direct_io_gets_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directio, "open_direct", lambda fd: None)
    size = 3 * BLOCK + 100
    parts = pieces(random.Random(0), size)
    assert not write(tmp_path / "f", parts, size).direct
    assert (tmp_path / "f").read_bytes() == b"".join(data for _, data in parts)


def test_a_direct_write_refused_halfway_falls_back_to_the_page_cache(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel answers EINVAL to a direct write it cannot align (a device with bigger blocks
    than :data:`BLOCK`): injected on the third direct write; the rest goes through the page cache."""
    calls = faulty_direct_writes(monkeypatch, errno.EINVAL, after=3)
    size = 40 * BLOCK + 333
    parts = pieces(random.Random(1), size)
    out = write(tmp_path / "f", parts, size)
    if not calls[0]:
        pytest.skip("no O_DIRECT on this platform")
    assert calls[0] >= 3 and not out.direct
    assert (tmp_path / "f").read_bytes() == b"".join(data for _, data in parts)


def test_a_device_error_is_raised_not_taken_for_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only EINVAL (a misaligned write refused) falls back to the page cache; a device error (EIO,
    injected on the direct descriptor) reaches the caller, who discards the file."""
    calls = faulty_direct_writes(monkeypatch, errno.EIO)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        out = DirectFile(fd, 4 * BLOCK)
        if not out.direct:
            pytest.skip("no O_DIRECT on this platform")
        with pytest.raises(OSError, match="Input/output"):
            out.pwrite(memoryview(bytes(4 * BLOCK)), 0)
        assert calls[0] == 1 and out.direct  # not a fallback
        out.close()
    finally:
        os.close(fd)
