"""A tiny run of ``bench.retention`` on the suite's broker and PostgreSQL: the rows are loaded, the
job deletes exactly the expired ones beside the real ingest and rewards processes, and both runs'
latencies and their ratio are reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import retention

pytestmark = pytest.mark.integration


def test_bench_retention_smoke(kafka_bootstrap: str, pg_admin, tmp_path: Path) -> None:
    out = tmp_path / "retention.json"
    retention.main([
        "--rows", "20000", "--rate", "100", "--seconds", "3", "--warmup", "0", "--drain", "30", "--batch", "500",
        "--bootstrap", kafka_bootstrap, "--pg-admin", pg_admin.url.render_as_string(hide_password=False),
        "--env", "FLYWHEEL_INGEST__INACTIVITY_TIMEOUT_S=5", "--json", str(out),
    ])
    result = json.loads(out.read_text())
    seeded = result["with_job"]["seed"]
    assert seeded["raw_events"] == 20000 and result["baseline"]["seed"]["raw_events"] == 20000
    job = result["with_job"]["job"]
    assert job["deleted"]["generations"] + job["deleted"]["feedback"] == seeded["expired_raw_events"]
    assert job["deleted"]["sessions"] == seeded["expired_raw_events"] // retention.PER_SESSION
    assert result["rows_per_s"] == job["rows_per_s"] > 0 and result["deleted"] == job["rows"]
    for run in ("baseline", "with_job"):
        latency = result[run]["latency"]
        assert latency["outcomes_measured"] > 0 and not latency["lower_bound"]
    assert result["p99_ratio"] == result["p99_with_job_s"] / result["p99_baseline_s"] > 0
    assert set(result["targets"]) == {"rows_per_s_ge_10000", "p99_ratio_le_1_5"}
