"""Serve registry versions from a vLLM OpenAI server: LoRA adapters loaded at runtime, or full
weights reloaded in place. See docs/vllm.md for the vLLM versions, flags and endpoints it targets.

``VllmAdapter(base_url, registry, work_dir, mode=...)`` drives one vLLM server over HTTP (httpx,
bounded time-outs) for one model line:

- ``mode="lora"``: a version's weights are a PEFT LoRA adapter state. It is written to
  ``work_dir/<line>-v<version>/`` (``adapter_config.json`` + ``adapter_model.safetensors``, written
  to a temporary folder and renamed into place), loaded with ``POST /v1/load_lora_adapter``
  (``{"lora_name": "<line>-v<version>", "lora_path": ...}``) and confirmed in ``GET /v1/models``.
  The last ``keep_versions`` versions stay loaded (the live one always); older ones are unloaded
  with ``POST /v1/unload_lora_adapter`` and their folders removed. Requests for a version use
  ``model = "<line>-v<version>"`` (:meth:`model_for`; :meth:`model_names` for every held version,
  which the node's heartbeat carries to the gateway). vLLM serves the line's fixed base model;
  version 0 of such a line is the zero adapter (``vllm_files.zero_adapter_state``).
- ``mode="full"``: a version's weights are the full model state (the registry's parameter names,
  which must be the checkpoint names vLLM's ``model.load_weights`` accepts). It is rebuilt tensor
  by tensor from the live version's files into ``work_dir/full/<line>-v<version>/model.safetensors``
  and vLLM reloads it in place through the
  dev-mode ``POST /collective_rpc`` calling the workers' ``reload_weights(weights_path=...,
  is_checkpoint_format=True)``, between ``POST /pause?mode=wait`` and ``POST /resume`` (optional),
  followed by ``POST /reset_prefix_cache`` (cached KV was computed by the old weights). Requests
  keep using the served model name.

The adapter has the engine surface the node's :class:`~serving.node.updater.Updater` drives
(``current``, ``versions``, ``holds``, ``activate``, ``load_from``, ``swap``, ``keep_versions``), so the
Updater's registry following, canary preloading, failure bookkeeping and heartbeats work
unchanged; :meth:`apply` is the same step on its own (registry load with hash check, then swap).

Invariants:
- Only weights whose sha256 equals the registry row reach vLLM: :meth:`swap` re-hashes the state
  it is handed, and :meth:`load_from` (which :meth:`apply` and the Updater call) rebuilds through
  ``Registry.load`` (LoRA) or :func:`~flywheel.weights.files.rebuild_file` (full weights, file to
  file: the node never holds the model), both of which verify every step. Files already on disk
  are re-hashed before they are reused.
- A version is reported live or held only after vLLM answered the call that loads it with success
  (and, for LoRA, lists the adapter in ``/v1/models``). On any failure (HTTP error, time-out,
  refusal) the previous version keeps serving and the failure is raised (:meth:`swap`) or
  returned (:meth:`apply`). A failed full reload may have overwritten part of the weights, so the
  adapter reloads the previous version's file; when that fails too, :meth:`current` reports
  ``None`` (unknown) rather than a version vLLM does not hold.
- One load at a time (a lock held across the HTTP calls); readers (``current``, ``model_for``)
  take only a short second lock, so they never wait for vLLM. The adapter never starts or
  restarts vLLM.
- Full mode with a ``gate`` (the node's front, ``serving/node/vllm_front.py``): everything that
  changes what vLLM holds (pause, reload, restore, resume) and the change of :meth:`current` happen
  inside ``gate.exclusive()``, which first waits for the requests in flight; so a request that
  holds the gate shared sees one version from its start to its end. The weights file is written
  before the gate is taken.
- Full mode: a version whose tensor names or shapes differ from the weights vLLM started from is
  refused before vLLM is asked (vLLM reloads a file that lacks tensors with only a warning, keeping
  the old ones). A reload counts only when ``/reset_prefix_cache`` did not say ``{"success": false}``
  (0.33) and, on a vLLM with weight-version labels (0.33: ``/update_weight_version``), vLLM's label
  is the version's :meth:`weight_label`; a 404 there means a vLLM without labels, and the adapter
  carries on without them (:attr:`weight_versions` False).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Literal

import httpx

from flywheel.weights.codec.state import state_sha256
from flywheel.weights.codec.tensorfile import weight_files
from flywheel.weights.files import files_digest, files_layout, rebuild_file
from serving.node.updater import UpdateOutcome
from serving.node.vllm_files import FULL_WEIGHTS, State, adapter_config, check_lora_state, materialise
from serving.node.vllm_probe import logprobs_mode

log = logging.getLogger(__name__)

Mode = Literal["lora", "full"]

#: ``/reset_prefix_cache`` answers ``{"success": false}`` while blocks are still held (0.33); tries.
RESET_TRIES = 3
RESET_RETRY_S = 0.5

#: What vLLM must be started with for each mode (named in errors, so a 404 says what to fix).
_NEEDS = {
    "lora": "vLLM started with --enable-lora (and --max-loras/--max-lora-rank large enough) "
    "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    "full": "vLLM started with VLLM_SERVER_DEV_MODE=1 (dev endpoints /collective_rpc, "
    "/reset_prefix_cache, /pause, /resume)",
}


class VllmError(RuntimeError):
    """vLLM refused a call, failed it, or did not answer in time."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class VllmAdapter:
    """One model line served by the vLLM server at ``base_url`` (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        registry: Any,
        work_dir: str | os.PathLike[str],
        *,
        mode: Mode = "lora",
        served_model_name: str = "",
        keep_versions: int = 4,
        lora_config: dict[str, Any] | None = None,
        base_version: int | None = None,
        base_path: str | os.PathLike[str] | None = None,
        base_digest: tuple[str, dict[str, Any]] | None = None,
        pause: bool = True,
        gate: Any = None,
        api_key: str = "",
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 60.0,
        reload_timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``served_model_name``: vLLM's ``--served-model-name`` (the model full-mode requests name).
        ``lora_config``: the PEFT ``adapter_config.json`` fields of this line's adapters (at least
        ``target_modules`` and ``lora_alpha``; ``r`` is read from the weights when absent).
        ``base_version``/``base_path``: full mode, the registry version vLLM was started with and the
        model folder it was started from (its ``*.safetensors``: the files the first delta is
        applied to, and what a failed update restores); without them the first update rebuilds
        the version from its full anchor and :meth:`current` is ``None`` until then.
        ``base_digest``: the folder's :func:`~flywheel.weights.files.files_digest` when the caller
        has it (else it is read here); it must be the base version's recorded hash.
        ``pause``: full mode, drain requests (``/pause?mode=wait``) around the reload so that no
        generation mixes two versions. ``gate``: full mode, an object whose ``exclusive()`` context
        manager is held around each reload (see the module docstring), e.g. the front's
        :class:`~serving.node.vllm_front.VersionGate`."""
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', not {mode!r}")
        if keep_versions < 1:
            raise ValueError("keep_versions must be at least 1")
        if mode == "lora" and not lora_config:
            raise ValueError("mode='lora' needs lora_config (at least target_modules and lora_alpha)")
        if mode == "full" and (base_version is None) != (base_path is None):
            raise ValueError("give both base_version and base_path, or neither")
        self.mode: Mode = mode
        self.registry = registry
        self.line: str = registry.model_line
        self.work_dir = Path(work_dir)
        self.served_model_name = served_model_name
        self.keep_versions = keep_versions if mode == "lora" else 1
        self.lora_config = dict(lora_config or {})
        self.pause = pause
        self.gate = gate
        self.reload_timeout_s = reload_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            transport=transport,
        )
        self._load_lock = threading.RLock()  # one load at a time (held across HTTP calls)
        self._lock = threading.RLock()  # what is held and live (held briefly; readers never wait on vLLM)
        self._held: dict[int, tuple[str, Path | None]] = {}  # version -> (sha256, folder on disk)
        self._order: list[int] = []  # least recently loaded or made live first
        self._states: dict[int, State] = {}  # LoRA: held versions' states (the live one is the base for deltas)
        self._live: int | None = None
        self.status = "serving"
        self.detail = ""
        self.resume_error = ""  # set when /resume failed after a reload: vLLM stays paused
        #: Full mode: whether vLLM labels its weights (``/update_weight_version``); None: not asked yet.
        self.weight_versions: bool | None = None
        #: Full mode: the tensor names and shapes of the weights vLLM started from (every version must have them).
        self._shapes: dict[str, tuple[Any, tuple[int, ...]]] | None = None
        if mode == "full" and base_version is not None and base_path is not None:
            sha, self._shapes = base_digest or files_digest(weight_files(Path(base_path)))
            if sha != registry.get(base_version).sha256:
                raise ValueError(f"the weights in {base_path} do not match version {base_version}'s recorded hash")
            self._held[base_version] = (sha, Path(base_path))
            self._order.append(base_version)
            self._live = base_version

    def close(self) -> None:
        self._http.close()

    # --- the engine surface the Updater drives ---------------------------------------------------

    def current(self) -> tuple[int | None, str]:
        with self._lock:
            if self._live is None:
                return None, ""
            return self._live, self._held[self._live][0]

    def state(self) -> State:
        """LoRA mode: the live adapter's state (full mode keeps its weights in files only)."""
        with self._lock:
            if self._live is None:
                raise LookupError("no version is live")
            if self.mode == "full":
                raise LookupError("full mode holds the live version as files, not as a state")
            return self._states[self._live]

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def holds(self, version: int) -> bool:
        with self._lock:
            return version in self._held

    def activate(self, version: int) -> bool:
        """Make a held version live (LoRA: it is already loaded in vLLM); False if not held."""
        with self._lock:
            if version not in self._held:
                return False
            if self.mode == "full":
                return version == self._live
            self._live = version
            self._touch(version)
            return True

    def model_for(self, version: int | None = None) -> str:
        """The ``model`` a request for ``version`` (default: the live one) sends to vLLM."""
        with self._lock:
            version = self._live if version is None else version
            if self.mode == "full" or version is None:
                if version is not None and version != self._live:
                    raise LookupError(f"version {version} is not loaded (live: {self._live})")
                return self.served_model_name
            if version not in self._held:
                raise LookupError(f"version {version} is not loaded (held: {sorted(self._held)})")
            return self.lora_name(version)

    def lora_name(self, version: int) -> str:
        return f"{self.line}-v{version}"

    def model_names(self) -> dict[int, str] | None:
        """LoRA mode: the ``model`` each held version is served under; None in full mode (requests
        name the served model, whatever version is live)."""
        if self.mode != "lora":
            return None
        with self._lock:
            return {version: self.lora_name(version) for version in sorted(self._held)}

    def wait_ready(self, stop: threading.Event, every_s: float = 2.0) -> bool:
        """Wait until vLLM answers ``GET /v1/models`` (it may still be loading the model); False if
        ``stop`` was set first."""
        waited = False
        while not stop.is_set():
            try:
                self.loaded_models()
                return True
            except VllmError as exc:
                if not waited:
                    log.info("waiting for vLLM at %s: %s", self._http.base_url, exc)
                waited = True
            stop.wait(every_s)
        return False

    def check_logprobs_mode(self) -> None:
        """Refuse a vLLM that returns raw logprobs (serving/node/vllm_probe.py); raises
        :class:`~serving.node.vllm_probe.LogprobsModeError` saying how to fix it."""
        model = self.served_model_name if self.mode == "full" else self.loaded_models()[0]
        logprobs_mode(lambda body: self._call("POST", "/v1/completions", json=body), model)

    def weight_label(self, version: int) -> str:
        """The label vLLM's weights carry while they are ``version`` (full mode, vLLM with labels)."""
        return f"{self.line}-v{version}"

    def prepare(self) -> None:
        """Full mode, once vLLM answers: find out whether it labels its weights, and label the
        live version's (what it started from)."""
        if self.mode != "full":
            return
        with self._load_lock:
            try:
                self._call("GET", "/weight_info")
                self.weight_versions = True
            except VllmError as exc:
                if exc.status != 404:
                    raise
                self.weight_versions = False
                log.info("vLLM has no weight-version labels (GET /weight_info: 404); answers are not checked against them")
            live = self.current()[0]
            if self.weight_versions and live is not None:
                self._label(live)

    def unload_strays(self) -> list[str]:
        """LoRA mode: unload this line's adapters that vLLM lists but this adapter does not hold
        (loaded by an earlier node process), so they do not pile up in vLLM; returns their names."""
        if self.mode != "lora":
            return []
        with self._load_lock:
            held = {self.lora_name(v) for v in self.versions()}
            pattern = re.compile(rf"{re.escape(self.line)}-v\d+")
            strays = [name for name in self.loaded_models() if pattern.fullmatch(name) and name not in held]
            for name in strays:
                try:
                    self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
                except VllmError as exc:
                    if exc.status != 404:
                        log.warning("could not unload stray LoRA adapter %s: %s", name, exc)
                shutil.rmtree(self.work_dir / name, ignore_errors=True)
            return strays

    def swap(self, version: int, state: State, sha256: str, *, live: bool = True) -> None:
        """Load ``state`` (registry version ``version``, hash ``sha256``) into vLLM; raise
        :class:`VllmError` (or ``ValueError`` for weights that do not match) and keep serving the
        previous version on failure."""
        if state_sha256(state) != sha256:
            raise ValueError(f"version {version}: weights do not match sha256 {sha256[:12]}")
        with self._load_lock:
            if self.mode == "lora":
                self._swap_lora(version, state, sha256, live=live)
            else:
                if not live:
                    raise ValueError("full mode holds one version: it cannot preload without going live")
                self._swap_full(version, state, sha256)

    def _touch(self, version: int) -> None:
        if version in self._order:
            self._order.remove(version)
        self._order.append(version)

    def _forget(self) -> None:
        """vLLM's weights are unknown: claim nothing."""
        with self._lock:
            self._live = None
            self._held, self._order, self._states = {}, [], {}

    def _set(self, status: str, detail: str) -> None:
        self.status, self.detail = status, detail

    # --- one step on its own ---------------------------------------------------------------------

    def apply(self, version: int, *, live: bool = True) -> UpdateOutcome:
        """Make registry ``version`` live in vLLM (``live=False``, LoRA only: load it beside the
        live one). Never raises for a failed load: the outcome says what happened."""
        with self._load_lock:
            current, _ = self.current()
            if version == current or (not live and self.holds(version)):
                return UpdateOutcome(True, False, current)
            if live and self.activate(version):
                self._set("serving", f"updated {current} -> {version} (already loaded)")
                return UpdateOutcome(True, True, version, self.detail)
            started = time.perf_counter()
            try:
                self.load_from(self.registry, version, live=live)
            except Exception as exc:  # keep serving what we have; report why
                reason = f"version {version}: {type(exc).__name__}: {exc}"
                log.error("vLLM update failed, still serving version %s: %s", self.current()[0], reason)
                self._set("failed_update", reason)
                return UpdateOutcome(False, False, self.current()[0], reason)
            took = time.perf_counter() - started
            if not live:
                self._set("serving", f"holding version {version} beside {current} (loaded in {took:.2f}s)")
                return UpdateOutcome(True, False, current, self.detail)
            self._set("serving", f"updated {current} -> {version} in {took:.2f}s")
            return UpdateOutcome(True, True, version, self.detail)

    def load_from(self, registry: Any, version: int, *, live: bool = True) -> None:
        """Load registry ``version`` into vLLM, every step's hash checked: LoRA, rebuilt in memory
        (``registry.load``, deltas on the live adapter) and :meth:`swap`-ped in; full weights,
        rebuilt file to file from the live version's files (:func:`~flywheel.weights.files.rebuild_file`:
        the node never holds the model) and reloaded. Raises as :meth:`swap` does."""
        with self._load_lock:
            current = self.current()[0]
            if self.mode == "lora":
                info = registry.get(version)
                state = registry.load(version, base=(current, self.state()) if current is not None else None)
                self.swap(version, state, info.sha256, live=live)
                return
            if not live:
                raise ValueError("full mode holds one version: it cannot preload without going live")
            if version == current:
                return
            sha = registry.get(version).sha256
            folder = self.work_dir / "full" / f"{self.line}-v{version}"
            if not _holds(folder, sha):
                shutil.rmtree(folder, ignore_errors=True)
                folder.parent.mkdir(parents=True, exist_ok=True)
                tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}-{threading.get_ident()}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                try:
                    base = (current, weight_files(self._held[current][1])) if current is not None else None
                    rebuild_file(registry, version, tmp / FULL_WEIGHTS, base=base)
                    self._check_complete(version, files_layout([tmp / FULL_WEIGHTS]))
                    os.rename(tmp, folder)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            self._go_live(version, sha, folder)

    def loaded_models(self) -> list[str]:
        """The model ids vLLM lists in ``GET /v1/models`` (base model and loaded LoRA adapters)."""
        body = self._call("GET", "/v1/models")
        return [str(card.get("id")) for card in (body or {}).get("data", [])]

    # --- LoRA ------------------------------------------------------------------------------------

    def _swap_lora(self, version: int, state: State, sha256: str, *, live: bool) -> None:
        if version in self._held:
            if self._held[version][0] != sha256:
                raise ValueError(f"version {version} is loaded with another hash")
        else:
            check_lora_state(state)
            name = self.lora_name(version)
            folder = materialise(self.work_dir / name, state, sha256,
                                 adapter_config=adapter_config(state, self.lora_config))
            try:
                if name not in self.loaded_models():  # else: loaded by an earlier attempt that timed out
                    self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
                    if name not in self.loaded_models():
                        raise VllmError(f"vLLM accepted LoRA adapter {name!r} but does not list it in /v1/models")
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)  # vLLM read it already if it loaded it
                raise
            with self._lock:
                self._held[version] = (sha256, folder)
                self._states[version] = state
        with self._lock:
            self._touch(version)
            if live:
                self._live = version
        self._prune_lora()

    def _prune_lora(self) -> None:
        """Unload the least recently used adapters beyond ``keep_versions`` (never the live one)."""
        doomed = [v for v in self._order if v != self._live][: max(0, len(self._held) - self.keep_versions)]
        failures = []
        for version in doomed:
            name = self.lora_name(version)
            try:
                self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
            except VllmError as exc:
                if exc.status != 404:  # 404: vLLM no longer has it, which is what we want
                    failures.append(f"{name}: {exc}")
                    continue  # still loaded in vLLM: keep it on the books, retried next time
            with self._lock:
                _, folder = self._held.pop(version)
                self._order.remove(version)
                self._states.pop(version, None)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if failures:
            log.warning("could not unload LoRA adapters (retried on the next load): %s", "; ".join(failures))

    # --- full weights ----------------------------------------------------------------------------

    def _swap_full(self, version: int, state: State, sha256: str) -> None:
        if version == self._live:
            return
        self._check_complete(version, {n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
        self._go_live(version, sha256, materialise(self.work_dir / "full" / f"{self.line}-v{version}", state, sha256))

    def _go_live(self, version: int, sha256: str, folder: Path) -> None:
        """Reload vLLM from ``folder`` (version ``version``'s weights, verified) and make it live;
        on failure restore the previous version's files and raise."""
        with self.gate.exclusive() if self.gate is not None else contextlib.nullcontext():
            previous = self._live
            previous_folder = self._held[previous][1] if previous is not None else None
            try:
                self._reload(folder, version)
            except VllmError as exc:
                if exc.status is not None and 400 <= exc.status < 500:
                    raise  # refused before touching the weights (dev mode off, bad request)
                raise self._restore(previous, previous_folder, exc) from exc
            with self._lock:
                self._held = {version: (sha256, folder)}
                self._order = [version]
                self._live = version
        for stale in (self.work_dir / "full").iterdir():
            if stale != folder:
                shutil.rmtree(stale, ignore_errors=True)

    def _check_complete(self, version: int, layout: dict[str, tuple[Any, tuple[int, ...]]]) -> None:
        """Refuse a full state (``layout``: name -> (dtype, shape)) that lacks tensors of the model
        (or has others, or other shapes): vLLM would reload it with a warning and keep the old
        tensors, serving a mix under the new label."""
        shapes = {n: tuple(shape) for n, (_, shape) in layout.items()}
        if self._shapes is None:
            self._shapes = dict(layout)  # no base given: the first one
            return
        known = {n: tuple(shape) for n, (_, shape) in self._shapes.items()}
        missing = sorted(set(known) - set(shapes))
        extra = sorted(set(shapes) - set(known))
        reshaped = sorted(n for n in set(shapes) & set(known) if shapes[n] != known[n])
        if missing or extra or reshaped:
            def some(names: list[str]) -> str:
                return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            problems = [f"{label} {len(names)}: {some(names)}" for label, names in
                        (("lacks", missing), ("adds", extra), ("reshapes", reshaped)) if names]
            raise ValueError(f"version {version} is not a full state of the model vLLM serves ("
                             f"{'; '.join(problems)}); not sent to vLLM")

    def _label(self, version: int) -> None:
        """Set vLLM's weight-version label (0.33); a 404 means a vLLM without labels: carry on without."""
        try:
            self._call("POST", "/update_weight_version", json={"new_version": self.weight_label(version)})
        except VllmError as exc:
            if exc.status != 404:
                raise VllmError(f"labelling vLLM's weights as version {version} failed: {exc}") from exc
            self.weight_versions = False

    def _reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``; 0.33 answers ``{"success": false}`` while blocks are held:
        retried, then a failure (0.18 answers an empty 200 whatever happened)."""
        for attempt in range(RESET_TRIES):
            body = self._call("POST", "/reset_prefix_cache")
            if not (isinstance(body, dict) and body.get("success") is False):
                return
            if attempt + 1 < RESET_TRIES:
                time.sleep(RESET_RETRY_S)
        raise VllmError(f"/reset_prefix_cache answered {{\"success\": false}} {RESET_TRIES} times: vLLM kept "
                        "KV computed with the old weights")

    def _reload(self, folder: Path, version: int | None = None) -> None:
        """Pause (drain), reload the weights from ``folder`` on every worker, reset the prefix
        cache, label the weights ``version`` (vLLM with labels), resume. Resume is attempted
        whatever happened."""
        paused = False
        try:
            if self.pause:
                # mode=wait: drain in-flight requests (current vLLM); the deprecated flag means the
                # same to releases whose /pause predates ``mode`` (they ignore unknown parameters
                # and would otherwise abort in-flight requests).
                self._call("POST", "/pause", params={"mode": "wait", "wait_for_inflight_requests": "true"},
                           timeout=self.reload_timeout_s)
                paused = True
            body = self._call(
                "POST",
                "/collective_rpc",
                json={
                    "method": "reload_weights",
                    "kwargs": {"weights_path": str(folder), "is_checkpoint_format": True},
                    "timeout": self.reload_timeout_s,
                },
                timeout=self.reload_timeout_s,
            )
            if body is not None and not isinstance(body.get("results"), list):
                raise VllmError(f"/collective_rpc answered without results: {body!r}", status=200)
            self._reset_prefix_cache()
            if self.weight_versions and version is not None:
                self._label(version)
        finally:
            if paused:
                try:
                    self._call("POST", "/resume")
                except VllmError as exc:  # not raised: it would hide what happened to the weights
                    self.resume_error = str(exc)
                    log.error("vLLM did not resume generation after a weight update: %s", exc)
                else:
                    self.resume_error = ""

    def _restore(self, previous: int | None, folder: Path | None, cause: VllmError) -> VllmError:
        """After a failed reload the weights may be half new: reload the previous version's file.
        Returns the error to raise; when restoring fails, nothing is reported live."""
        if previous is None or folder is None or not folder.is_dir():
            self._forget()
            return VllmError(f"{cause}; no file of the previous version to restore, vLLM weights unknown",
                             status=cause.status)
        try:
            self._reload(folder, previous)
        except VllmError as exc:
            self._forget()
            return VllmError(f"{cause}; restoring version {previous} failed too ({exc}): vLLM weights unknown",
                             status=cause.status)
        return VllmError(f"{cause}; version {previous} restored", status=cause.status)

    # --- HTTP ------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """One request; the JSON body (None when empty or not JSON); :class:`VllmError` otherwise."""
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=self._http.timeout.connect)
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise VllmError(f"{method} {path}: no answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise VllmError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            message = _error_message(response)
            if response.status_code == 404 and "not found" == message.lower():
                message += f" (the endpoint is missing: {_NEEDS[self.mode]})"
            raise VllmError(f"{method} {path}: HTTP {response.status_code}: {message}", status=response.status_code)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return None  # e.g. the LoRA endpoints answer plain text on success


def _holds(folder: Path, sha256: str) -> bool:
    """Whether ``folder`` (left by an earlier attempt or process) holds weights hashing to ``sha256``."""
    try:
        return folder.is_dir() and files_digest(weight_files(folder))[0] == sha256
    except Exception as exc:  # unreadable leftovers: rebuilt
        log.warning("rebuilding %s: %s", folder, exc)
        return False


def _error_message(response: httpx.Response) -> str:
    """The message of vLLM's error bodies: ``{"error": {"message": ...}}`` (current),
    ``{"message": ...}`` (older ErrorResponse) or FastAPI's ``{"detail": ...}``."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:500]
