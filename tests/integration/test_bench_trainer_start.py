"""``bench.trainer_start`` on a deep, narrow Llama: a torchrun trainer's other ranks start without
the model, holding their shard and one tensor at a time; reading their own rows of the files, every
rank does, rank 0 included; and every way ends with the same shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import trainer_start

pytestmark = pytest.mark.integration


def test_only_rank_0_reads_the_model_and_the_shards_are_the_same(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    trainer_start.main(["--size", "deep", "--json", str(out)])  # raises when the shards differ
    result = json.loads(out.read_text())
    every, rank0, rows = (result["rows"][mode] for mode in trainer_start.MODES)
    assert every[1]["shards"] == rank0[1]["shards"] == rows[1]["shards"]
    # Rank 1 never holds more than its shard and a 1.5 MB tensor beyond what it keeps (~3 MB in
    # practice); reading the 296 MB model on every rank took it 220 MB above.
    assert rank0[1]["peak_mb"] - rank0[1]["after_mb"] < 0.25 * result["fp32_mb"], rank0
    assert every[1]["peak_mb"] - every[1]["after_mb"] > 0.5 * result["fp32_mb"], every
    # Each rank reading its own rows of the files: rank 0 too stays near its shard, where reading
    # the model took it over half the model above.
    assert rank0[0]["peak_mb"] - rank0[0]["after_mb"] > 0.5 * result["fp32_mb"], rank0
    for r in rows:
        assert r["peak_mb"] - r["after_mb"] < 0.25 * result["fp32_mb"], rows
