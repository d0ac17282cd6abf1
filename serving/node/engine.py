"""The built-in inference engine: one model, micro-batched generation, hot weight swaps.

``Engine(model_dir, settings)`` loads a local Hugging Face model directory and serves it from one
background worker thread. Concurrent requests queue up; the worker takes what is waiting (up to
``max_batch``, waiting at most ``batch_window_s`` for company) and runs one batched ``generate``
per group of requests that share temperature and top-p. Seeded requests run alone, so a seed
reproduces the same completion whatever else is in flight.

Invariants:
- Generation and :meth:`swap` take the same lock: a batch that started on version N finishes on
  version N and is reported as N; the next batch sees the new weights.
- Every :class:`Completion` names the version and sha256 of the weights that produced it.
- A swap whose state does not match the model's parameter names and shapes changes nothing.
- Until the engine knows its registered version (``version is None``) it refuses to generate.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.settings import Settings
from flywheel.tinymodel import sampling
from flywheel.weights.codec import state_sha256

log = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The engine has no registered version yet."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    sha256: str


@dataclass
class _Pending:
    request: GenerationRequest
    future: Future


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        settings: Settings,
        *,
        version: int | None = None,
        max_batch: int = 16,
        batch_window_s: float = 0.002,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.model, self.tokenizer = sampling.load_model(self.model_dir)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self._state = sampling.export_state(self.model)
        self.sha256 = state_sha256(self._state)
        self.version = version
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.batches = 0  # generate calls run
        self.requests = 0  # completions returned
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._closed = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._worker.start()

    # Public API --------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return sampling.chat_prompt_ids(self.tokenizer, messages)

    def text(self, token_ids: list[int]) -> str:
        return sampling.completion_text(self.tokenizer, token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def current(self) -> tuple[int | None, str]:
        """(version, sha256) of the weights the next batch will use."""
        with self._lock:
            return self.version, self.sha256

    def state(self) -> dict[str, torch.Tensor]:
        """The exact state the current version was built from (do not mutate)."""
        with self._lock:
            return self._state

    def set_version(self, version: int) -> None:
        """Name the weights already loaded (at start-up, when they match a registered version)."""
        with self._lock:
            self.version = version

    def submit(self, request: GenerationRequest) -> Future:
        """Queue one generation; the future resolves to a :class:`Completion`."""
        if self._closed.is_set():
            raise RuntimeError("engine is closed")
        if self.version is None:
            raise EngineNotReady("the engine has not loaded a registered version yet")
        future: Future = Future()
        self._queue.put(_Pending(request, future))
        return future

    def generate(self, request: GenerationRequest) -> Completion:
        return self.submit(request).result()

    def swap(self, version: int, state: dict[str, torch.Tensor], sha256: str) -> None:
        """Load ``state`` as ``version`` between batches; nothing changes if it does not fit."""
        with self._lock:
            mismatched = _mismatch(self._state, state)
            if mismatched:
                raise ValueError(f"state for version {version} does not fit the model: {mismatched}")
            sampling.load_state(self.model, state)
            self._state = state
            self.version = version
            self.sha256 = sha256
        log.info("engine now serves version %d (%s)", version, sha256[:12])

    def close(self) -> None:
        self._closed.set()
        self._worker.join(timeout=5.0)
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            pending.future.set_exception(RuntimeError("engine closed"))

    # Worker ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + self.batch_window_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except queue.Empty:
                    pass
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(self._queue.get(timeout=remaining))
                except queue.Empty:
                    break
            for group in group_requests(batch):
                self._run(group)

    def _run(self, group: list[_Pending]) -> None:
        live = [p for p in group if p.future.set_running_or_notify_cancel()]
        if not live:
            return
        first = live[0].request
        try:
            with self._lock:
                version, sha = self.version, self.sha256
                assert version is not None
                samples = sampling.generate(
                    self.model,
                    [p.request.prompt_ids for p in live],
                    max_new_tokens=max(p.request.max_new_tokens for p in live),
                    temperature=first.temperature,
                    top_p=first.top_p,
                    seed=first.seed,
                    eos_token_id=self.eos_token_id,
                )
                self.batches += 1
                self.requests += len(live)
        except Exception as exc:  # hand the failure to every waiting request; the worker keeps serving
            log.exception("generation failed for a batch of %d", len(live))
            for p in live:
                p.future.set_exception(exc)
            return
        for p, sample in zip(live, samples, strict=True):
            ids, lps = truncate(sample.token_ids, sample.logprobs, p.request.max_new_tokens)
            finish = "stop" if ids and ids[-1] == self.eos_token_id else "length"
            p.future.set_result(Completion(ids, lps, finish, version, sha))


def group_requests(batch: list[_Pending]) -> list[list[_Pending]]:
    """Requests that can share one ``generate`` call: same temperature and top-p, no seed."""
    groups: dict[tuple[float, float], list[_Pending]] = {}
    alone: list[list[_Pending]] = []
    for pending in batch:
        r = pending.request
        if r.seed is not None:
            alone.append([pending])
        else:
            groups.setdefault((r.temperature, r.top_p), []).append(pending)
    return [*groups.values(), *alone]


def truncate(ids: list[int], logprobs: list[float], limit: int) -> tuple[list[int], list[float]]:
    """A completion sampled with a larger budget, cut to ``limit`` tokens (same distribution)."""
    return ids[:limit], logprobs[:limit]


def _mismatch(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> str:
    missing, extra = current.keys() - new.keys(), new.keys() - current.keys()
    if missing or extra:
        return f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
    for name, tensor in current.items():
        if tuple(new[name].shape) != tuple(tensor.shape):
            return f"{name}: shape {tuple(new[name].shape)} != {tuple(tensor.shape)}"
    return ""
