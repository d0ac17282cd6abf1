"""Liveness of the roles that serve no HTTP (ingest, rewards, trainer, rollout, janitor): heartbeat files.

A worker's main loop calls :meth:`Beat.beat` on every turn. At most once a second that atomically
rewrites ``{data_dir}/health/{role}-{hostname}.json`` with ``{"role", "host", "pid", "ts"}`` and
the worker's counters when it has them (``counters``: ``dead_lettered``, ``scored``, ...) (a
temporary file renamed over the old one, so a reader never sees half a file). A loop that wedges
stops beating, and the file grows old. :func:`check` (``flywheel health ROLE --max-age-s N``, the
container health check in docker-compose.yml) reads this host's file and says whether the role is
alive: the file exists, is younger than ``max_age_s`` and names a process that still runs.

Invariants:
- One file per role and host (container): replicas of a role on a shared data volume never read
  each other's beats. Two processes of one role on one host share the file (either one alive
  reads as alive); ``flywheel up`` runs one process per role.
- Beating never fails the worker: a write error is logged (once until a write succeeds again) and
  the file goes stale, which is what the check should then report.
- ``max_age_s`` is the caller's statement of the loop's longest legitimate pause; this module
  knows nothing about the loops. A clean stop (:meth:`Beat.close`) removes the file.

Standard library only: the health check runs every few seconds and must start quickly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("flywheel.health")

#: The roles that beat; the others (gateway, node) answer ``GET /health`` instead.
ROLES = ("ingest", "rewards", "trainer", "rollout", "janitor")
#: Beats closer together than this are skipped (the file is rewritten at most once a second).
MIN_INTERVAL_S = 1.0


def host_name() -> str:
    """This host's name as a file-name part (a container's hostname is its id)."""
    name = socket.gethostname() or "localhost"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def health_path(settings: Any, role: str, host: str | None = None) -> Path:
    """``{data_dir}/health/{role}-{host}.json``; ``settings`` is a :class:`flywheel.settings.Settings`."""
    return Path(settings.data_dir) / "health" / f"{role}-{host or host_name()}.json"


class Beat:
    """A role's heartbeat file; call :meth:`beat` from every turn of the role's main loop."""

    def __init__(self, settings: Any, role: str, min_interval_s: float = MIN_INTERVAL_S,
                 counters: Mapping[str, int] | None = None) -> None:
        self.role = role
        #: The worker's live counters (``dead_lettered`` among them), written with every beat.
        self.counters = counters
        self.path = health_path(settings, role)
        self.min_interval_s = min_interval_s
        self._last = float("-inf")  # monotonic time of the last write
        self._failing = False

    def beat(self) -> bool:
        """Rewrite the heartbeat file unless one was written less than ``min_interval_s`` ago;
        returns whether it wrote."""
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return False
        self._last = now
        beat: dict[str, Any] = {"role": self.role, "host": host_name(), "pid": os.getpid(), "ts": time.time()}
        if self.counters is not None:
            beat["counters"] = dict(self.counters)
        body = json.dumps(beat)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            if not self._failing:
                log.warning("cannot write the %s heartbeat %s (health checks will fail): %s", self.role, self.path, exc)
            self._failing = True
            return False
        if self._failing:
            log.info("writing the %s heartbeat %s again", self.role, self.path)
        self._failing = False
        return True

    def close(self) -> None:
        """A clean stop: remove the file (a stopped role is not alive)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def check(settings: Any, role: str, max_age_s: float) -> tuple[bool, str]:
    """Whether ``role`` beats on this host: ``(ok, one-line reason)``."""
    path = health_path(settings, role)
    try:
        beat = json.loads(path.read_text())
        pid, ts = int(beat["pid"]), float(beat["ts"])
    except FileNotFoundError:
        return False, f"no {role} heartbeat on this host ({path}): not started yet, or stopped"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"unreadable {role} heartbeat {path}: {exc}"
    age = max(0.0, time.time() - ts)
    if age > max_age_s:
        return False, (f"{role} (pid {pid}) last beat {age:.1f}s ago, more than {max_age_s:g}s: "
                       f"its loop is stuck or it stopped")
    if _gone(pid):
        return False, f"{role} (pid {pid}) is not running (last beat {age:.1f}s ago)"
    counters = beat.get("counters") or {}
    figures = "".join(f", {name} {counters[name]}" for name in sorted(counters))
    return True, f"{role} (pid {pid}) beat {age:.1f}s ago{figures}"
