"""Where a benchmark's CPU goes: CPU seconds per process, per role and for the whole machine (Linux
/proc), and ``py-spy`` sampling profiles of the processes it runs, summarised per frame.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backend_pids(admin, database: str) -> list[int]:
    """The PostgreSQL backends serving ``database`` (its CPU is theirs; a remote server shows none)."""
    from sqlalchemy import text

    with admin.connect() as conn:
        return list(conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = :d"), {"d": database})
                    .scalars())


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine, all cores (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds per part: processes by role (``procs``), the PostgreSQL backends ``pg_pids``
    lists, the broker (when its pid is known), this process, and the whole machine."""

    def __init__(self, procs: dict[str, list[subprocess.Popen]], broker_pid: int | None,
                 pg_pids: Callable[[], list[int]]) -> None:
        self.procs, self.broker_pid, self.pg_pids = procs, broker_pid, pg_pids
        self.pg_start = {pid: cpu_seconds(pid) for pid in pg_pids()}
        self.start = self.read()

    def read(self) -> dict[str, float]:
        out = {role: sum(cpu_seconds(p.pid) for p in procs) for role, procs in self.procs.items()}
        if self.broker_pid is not None:
            out["broker"] = cpu_seconds(self.broker_pid)
        out["bench"] = time.process_time()
        out["machine"] = machine_busy_s()
        return out

    def used(self) -> dict[str, float]:
        end = self.read()
        out = {k: max(0.0, end[k] - self.start.get(k, 0.0)) for k in end}
        out["postgres"] = sum(max(0.0, cpu_seconds(pid) - self.pg_start.get(pid, 0.0)) for pid in self.pg_pids())
        return out


class Profiler:
    """``py-spy record`` (raw collapsed stacks) on every process of ``procs`` (by role) until
    :meth:`stop`; nothing when ``out_dir`` is None."""

    def __init__(self, out_dir: Path | None, procs: dict[str, list[subprocess.Popen]]) -> None:
        self.out_dir = out_dir
        self.spies: list[tuple[str, Path, subprocess.Popen]] = []
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        spy = Path(sys.executable).parent / "py-spy"
        for role, role_procs in procs.items():
            for i, proc in enumerate(role_procs):
                path = out_dir / f"{role}-{i}.txt"
                cmd = [str(spy), "record", "--pid", str(proc.pid), "--rate", "200", "--format", "raw",
                       "--output", str(path), "--nonblocking"]
                self.spies.append((role, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                                 stderr=subprocess.DEVNULL)))

    def stop(self) -> dict[str, dict[str, Any]]:
        for _, _, spy in self.spies:
            spy.send_signal(signal.SIGINT)
        for _, _, spy in self.spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
        by_role: dict[str, list[Path]] = {}
        for role, path, _ in self.spies:
            by_role.setdefault(role, []).append(path)
        return {role: summarise_stacks(paths) for role, paths in by_role.items()}


def _frame(raw: str) -> str:
    """``function (path/to/module.py:123)`` -> ``function (module.py)``; lines merged."""
    name, _, where = raw.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = Path(path).parts
    for anchor in ("site-packages", "flywheel", "ingest", "rewards", "lib"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + (1 if anchor in ("site-packages", "lib") else 0):]
            break
    return f"{name} ({'/'.join(parts[-3:])})"


#: Frames on every stack (the entry point, thread start-up): left out of the inclusive ranking.
_ENTRY = ("(<frozen runpy>)", "(launch/cli.py)", "(threading.py)")


def summarise_stacks(paths: list[Path], top: int = 15) -> dict[str, Any]:
    """Inclusive and self sample shares per frame, over the collapsed stacks in ``paths``."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [_frame(f) for f in stack.split(";")]
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                if not frame.endswith(_ENTRY):
                    inclusive[frame] += n
    return {
        "samples": total,
        "inclusive": [(f, n / total) for f, n in inclusive.most_common(top)] if total else [],
        "self": [(f, n / total) for f, n in own.most_common(top)] if total else [],
    }


def profile_lines(profile: dict[str, dict[str, Any]], top: int) -> list[str]:
    """The ``top`` frames of each role's summary, inclusive beside self, as table lines."""
    lines = []
    for role, summary in profile.items():
        lines.append(f"py-spy {role}: {summary['samples']} samples; top inclusive | self")
        pairs = zip(summary["inclusive"][:top], summary["self"][:top])
        lines += [f"  {inc * 100:5.1f}% {fi[:70]:<70} | {own * 100:5.1f}% {fs[:70]}"
                  for (fi, inc), (fs, own) in pairs]
    return lines
