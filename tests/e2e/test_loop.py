"""The whole loop on the quick tiny model: every role in its own process, simulated users over HTTP.

What must hold after a short run: every answer a user received was captured and persisted exactly
once, every generation names a registered version, and the trainer's versions reached the node as
small deltas whose sha256 the node verified.
"""

import json
import threading

import pytest

from demo.run import DemoOptions, run_demo
from flywheel.settings import load_settings

pytestmark = pytest.mark.e2e


def test_demo_loop_ships_verified_deltas_and_loses_nothing(tmp_path, tiny_model_dir):
    settings = load_settings(
        data_dir=str(tmp_path / "data"),
        model={"path": str(tiny_model_dir)},
        trainer={"batch_size": 16},
    )
    out = tmp_path / "summary.json"
    options = DemoOptions(quick=True, minutes=0.6, users=4, json_path=str(out), plot_path=str(tmp_path / "plot.png"))
    assert run_demo(settings, options, threading.Event()) == 0
    summary = json.loads(out.read_text())

    assert summary["responses_received"] > 50
    assert summary["generations_captured"] == summary["responses_received"]
    assert summary["generations_persisted"] == summary["generations_captured"]
    assert summary["every_generation_names_its_version"]
    deltas = [v for v in summary["versions_shipped"] if v["kind"] == "delta"]
    assert deltas, f"no delta reached the node: {summary['versions_shipped']}"
    assert all(v["verified_on_node"] for v in summary["versions_shipped"])
    assert all(v["bytes"] < 0.1 * v["full_bytes"] for v in deltas)
    assert summary["scored_trajectories"] > 0
    assert (tmp_path / "plot.png").stat().st_size > 10_000
