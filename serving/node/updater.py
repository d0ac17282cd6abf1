"""Keeps a node on the registry's stable version: poll, load the chain, verify, swap, report.

``Updater(engine, registry, settings, session_factory=..., live=...)``:
- :meth:`check_once` reads ``registry.latest("stable")``; when it differs from what the engine
  serves (newer, or older after a rollback) it makes it live: at once when the engine still holds
  it, else through :meth:`update_to`. It then preloads the newest ``canary`` version, if any,
  without making it live (needs ``node.keep_versions >= 2``), so canary sessions find it here.
- :meth:`update_to` has the engine load the version (``engine.load_from(registry, version)``), which
  applies deltas from the version the node already has and verifies the sha256 of every
  reconstructed step, then swaps it in between batches (the built-in engine: ``registry.load`` into
  memory; a vLLM node in full mode: file to file, :mod:`flywheel.weights.files`).

Invariants:
- On any failure (missing blob, corrupt delta, hash mismatch, shape mismatch) the engine keeps
  serving what it had; the node's status becomes ``failed_update`` with the reason, and the poll
  loop does not retry that version while it keeps the status it had then (retrying a damaged
  object every poll would only repeat the failure). It retries once the version's status changed
  after the failure: a version rolled back for a failed load, repaired and cleared
  (``flywheel rollout clear``) and then made canary or stable again loads without a node restart.
  An admin ``update_to`` retries at once; a success clears the failure.
- The node's row in ``nodes`` (live version, status, detail, last heartbeat) and its live-state
  heartbeat (also ``versions``: the versions held, ``url``: where the gateway reaches the node,
  and for an engine that serves each version under its own model name, a vLLM server in LoRA
  mode, ``model_names``: ``{"<version>": "<model>"}`` for every version held, the ``model`` the
  gateway must send; ``sampling_defaults``: what the engine applies where a request is silent,
  ``flywheel.sampling.node_defaults``) are refreshed on every change and at least every ``db_heartbeat_s`` (the
  heartbeat on every poll).
- Built with ``announce=False`` (a node's entry point) the updater reports nothing, neither the
  live heartbeat nor the row, until :meth:`announce`: a node is announced only once its HTTP port
  listens and it holds a loaded version, so the gateway never sends a request to a port that
  refuses it.
- One update at a time: the poll thread and the admin endpoint share a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from flywheel.db.models import Node
from flywheel.events import utcnow
from flywheel.sampling import node_defaults
from flywheel.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateOutcome:
    ok: bool
    changed: bool
    version: int | None
    detail: str = ""


class Updater:
    def __init__(
        self,
        engine: Any,
        registry: Any,
        settings: Settings,
        *,
        session_factory: Any = None,
        live: Any = None,
        url: str = "",
        db_heartbeat_s: float = 10.0,
        announce: bool = True,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.settings = settings
        self.session_factory = session_factory
        self.live = live
        self.url = url or node_url(settings)
        self.db_heartbeat_s = db_heartbeat_s
        #: Whether the node reports itself yet (:meth:`announce`).
        self.announced = announce
        #: What the engine applies where a request is silent (its heartbeat carries them).
        self.sampling_defaults = node_defaults(settings)
        self.status = "serving"
        self.detail = ""
        self.updates = 0
        #: Versions the poll loop does not retry, and how many status changes each had when it
        #: failed (:meth:`_retry_due`: counted, not timed, so no clock is compared across machines).
        self._failed: dict[int, int] = {}
        self._lock = threading.Lock()
        self._last_db_heartbeat = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._kick = threading.Event()  # set by a version notification (or stop): poll now
        self._unlisten: Any = None

    # One step ----------------------------------------------------------------------------------

    def check_once(self) -> UpdateOutcome:
        """Follow the registry's stable version once, then preload its canary."""
        stable = self.registry.latest("stable")
        current, _ = self.engine.current()
        if stable is None or stable.version == current:
            outcome = UpdateOutcome(True, False, current)
        elif stable.version in self._failed and not self._retry_due(stable.version):
            outcome = UpdateOutcome(False, False, current, self.detail)
        else:
            outcome = self.update_to(stable.version)
        canary = self.registry.latest("canary") if outcome.ok and self.engine.keep_versions > 1 else None
        if (canary is not None and not self.engine.holds(canary.version)
                and (canary.version not in self._failed or self._retry_due(canary.version))):
            self.update_to(canary.version, live=False)
        self._report()
        return outcome

    def _retry_due(self, version: int) -> bool:
        """True when ``version``'s status changed after it failed here (module docstring): one
        look at its audit log, only while a failed version is stable or canary."""
        return len(self.registry.transitions(version)) > self._failed[version]

    def _changes(self, version: int) -> int:
        try:
            return len(self.registry.transitions(version))
        except Exception:  # the registry is unreachable too (likely why the load failed): retry next poll
            log.warning("cannot read the status changes of version %s", version, exc_info=True)
            return 0

    def update_to(self, version: int, *, live: bool = True) -> UpdateOutcome:
        """Make ``version`` live (``live=False``: only hold it), loading it unless the engine holds
        it already; on failure keep serving the current one."""
        with self._lock:
            current, _ = self.engine.current()
            if version == current or (not live and self.engine.holds(version)):
                self._failed.pop(version, None)
                self._set("serving", "")
                return UpdateOutcome(True, False, current)
            if live and self.engine.activate(version):
                self._failed.pop(version, None)
                self.updates += 1
                self._set("serving", f"updated {current} -> {version} (already held)")
                return UpdateOutcome(True, True, version, self.detail)
            self._set("updating", f"loading version {version}")
            started = time.perf_counter()
            try:
                self.engine.load_from(self.registry, version, live=live)
            except Exception as exc:  # keep serving what we have; report why
                reason = f"version {version}: {type(exc).__name__}: {exc}"
                log.error("weight update failed, still serving version %s: %s", current, reason)
                self._failed[version] = self._changes(version)
                self._set("failed_update", reason)
                return UpdateOutcome(False, False, current, reason)
            self._failed.pop(version, None)
            took = time.perf_counter() - started
            if not live:
                self._set("serving", f"holding version {version} beside {current} (loaded in {took:.2f}s)")
                return UpdateOutcome(True, False, current, self.detail)
            self.updates += 1
            self._set("serving", f"updated {current} -> {version} in {took:.2f}s")
            return UpdateOutcome(True, True, version, self.detail)

    # Background loop ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        if self.live is not None:
            self._unlisten = self.live.listen(version_channel(self.settings.model.line), self._kick)
        self._thread = threading.Thread(target=self._loop, name="weight-updater", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # the registry or database is unreachable: retried on the next poll
                log.exception("updater poll failed; retrying in %.1fs", self.settings.node.poll_s)
            self._kick.wait(self.settings.node.poll_s)
            self._kick.clear()

    # Reporting ---------------------------------------------------------------------------------

    def announce(self) -> None:
        """Start reporting: the node listens and holds a loaded version. The poll thread, when
        running, sends the first heartbeat at once (one reporter at a time); else it is sent here."""
        self.announced = True
        if self._thread is not None:
            self._kick.set()
        else:
            self._report(force=True)

    def _set(self, status: str, detail: str) -> None:
        changed = (status, detail) != (self.status, self.detail)
        self.status, self.detail = status, detail
        self._report(force=changed)

    def _report(self, force: bool = False) -> None:
        if not self.announced:
            return
        version, sha = self.engine.current()
        node = self.settings.node
        if self.live is not None:
            payload = {
                "node_id": node.node_id,
                "region": node.region,
                "url": self.url,
                "model_line": self.settings.model.line,
                "live_version": version,
                "versions": self.engine.versions(),
                "sha256": sha,
                "status": self.status,
                "detail": self.detail,
            }
            if self.sampling_defaults:
                payload["sampling_defaults"] = self.sampling_defaults
            names = self.engine.model_names() if hasattr(self.engine, "model_names") else None
            if names is not None:
                payload["model_names"] = {str(v): name for v, name in names.items()}
            self.live.heartbeat(node.node_id, payload, ttl_s=max(5.0, 3 * node.poll_s))
        now = time.monotonic()
        if self.session_factory is None or (not force and now - self._last_db_heartbeat < self.db_heartbeat_s):
            return
        self._last_db_heartbeat = now
        with self.session_factory() as session:
            session.merge(
                Node(
                    node_id=node.node_id,
                    region=node.region,
                    url=self.url,
                    model_line=self.settings.model.line,
                    live_version=version,
                    status=self.status,
                    detail=self.detail[:2000],
                    last_heartbeat=utcnow(),
                )
            )
            session.commit()


def version_channel(model_line: str) -> str:
    """The live-state channel a version change of ``model_line`` is announced on (see
    ``flywheel.live``): nodes listening there look at the registry at once instead of at their
    next poll."""
    return f"versions:{model_line}"


def node_url(settings: Settings) -> str:
    """Where the gateway reaches this node: ``node.url``, else ``http://host:port``."""
    return (settings.node.url or f"http://{settings.node.host}:{settings.node.port}").rstrip("/")
