"""flywheel/health.py: the heartbeat file and its check, on a temporary data dir."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from flywheel.health import Beat, check, health_path, host_name

pytestmark = pytest.mark.unit


@pytest.fixture
def settings(tmp_path):
    return SimpleNamespace(data_dir=str(tmp_path / "data"))


def test_a_beat_writes_this_hosts_file_and_check_reads_it(settings):
    path = health_path(settings, "ingest")
    assert check(settings, "ingest", 5) == (False, f"no ingest heartbeat on this host ({path}): not started yet, or stopped")
    beat = Beat(settings, "ingest")
    assert beat.beat()
    path = health_path(settings, "ingest")
    assert path.name == f"ingest-{host_name()}.json"
    body = json.loads(path.read_text())
    assert body["pid"] == os.getpid() and body["role"] == "ingest" and abs(body["ts"] - time.time()) < 5
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the temporary file was renamed
    ok, message = check(settings, "ingest", 5)
    assert ok and f"pid {os.getpid()}" in message
    assert not check(settings, "rewards", 5)[0]  # roles never read each other's beats


def test_beats_are_at_most_once_a_second(settings):
    beat = Beat(settings, "rewards")
    assert beat.beat()
    first = health_path(settings, "rewards").read_text()
    assert [beat.beat() for _ in range(100)] == [False] * 100
    assert health_path(settings, "rewards").read_text() == first
    beat._last -= 1.0  # a second later
    assert beat.beat()


def test_an_old_beat_is_unhealthy(settings):
    Beat(settings, "trainer").beat()
    path = health_path(settings, "trainer")
    path.write_text(json.dumps({**json.loads(path.read_text()), "ts": time.time() - 30}))
    ok, message = check(settings, "trainer", 10)
    assert not ok and "last beat 30" in message and "more than 10s" in message
    assert check(settings, "trainer", 60)[0]


def test_a_fresh_beat_of_a_dead_process_is_unhealthy(settings):
    Beat(settings, "rollout").beat()
    path = health_path(settings, "rollout")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": dead.pid}))
    ok, message = check(settings, "rollout", 60)
    assert not ok and f"pid {dead.pid}) is not running" in message


def test_an_unreadable_beat_is_unhealthy(settings):
    path = health_path(settings, "ingest")
    path.parent.mkdir(parents=True)
    path.write_text("{half")
    ok, message = check(settings, "ingest", 60)
    assert not ok and message.startswith("unreadable ingest heartbeat")


def test_a_beat_that_cannot_be_written_never_fails_the_worker(tmp_path, caplog):
    (tmp_path / "data").write_text("a file where the data dir should be")
    beat = Beat(SimpleNamespace(data_dir=str(tmp_path / "data")), "ingest", min_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="flywheel.health"):
        assert [beat.beat() for _ in range(3)] == [False] * 3
    assert len(caplog.records) == 1 and "health checks will fail" in caplog.records[0].message


def test_a_clean_stop_removes_the_file(settings):
    beat = Beat(settings, "ingest")
    beat.beat()
    beat.close()
    assert not health_path(settings, "ingest").exists()
    beat.close()  # twice is fine
