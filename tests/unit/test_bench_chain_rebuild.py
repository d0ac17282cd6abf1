"""A tiny run of ``bench.chain_rebuild``: every row, a pass per version writing a file each, and
the one-pass rebuild restoring ``PASS_BYTES`` after it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chain_rebuild
from flywheel.weights import files
from flywheel.weights.codec import streaming

pytestmark = pytest.mark.unit


def test_bench_chain_rebuild_smoke(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    chain_rebuild.main(["--elements", "400000", "--tensor", "50000", "--behind", "3", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["one pass", "one pass, every step hashed", "a file per version", "control: copy"]
    model = report["model_bytes"]
    for row in ("one pass", "one pass, every step hashed"):
        assert model <= rows[row]["written"] < 1.1 * model  # one file (and the registry's small writes)
    assert 3 * model <= rows["a file per version"]["written"] < 3.3 * model
    assert rows["a file per version"]["vs_per_version"] == 1.0
    assert all(row["wall_s"] > 0 for row in rows.values())
    assert 0 < report["delta_bytes"] < report["model_bytes"]
    assert files.PASS_BYTES == 1 << 30 and files.apply_chain is streaming.apply_chain  # both restored
