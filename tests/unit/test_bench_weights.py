"""A tiny run of ``bench.weights``: real Adam pairs, every reported key, bit-exact deltas, the
compressed anchor and the chain average it gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import weights

pytestmark = pytest.mark.unit


def test_bench_weights_smoke(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    weights.main(["--hidden", "64", "--layers", "1", "--vocab", "256", "--lrs", "1e-5", "--gaps", "1", "2",
                  "--warmup", "2", "--batch", "2", "--seq", "16", "--repeats", "1", "--full-every", "10", "--json", str(out)])
    pairs = json.loads(out.read_text())["pairs"]
    assert len(pairs) == 2
    for row in pairs:
        assert row["bit_exact"] is True
        assert 0 < row["fraction_changed"] < 1
        assert 0 < row["flywheel_pct"] < row["xor_zstd_pct"]
        assert row["floor_pct"] > 0 and row["encode_gbps"] > 0 and row["decode_gbps"] > 0
        assert row["bytes_per_changed"] == pytest.approx(
            row["flywheel_bytes"] / (row["fraction_changed"] * row["elements"]))
        assert 40 < row["anchor_pct"] < 80  # a bf16 state: exponents compress, sign + mantissa do not
        assert row["anchor_exact"] is True and row["anchor_encode_gbps"] > 0 and row["anchor_decode_gbps"] > 0
        every = row["full_every"]
        assert every == 10
        assert row["chain_pct"] == pytest.approx(
            (row["anchor_pct"] + (every - 1) * row["flywheel_pct"]) / every)
