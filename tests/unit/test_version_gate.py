"""The full-mode vLLM front's reader/writer lock on the live version (serving/node/vllm_front.py):
requests share it, a reload takes it alone after the requests in flight, requests that come while a
reload waits or runs queue behind it, and no way out of the queue (admitted, timed out, cancelled,
a reload that gives up) leaves a count behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.node.vllm_front import DrainTimeout, VersionGate

pytestmark = pytest.mark.unit


async def _until(check, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_writer_waits_for_the_readers_and_new_readers_wait_for_the_writer() -> None:
    gate = VersionGate(drain_timeout_s=10)
    log: list[str] = []
    release_writer = threading.Event()

    def writer() -> None:
        with gate.exclusive():
            log.append("writer in")
            release_writer.wait(5)
            log.append("writer out")

    async def main() -> None:
        assert await gate.acquire_shared(1) and await gate.acquire_shared(1)
        assert gate.readers == 2 and not gate.reloading
        thread = threading.Thread(target=writer)
        thread.start()
        await _until(lambda: gate.reloading)
        late = asyncio.create_task(gate.acquire_shared(5))
        await _until(lambda: gate.queued == 1)
        assert log == [] and not late.done()  # the writer waits for both readers; the late reader for the writer
        gate.release_shared()
        await asyncio.sleep(0.05)
        assert log == []
        gate.release_shared()
        await _until(lambda: log == ["writer in"])
        assert not late.done() and gate.readers == 0
        release_writer.set()
        assert await late is True
        assert log == ["writer in", "writer out"] and gate.readers == 1 and gate.queued == 0
        assert not gate.reloading
        gate.release_shared()
        thread.join(5)

    asyncio.run(main())
    assert gate.readers == 0


def test_a_reader_that_times_out_or_is_cancelled_leaves_nothing_behind() -> None:
    gate = VersionGate()
    release = threading.Event()

    def writer() -> None:
        with gate.exclusive():
            release.wait(5)

    async def main() -> None:
        thread = threading.Thread(target=writer)
        thread.start()
        await _until(lambda: gate.reloading)
        started = time.monotonic()
        assert await gate.acquire_shared(0.2) is False
        assert 0.15 < time.monotonic() - started < 2
        cancelled = asyncio.create_task(gate.acquire_shared(5))
        await _until(lambda: gate.queued == 1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert gate.queued == 0 and gate.readers == 0
        release.set()
        thread.join(5)
        assert await gate.acquire_shared(0.1) and gate.readers == 1
        gate.release_shared()

    asyncio.run(main())
    assert gate.readers == 0 and gate.queued == 0 and not gate.reloading


def test_a_writer_that_outwaits_its_drain_timeout_changes_nothing_and_lets_the_queue_in() -> None:
    gate = VersionGate(drain_timeout_s=0.3)
    outcome: list[BaseException | None] = []

    def writer() -> None:
        try:
            with gate.exclusive():
                outcome.append(None)
        except DrainTimeout as exc:
            outcome.append(exc)

    async def main() -> None:
        assert await gate.acquire_shared(1)  # a request that outlasts the drain timeout
        thread = threading.Thread(target=writer)
        thread.start()
        await _until(lambda: gate.reloading)
        queued = asyncio.create_task(gate.acquire_shared(5))
        assert await queued is True  # let in when the writer gave up
        thread.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], DrainTimeout)
        assert "1 request(s) still in flight" in str(outcome[0])
        assert gate.readers == 2 and not gate.reloading
        gate.release_shared()
        gate.release_shared()

    asyncio.run(main())
    assert gate.readers == 0
