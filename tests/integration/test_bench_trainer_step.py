"""``bench.trainer_step --quick`` in its own process: the reference loop and flywheel's ``train_step``
train the same tokens of the same traffic, each in a fresh process, with the same losses and
gradient norms step by step; every headline figure is there, and the publish stall is measured
with background and inline publishing into a real registry."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"reference_trained_tokens_per_s", "flywheel_trained_tokens_per_s", "reference_peak_bytes", "flywheel_peak_bytes",
        "device", "params", "mfu", "publish_stall_s_per_version", "speedup", "peak_ratio", "settings", "traffic",
        "command", "loops", "publish"}


def test_bench_trainer_step_quick(tmp_path: Path) -> None:
    out = tmp_path / "trainer-step.json"
    proc = subprocess.run([sys.executable, "-m", "bench.trainer_step", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "speed vs ref" in proc.stdout  # the table
    result = json.loads(out.read_text())
    assert KEYS <= result.keys(), KEYS - result.keys()
    assert "--quick" in result["command"] and result["device"].startswith("cpu (") and result["mfu"] is None
    assert 50_000 < result["params"] < 200_000  # the tiny Qwen3-shaped model

    traffic, work = result["traffic"], result["settings"]["workload"]
    assert traffic["samples"] == work["steps"] * work["samples_per_step"]
    assert 20 <= traffic["min_len"] <= traffic["median_len"] <= traffic["p90_len"] <= traffic["max_len"] <= 300
    assert traffic["turns"] > traffic["segments"] >= traffic["samples"]  # multi-turn sessions
    assert 0 < traffic["trainable_tokens"] < traffic["total_tokens"]

    ref, fly = result["loops"]["reference"], result["loops"]["flywheel"]
    for loop in (ref, fly):
        assert loop["steps"] == work["steps"] and loop["traffic"] == traffic
        assert loop["trained_tokens"] == traffic["trainable_tokens"]  # both loops trained every trainable token
        assert loop["trained_tokens_per_s"] > 0 and loop["peak_bytes"] > 0 and loop["wall_s"] > 0
    assert ref["micro_batches"] > work["steps"]  # --quick's 512-token budget: gradient accumulation
    assert 0 < ref["padding_share"] < 1 and ref["padded_tokens"] > traffic["total_tokens"]
    assert result["reference_trained_tokens_per_s"] == ref["trained_tokens_per_s"]
    assert result["flywheel_peak_bytes"] == fly["peak_bytes"]
    assert math.isclose(result["speedup"], fly["trained_tokens_per_s"] / ref["trained_tokens_per_s"])
    assert math.isclose(result["peak_ratio"], fly["peak_bytes"] / ref["peak_bytes"])
    # Same weights, same samples, same loss: the warm-up step and every timed step agree (fp32).
    assert len(ref["losses"]) == len(fly["losses"]) == work["steps"] + 1
    for a, b in [*zip(ref["losses"], fly["losses"]), *zip(ref["grad_norms"], fly["grad_norms"])]:
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6), (ref["losses"], fly["losses"])

    for name in ("background", "inline"):
        run = result["publish"][name]
        assert run["background"] == (name == "background") and run["versions"] == work["steps"]
        assert 0 < run["stall_s_per_version"] and 0 < run["stall_fraction"] <= 1
        assert math.isclose(run["stall_s_per_version"] * run["versions"], sum(run["cut_s"]))
        # Version 0 (the base), the warm-up step's, one per timed step: all written, deltas after the base.
        assert run["last_version"] == run["expected_last_version"] == work["steps"] + 1
        assert [v["version"] for v in run["published"]] == list(range(work["steps"] + 2))
        assert run["published"][0]["kind"] == "full" and run["publisher_versions"] == work["steps"] + 1
    assert result["publish_stall_s_per_version"] == result["publish"]["background"]["stall_s_per_version"]
    assert result["publish_inline_stall_s_per_version"] == result["publish"]["inline"]["stall_s_per_version"]
    # Inline, submit does the whole write; in the background it returns once the point is queued.
    assert result["publish"]["inline"]["submit_s_per_version"] > result["publish"]["background"]["submit_s_per_version"]
