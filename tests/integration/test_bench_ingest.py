"""A tiny run of ``bench.ingest`` on the suite's broker and PostgreSQL: the real ingest and rewards
processes score every session of the backlog and of the paced phase, and every figure is reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import ingest

pytestmark = pytest.mark.integration


def test_bench_ingest_smoke(kafka_bootstrap: str, pg_admin, tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    ingest.main([
        "--events", "1200", "--levels", "1:1", "--rate", "100", "--seconds", "2", "--warmup", "0", "--drain", "30",
        "--bootstrap", kafka_bootstrap, "--pg-admin", pg_admin.url.render_as_string(hide_password=False),
        "--env", "FLYWHEEL_INGEST__INACTIVITY_TIMEOUT_S=5", "--json", str(out),
    ])
    result = json.loads(out.read_text())
    assert result["raw_both"]["records"] == result["events"] >= 1200
    assert result["raw_generations"]["records"] < result["events"] and len(result["raw_generations"]["rates"]) == 3
    assert result["raw_rate"] == result["raw_generations"]["rate"] > 0 and result["raw_both_rate"] > 0
    [row] = result["pipeline"]
    assert row["complete"] and row["scored_sessions"] == row["sessions"] == result["sessions"]
    assert row["raw_rows"] == result["events"] and row["trajectories"] >= row["sessions"]
    assert result["pipeline_rate"] == row["rate"] > 0
    assert set(row["cpu_ms_per_1k_events"]) >= {"ingest", "rewards", "postgres", "machine"}
    assert all(code == 0 for codes in row["exit_codes"].values() for code in codes)
    latency = result["latency"]
    assert latency["outcomes_measured"] > 0 and latency["outcomes_scored"] == latency["outcomes_measured"]
    assert not latency["lower_bound"]
    assert 0 < latency["p50_event_to_scored_s"] <= result["p99_event_to_scored_s"] < 30
    assert math.isfinite(latency["p99_event_to_trajectory_s"])
