"""``bench.trainer``: a tiny run of the async and control loops (every role in its own process, the
quick tiny model, 12 s of traffic each), and the time-to-target search on hand-made figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import trainer as bench

pytestmark = pytest.mark.integration


def test_bench_trainer_async_and_control(tiny_model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "trainer.json", tmp_path / "trainer.png"
    bench.main(["--runs", "async,control", "--minutes", "0.2", "--users", "16", "--latency", "0.1",
                "--target", "0.5", "--eval-points", "3", "--heldout-n", "64", "--model", str(tiny_model_dir),
                "--data-dir", str(tmp_path / "runs"), "--json", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())

    assert result["target_success"] == 0.5 and result["simulated_latency_s"] == 0.1
    assert result["sync_time_to_target_s"] is None and result["sync_final_success"] is None  # not run
    assert result["async_time_to_target_s"] is None or isinstance(result["async_time_to_target_s"], float)
    assert set(result["runs"]) == {"async", "control"}
    for name in ("async", "control"):
        run = result["runs"][name]
        assert result[f"{name}_final_success"] == run["final_success"]
        assert 0.0 <= run["final_success"] <= 1.0
        assert run["trainer_mode"] == "async" and run["answers"] > 100
        assert run["versions_published"] >= 1 and run["samples_trained"] > 0, run
        live = run["live_versions"]
        assert live[0] == {"version": 0, "live_at_s": 0.0, "heldout": run["heldout_start"]}
        assert [v["version"] for v in live] == sorted(v["version"] for v in live)
        assert [v["live_at_s"] for v in live] == sorted(v["live_at_s"] for v in live)
        assert live[-1]["live_at_s"] <= run["traffic_s"] + 5
        evaluated = [v for v in live if v["heldout"] is not None]
        assert all(0.0 <= v["heldout"] <= 1.0 for v in evaluated) and live[-1] in evaluated
        # Time to target: when the first evaluated live version at or above the target went live.
        first = next((v for v in evaluated if v["heldout"] >= 0.5), None)
        assert run["time_to_target_s"] == (first["live_at_s"] if first else None)
        served = run["served_success_10s"]
        assert 0 < sum(n for _, _, n in served) <= run["answers"] and all(0 <= x <= 1 for _, x, _ in served)
        if run["staleness"]:  # the trainer records it: every trained sample is counted once
            assert sum(run["staleness"].values()) == run["samples_trained"]
            assert all(0 <= int(k) <= 8 for k in run["staleness"])  # the demo's max_staleness
    assert result["async_time_to_target_s"] == result["runs"]["async"]["time_to_target_s"]

    # The async trainer changed the weights; the lr-0 control published versions that are all the
    # base model's weights, so every one of them has the base model's held-out figure exactly.
    assert result["runs"]["async"]["distinct_weights"] > 1
    control = result["runs"]["control"]
    assert control["distinct_weights"] == 1
    assert {v["heldout"] for v in control["live_versions"] if v["heldout"] is not None} == {control["heldout_start"]}
    assert result["control_final_success"] == control["heldout_start"]
    assert png.stat().st_size > 20_000


def test_time_to_target_bisects_to_the_first_crossing() -> None:
    success = {v: 0.3 + 0.02 * v for v in range(0, 40, 2)}  # live versions 0, 2, ..., 38; >= 0.6 from v16
    live = [bench.LiveVersion(v, f"sha-{v}", float(v)) for v in success]
    run = bench.RunResult("async", "async", 2e-5, 40.0, live, versions=[])
    asked: list[int] = []

    def evaluate(version: int) -> float:
        asked.append(version)
        return success[version]

    bench.evaluate_live(run, evaluate, target=0.6, points=4)
    assert bench.time_to_target(run, 0.6) == 16.0 and bench.final_success(run) == success[38]
    assert len(asked) == len(set(asked)) < len(live) // 2  # evaluated once each, far from all of them

    # Versions with the same weights are evaluated once; a target never reached has no time.
    same = [bench.LiveVersion(v, "base", float(v)) for v in range(5)]
    run = bench.RunResult("control", "async", 0.0, 5.0, same, versions=[])
    asked.clear()
    bench.evaluate_live(run, lambda v: asked.append(v) or 0.4, target=0.6, points=5)
    assert asked == [0] and bench.time_to_target(run, 0.6) is None
    assert [lv.heldout for lv in same] == [0.4] * 5
