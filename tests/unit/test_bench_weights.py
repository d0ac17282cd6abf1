"""A tiny run of ``bench.weights``: real Adam pairs, every reported key, bit-exact deltas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import weights

pytestmark = pytest.mark.unit


def test_bench_weights_smoke(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    weights.main(["--hidden", "64", "--layers", "1", "--vocab", "256", "--lrs", "1e-5", "--gaps", "1", "2",
                  "--warmup", "2", "--batch", "2", "--seq", "16", "--repeats", "1", "--json", str(out)])
    pairs = json.loads(out.read_text())["pairs"]
    assert len(pairs) == 2
    for row in pairs:
        assert row["bit_exact"] is True
        assert 0 < row["fraction_changed"] < 1
        assert 0 < row["flywheel_pct"] < row["xor_zstd_pct"]
        assert row["floor_pct"] > 0 and row["encode_gbps"] > 0 and row["decode_gbps"] > 0
