"""A tiny run of ``bench.weights_files``: the commands on real files, every reported key and a
byte-identical rebuild."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import weights_files

pytestmark = pytest.mark.unit


def test_bench_weights_files_smoke(tmp_path: Path) -> None:
    out = tmp_path / "wf.json"
    weights_files.main(["--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "256",
                        "--repeats", "1", "--no-baseline", "--dir", str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["bit_exact"] is True
    assert 0.005 < result["fraction_changed"] < 0.05 and 0 < result["delta_pct"] < 5
    assert set(result["rows"]) == {"control read+hash", "control write", "control write + fsync", "control direct write",
                                   "control imports", "streaming diff", "streaming apply", "apply --buffered", "node apply",
                                   "node from anchor"}  # the in-memory rows: another five seconds, same code
    for label, row in result["rows"].items():
        assert row["wall_s"] > 0 and row["peak_rss"] > 0 and row["gbps"] > 0
        assert ("work_gbps" in row) != label.startswith("control")
    assert list(tmp_path.iterdir()) == [out]  # the files went with their temp folder
