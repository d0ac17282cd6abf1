"""``bench.delta_context``: the ideal code length is the Krichevsky-Trofimov one, the receiver's
context follows the chain, and a tiny run gives every row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import delta_context
from bench.delta_context import Context, kt_bits

pytestmark = pytest.mark.unit


def test_kt_bits_is_the_adaptive_coders_code_length() -> None:
    # One binary symbol: p = 1/2. Two equal ones: 1/2 * 3/4. "0 then 1": 1/2 * 1/4.
    assert kt_bits(np.array([[1, 0]])) == pytest.approx(1.0)
    assert kt_bits(np.array([[2, 0]])) == pytest.approx(-math.log2(3 / 8))
    assert kt_bits(np.array([[1, 1]])) == pytest.approx(-math.log2(1 / 8))
    # Contexts add up; an empty context costs nothing; four symbols: the first costs 2 bits.
    assert kt_bits(np.array([[2, 0], [0, 0], [1, 1]])) == pytest.approx(-math.log2(3 / 8) - math.log2(1 / 8))
    assert kt_bits(np.array([[0, 1, 0, 0]])) == pytest.approx(2.0)
    # Skewed counts cost about n * H(p) plus the model's learning cost (~log2(n) / 2 per parameter).
    n, k = 100_000, 2_000
    entropy = n * -(k / n * math.log2(k / n) + (1 - k / n) * math.log2(1 - k / n))
    assert entropy < kt_bits(np.array([[n - k, k]])) < entropy + math.log2(n)


def test_the_context_knows_each_elements_last_change() -> None:
    bf = lambda *v: {"w": torch.tensor(v, dtype=torch.bfloat16)}  # noqa: E731
    states = [bf(1.0, 1.0, 1.0), bf(1.0078125, 1.0, 1.0), bf(1.0078125, 0.99609375, 1.0), bf(1.0078125, 0.99609375, 1.0)]
    context = Context(states[0])
    for old, new in zip(states, states[1:]):
        context.advance(old, new)
    assert context.age["w"][:2].tolist() == [3, 2] and context.age["w"][2] > 1 << 20  # never changed
    assert context.direction["w"].tolist() == [1, -1, 0]
    assert context.recent("w").tolist() == [1, 1, 0]


def test_bench_delta_context_smoke(tmp_path: Path) -> None:
    out = tmp_path / "dc.json"
    delta_context.main(["--hidden", "64", "--layers", "1", "--vocab", "256", "--lr", "1e-4", "--history", "2",
                        "--deltas", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    labels = [row["label"] for row in report["rows"]]
    assert labels == ["today's codec"] + [label for label, *_ in delta_context.ROWS]
    assert 0 < report["fraction_changed"] < 1 and 0 < report["anchor_pct"] < 100
    today, ideal = report["rows"][0], report["rows"][1]
    assert ideal["bytes_per_changed"] == pytest.approx(today["bytes_per_changed"])  # the projection's baseline
    for row in report["rows"][1:]:
        assert row["ideal_bits"] == pytest.approx(row["position_bits"] + row["sign_bits"] + row["magnitude_bits"])
        assert 0 < row["bytes_per_changed"] and 0 < row["chain_pct"] < 100
