"""``flywheel health`` against a real worker: a ``python -m launch.cli ingest`` process on embedded
defaults (local log bus, SQLite) in a temporary data dir, the command line the container health
checks in docker-compose.yml run.

Unhealthy before the worker starts, healthy once its loop beats, unhealthy while it is frozen
(SIGSTOP) for longer than ``--max-age-s``, healthy again when it resumes, and unhealthy at once
after a SIGKILL, even for a bound its last beat is within (its process is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.health import check
from flywheel.settings import load_settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAX_AGE_S = 2.0


def wait_for(what: str, condition, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_health_follows_a_real_ingest_worker(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(PYTHONPATH=str(REPO), FLYWHEEL_DATA_DIR=str(tmp_path / "data"), FLYWHEEL_LOG_LEVEL="INFO")
    settings = load_settings(None, data_dir=str(tmp_path / "data"))

    def health(max_age_s: float = MAX_AGE_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "launch.cli", "health", "ingest", "--max-age-s", str(max_age_s)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=30)

    def healthy() -> bool:
        return check(settings, "ingest", MAX_AGE_S)[0]

    before = health()
    assert before.returncode == 1 and "no ingest heartbeat on this host" in before.stderr

    log = tmp_path / "ingest.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "ingest"], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for("the first beat", healthy, 60, proc, log)
        running = health()
        assert running.returncode == 0, running.stderr
        assert f"ingest (pid {proc.pid}) beat" in running.stdout

        proc.send_signal(signal.SIGSTOP)  # a wedged loop: the process lives, its loop does not turn
        wait_for("the frozen worker's beat to age", lambda: not healthy(), MAX_AGE_S + 5)
        frozen = health()
        assert frozen.returncode == 1
        assert f"ingest (pid {proc.pid}) last beat" in frozen.stderr and "its loop is stuck" in frozen.stderr
        assert len(frozen.stderr.strip().splitlines()) == 1

        proc.send_signal(signal.SIGCONT)
        wait_for("the resumed worker to beat again", healthy, 10, proc, log)

        proc.kill()
        proc.wait(timeout=10)
        killed = health(max_age_s=60)  # its last beat is fresh enough: the dead process gives it away
        assert killed.returncode == 1 and f"ingest (pid {proc.pid}) is not running" in killed.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=10)
