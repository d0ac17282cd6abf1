"""The built-in inference engine: the last few model versions, micro-batched generation, hot swaps.

``Engine(model_dir, settings)`` loads a local Hugging Face model directory and serves it from one
background worker thread. It holds up to ``settings.node.keep_versions`` versions at once, each as
its own model instance, so that sessions pinned to a recent version keep being served by it
(sticky versions). Memory: about ``keep_versions`` x (the fp32 model + its bf16 state), e.g.
4 x 3.9 MB for the tiny model (0.65 M parameters); a large local model wants ``keep_versions`` small.

One version is *live*: the one the updater follows (the registry's stable version) and the one a
request that names no version gets. A request may name any held version (``version=N``); one that
names a version the engine does not hold fails with :class:`VersionUnavailable`, which lists what
it holds. Concurrent requests queue up; the worker takes what is waiting (up to ``max_batch``,
waiting at most ``batch_window_s`` for company) and runs one batched ``generate`` per group of
requests that share version and sampling processing (``flywheel.sampling``). Seeded requests run alone, so a seed
reproduces the same completion whatever else is in flight. A request for ``n`` choices puts ``n``
rows of its prompt in its batch, so its choices are independent samples of one distribution drawn
by one version.

Invariants:
- A batch runs on exactly one version: requests of different versions never share a
  ``generate`` call, and every :class:`Completion` names the version and sha256 of the weights
  that produced it.
- Generation and loading take the same lock: a batch that started on version N finishes on N,
  and no model instance is rewritten while a batch uses it; a request without a version runs on
  what is live when its batch is formed. Submitting and reading what is held take only a short
  second lock, so the event loop never waits for a batch.
- Loading a version beyond ``keep_versions`` evicts the held version least recently loaded or
  made live, never the live one (unless the new version replaces it, with ``keep_versions=1``);
  its model instance is reused, and a request queued for it fails with :class:`VersionUnavailable`.
- A load whose state does not match the model's parameter names and shapes changes nothing;
  a held version is immutable (loading it again with another hash is refused).
- Until the engine knows its registered version (``version is None``) it refuses to generate.
"""

from __future__ import annotations

import copy
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel import lm
from flywheel.sampling import NEUTRAL, Processing, node_defaults
from flywheel.settings import Settings
from flywheel.weights.codec.state import state_sha256

log = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The engine has no registered version yet."""


class VersionUnavailable(LookupError):
    """The engine does not hold the version a request named."""

    def __init__(self, version: int, held: list[int]) -> None:
        super().__init__(f"version {version} is not loaded on this node; it holds {held}")
        self.version = version
        self.held = held


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    #: The sampled distribution's shaping (temperature, top-p, top-k, min-p, penalties, bias).
    processing: Processing = NEUTRAL
    seed: int | None = None
    #: The model version to sample from; None: the live one.
    version: int | None = None
    #: Choices to sample (independent samples of the same prompt, by the same version).
    n: int = 1


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


@dataclass
class _Slot:
    """One loaded version: its own model instance and the exact state it was built from."""

    model: Any
    state: dict[str, torch.Tensor]
    sha256: str


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
        self.keep_versions = settings.node.keep_versions
        model, self.tokenizer = lm.load_model(self.model_dir)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        #: What a request that leaves a sampling knob unset gets (``node.generation_config``).
        self.sampling_defaults = node_defaults(settings, self.model_dir)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        state = lm.export_state(model)
        self._live = _Slot(model, state, state_sha256(state))
        #: Named versions, least recently loaded or made live first; holds the live slot once named.
        self._slots: OrderedDict[int, _Slot] = OrderedDict()
        self.version: int | None = None
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.batches = 0  # generate calls run
        self.requests = 0  # completions returned
        self._lock = threading.Lock()  # generation and weight loads: held for a whole batch or load
        self._meta = threading.Lock()  # which versions are held and live: held for microseconds
        if version is not None:
            self.set_version(version)
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._closed = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._worker.start()

    # Public API --------------------------------------------------------------------------------

    @property
    def sha256(self) -> str:
        """The hash of the live weights."""
        return self._live.sha256

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return lm.chat_prompt_ids(self.tokenizer, messages)

    def text(self, token_ids: list[int]) -> str:
        return lm.completion_text(self.tokenizer, token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def current(self) -> tuple[int | None, str]:
        """(version, sha256) of the live weights: what a request that names no version gets."""
        with self._meta:
            return self.version, self._live.sha256

    def state(self) -> dict[str, torch.Tensor]:
        """The exact state the live version was built from (do not mutate)."""
        with self._meta:
            return self._live.state

    def versions(self) -> list[int]:
        """The versions held, ascending."""
        with self._meta:
            return sorted(self._slots)

    def holds(self, version: int) -> bool:
        with self._meta:
            return version in self._slots

    def set_version(self, version: int) -> None:
        """Name the weights loaded at start-up (when they match a registered version)."""
        with self._meta:
            if self.version is not None:
                del self._slots[self.version]
            self._slots[version] = self._live
            self.version = version

    def submit(self, request: GenerationRequest) -> Future:
        """Queue one generation; the future resolves to its ``request.n`` choices, a list of
        :class:`Completion` in choice order, all from one version.

        Raises :class:`VersionUnavailable` at once when ``request.version`` is not held (the
        future fails with it instead if the version is evicted before its batch runs).
        """
        if self._closed.is_set():
            raise RuntimeError("engine is closed")
        with self._meta:
            if self.version is None:
                raise EngineNotReady("the engine has not loaded a registered version yet")
            if request.version is not None and request.version not in self._slots:
                raise VersionUnavailable(request.version, sorted(self._slots))
        future: Future = Future()
        self._queue.put(_Pending(request, future))
        return future

    def generate(self, request: GenerationRequest) -> list[Completion]:
        return self.submit(request).result()

    def load_from(self, registry: Any, version: int, *, live: bool = True) -> None:
        """Load registry ``version`` (``registry.load``, every step's hash checked; deltas applied to
        the live version's state when it is on the chain) and :meth:`swap` it in."""
        current = self.current()[0]
        info = registry.get(version)
        state = registry.load(version, base=(current, self.state()) if current is not None else None)
        self.swap(version, state, info.sha256, live=live)

    def swap(self, version: int, state: dict[str, torch.Tensor], sha256: str, *, live: bool = True) -> None:
        """Load ``state`` as ``version`` between batches (and make it live unless ``live=False``),
        evicting the least recently used non-live version beyond ``keep_versions``; nothing
        changes if it does not fit."""
        with self._lock:  # no batch runs while a model instance is rewritten
            with self._meta:
                held = self._slots.get(version)
                if held is not None and held.sha256 != sha256:
                    raise ValueError(f"version {version} is held with hash {held.sha256[:12]}, not {sha256[:12]}")
                evicted: _Slot | None = None
                if held is None:
                    mismatched = _mismatch(self._live.state, state)
                    if mismatched:
                        raise ValueError(f"state for version {version} does not fit the model: {mismatched}")
                    if len(self._slots) >= self.keep_versions:
                        # Least recently used first; the live one only when the new version replaces it.
                        victims = [v for v in self._slots if v != self.version] + ([self.version] if live else [])
                        if not victims:
                            raise ValueError(f"keep_versions={self.keep_versions} leaves no room for version "
                                             f"{version} beside the live version {self.version}")
                        evicted = self._slots.pop(victims[0])  # requests naming it are refused from now on
                        log.info("engine evicts version %d (keeps %d)", victims[0], self.keep_versions)
            if held is None:
                # Reuse the evicted instance's memory, or copy the live model's structure.
                model = evicted.model if evicted is not None else copy.deepcopy(self._live.model)
                lm.load_state(model, state)
                held = _Slot(model, state, sha256)
            with self._meta:
                self._slots[version] = held
                self._slots.move_to_end(version)
                if live:
                    self._live, self.version = held, version
                held_now = sorted(self._slots)
        log.info("engine holds versions %s, live %s (loaded %d, %s)", held_now, self.version, version, sha256[:12])

    def activate(self, version: int) -> bool:
        """Make a held version live without loading anything; False if it is not held."""
        with self._meta:
            held = self._slots.get(version)
            if held is None:
                return False
            self._slots.move_to_end(version)
            self._live, self.version = held, version
        log.info("engine now serves version %d (already held)", version)
        return True

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
            with self._meta:
                live = self.version
            for group in group_requests(batch, live):
                self._run(group)

    def _run(self, group: list[_Pending]) -> None:
        live = [p for p in group if p.future.set_running_or_notify_cancel()]
        if not live:
            return
        first = live[0].request
        try:
            with self._lock:
                with self._meta:
                    named = {p.request.version for p in live} - {None}
                    assert len(named) <= 1, named
                    if named:
                        version = named.pop()
                        slot = self._slots.get(version)
                        if slot is None:
                            raise VersionUnavailable(version, sorted(self._slots))
                    else:
                        version, slot = self.version, self._live
                assert version is not None
                samples = lm.generate(
                    slot.model,
                    [p.request.prompt_ids for p in live for _ in range(p.request.n)],
                    max_new_tokens=max(p.request.max_new_tokens for p in live),
                    processing=first.processing,
                    seed=first.seed,
                    eos_token_id=self.eos_token_id,
                )
                self.batches += 1
                self.requests += len(samples)
        except VersionUnavailable as exc:  # evicted while queued: the client is told what is held
            for p in live:
                p.future.set_exception(exc)
            return
        except Exception as exc:  # hand the failure to every waiting request; the worker keeps serving
            log.exception("generation failed for a batch of %d", len(live))
            for p in live:
                p.future.set_exception(exc)
            return
        rows = iter(samples)
        for p in live:
            choices = []
            for sample in itertools.islice(rows, p.request.n):
                ids, lps = truncate(sample.token_ids, sample.logprobs, p.request.max_new_tokens)
                finish = "stop" if ids and ids[-1] == self.eos_token_id else "length"
                choices.append(Completion(ids, lps, finish, version, slot.sha256))
            p.future.set_result(choices)


def group_requests(batch: list[_Pending], live: int | None = None) -> list[list[_Pending]]:
    """Requests that can share one ``generate`` call: same version (one that names none counts as
    ``live``) and processing, no seed. A group never holds two different named versions."""
    groups: dict[tuple[int | None, Processing], list[_Pending]] = {}
    alone: list[list[_Pending]] = []
    for pending in batch:
        r = pending.request
        if r.seed is not None:
            alone.append([pending])
        else:
            version = r.version if r.version is not None else live
            groups.setdefault((version, r.processing), []).append(pending)
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
