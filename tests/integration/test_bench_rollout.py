"""A small run of ``bench.rollout``: two real nodes in two regions move to a new delta version, and
each region pulls it from the origin once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import rollout

pytestmark = pytest.mark.integration


def test_bench_rollout_smoke(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    rollout.main(["--nodes", "2", "--regions", "2", "--poll", "0.2", "--model-cache", str(tiny_model_dir.parent),
                  "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "delta" and 0.01 < result["fraction_changed"] < 0.03
    assert 0 < result["publish_to_all_nodes_s"] < 60 and result["live"] == "redis"  # the suite has Redis
    # Each of the two regions pulled the delta once; nothing else crossed.
    assert result["cross_region_bytes"] == 2 * result["delta_bytes"]
    assert result["full_checkpoint_bytes"] == 2 * result["full_bytes"] > 20 * result["cross_region_bytes"]
