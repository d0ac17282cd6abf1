"""What the chain's earlier deltas could save a delta: ideal code lengths under richer contexts.

A receiver that applies version t's delta already holds version t-1's and those before it. This
bench measures, on a real Adam chain, how many bits the changed elements of a delta would cost an
ideal adaptive coder under each context a new format could use, beside today's codec on the same
deltas, so that a format built on them is chosen on measured figures, not estimates.

It trains the small Llama of :mod:`bench.weights` with Adam (fp32 master, bf16 exports) for
``--warmup`` steps, then exports ``--history + --deltas + 1`` consecutive versions. The first
``--history`` deltas only build the context; each of the last ``--deltas`` is measured. Per
tensor, every element of the old value gets:

- its **class** as today's codec picks it (:func:`.classes.choose_thresholds`: up to three ranges
  of exponents), or its **exponent** (one class per exponent of the old value);
- its **age**: how many versions since it last changed (1, 2, 3-4, 5 or more / not in the
  history), the **direction** of that change, and how many of the last 4 versions changed it.

A changed element costs a position (changed or not, per element), a sign and a magnitude (the
step in ULPs: 1, 2, 3, 4 or more; an escape's extra bits are the same in every row and left
out). Each is coded with a Krichevsky-Trofimov estimator per context per tensor: the code length
of an ideal adaptive arithmetic coder that learns each context's frequencies as it goes
(``log2`` of the Dirichlet-1/2 marginal likelihood; independent of the order of the elements),
so model cost is included. The rows:

- ``today's codec``: ``encode_delta``'s bytes per changed element, measured;
- ``today's contexts, ideal``: positions and magnitudes per class as today's codec splits them
  (its magnitude fields are zstd-coded in class order), a raw sign bit;
- ``+ one class per exponent`` (positions and magnitudes; still no chain: the receiver has the
  old value); ``+ age of the last change`` (positions and magnitudes by exponent x age);
  ``+ its direction for the sign`` (same way or not, per age, where there was a change);
  ``+ changes in the last 4 versions`` (positions by exponent x age x that count).

Each row's ``projected`` bytes per changed element scale today's measured bytes by the row's ideal
bits over today's ideal bits (framing and the coder's own overhead stay what they are today);
``chain`` is the average object per version over ``--full-every`` versions with one compressed
anchor (:func:`.anchor.encode_anchor` of the last version, measured) and deltas like these.
Prints a table; ``--json PATH`` writes it.

    .venv/bin/python -m bench.delta_context --json /tmp/delta-context.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.weights import build_model, export
from flywheel.weights.codec.anchor import encode_anchor
from flywheel.weights.codec.classes import choose_thresholds
from flywheel.weights.codec.delta import encode_delta
from flywheel.weights.codec.stats import count_changed

State = dict[str, torch.Tensor]
#: Age buckets: changed 1, 2, 3-4, 5+ versions ago (or not within the history).
AGES = 4
#: Versions over which an element's changes are counted (``recent``).
WINDOW = 4
_NEVER = 1 << 30


def chain(*, lr: float, versions: int, warmup: int, hidden: int, layers: int, vocab: int, batch: int, seq: int,
          seed: int) -> list[State]:
    """``versions`` consecutive bf16 exports of one Adam run at ``lr``, after ``warmup`` steps."""
    model = build_model(hidden, layers, vocab, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    out: list[State] = []
    for step in range(1, warmup + versions):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= warmup:
            out.append(export(model))
    return out


def kt_bits(counts: np.ndarray) -> float:
    """Code length (bits) of an ideal adaptive coder (Krichevsky-Trofimov) over ``counts``: one row
    per context, one column per symbol."""
    counts = np.asarray(counts, dtype=np.float64)
    counts = counts[counts.sum(axis=1) > 0]
    if counts.size == 0:
        return 0.0
    k = counts.shape[1]
    lg = np.vectorize(math.lgamma)
    nats = (lg(counts.sum(axis=1) + k / 2) - lg(k / 2) + k * math.lgamma(0.5) - lg(counts + 0.5).sum(axis=1)).sum()
    return float(nats / math.log(2))


def _keys(t: torch.Tensor) -> np.ndarray:
    """bf16 bits as order-preserving signed integers (one ULP is a step of one)."""
    bits = t.contiguous().view(torch.int16).numpy().astype(np.int32).reshape(-1)
    return np.where(bits < 0, -(bits & 0x7FFF), bits)


def _counts(context: np.ndarray, symbol: np.ndarray, contexts: int, symbols: int) -> np.ndarray:
    return np.bincount(context * symbols + symbol, minlength=contexts * symbols).reshape(contexts, symbols)


def measure_delta(old: State, new: State, context: Context) -> dict[str, float]:
    """Ideal bits of ``old -> new``'s changed elements per context model (module docstring)."""
    bits: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        bits[key] = bits.get(key, 0.0) + value

    for name, t in old.items():
        a, b = _keys(t), _keys(new[name])
        raw_old = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        raw_new = new[name].contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        changed = (a != b).astype(np.int64)
        exponent = ((raw_old >> 7) & 0xFF).astype(np.int64)
        thresholds, _ = choose_thresholds(raw_old, raw_new, 7)
        magnitude = raw_old & 0x7FFF
        klass = sum(((magnitude >= np.uint16(th)).astype(np.int64) for th in thresholds), np.zeros(a.size, np.int64))
        ages = context.age[name]
        bucket = np.select([ages == 1, ages == 2, ages <= 4], [0, 1, 2], 3).astype(np.int64)
        add("pos_class", kt_bits(_counts(klass, changed, 3, 2)))
        add("pos_exponent", kt_bits(_counts(exponent, changed, 256, 2)))
        add("pos_exponent_age", kt_bits(_counts(exponent * AGES + bucket, changed, 256 * AGES, 2)))
        recent = np.minimum(context.recent(name), WINDOW)
        joint = (exponent * AGES + bucket) * (WINDOW + 1) + recent
        add("pos_exponent_age_recent", kt_bits(_counts(joint, changed, 256 * AGES * (WINDOW + 1), 2)))
        where = changed.astype(bool)
        step = (b - a)[where]
        sign = (step > 0).astype(np.int64)
        before = context.direction[name][where]
        add("sign_raw", float(where.sum()))
        same = (np.sign(step) == before).astype(np.int64)
        had = before != 0  # a change in the history: code "same way or not" per age; else the sign
        add("sign_direction_age", kt_bits(_counts(np.where(had, 1 + bucket[where], 0), np.where(had, same, sign),
                                                  1 + AGES, 2)))
        symbol = np.minimum(np.abs(step), 4) - 1
        add("mag_class", kt_bits(_counts(klass[where], symbol, 3, 4)))
        add("mag_exponent", kt_bits(_counts(exponent[where], symbol, 256, 4)))
        add("mag_exponent_age", kt_bits(_counts(exponent[where] * AGES + bucket[where], symbol, 256 * AGES, 4)))
        add("changed", float(where.sum()))
    return bits


class Context:
    """What a receiver knows of each element from the versions it applied: versions since its last
    change (``age``), that change's sign (``direction``), and its changes in the last :data:`WINDOW`
    versions (``recent``)."""

    def __init__(self, state: State) -> None:
        self.age = {n: np.full(t.numel(), _NEVER, dtype=np.int64) for n, t in state.items()}
        self.direction = {n: np.zeros(t.numel(), dtype=np.int64) for n, t in state.items()}
        self._masks: list[dict[str, np.ndarray]] = []

    def recent(self, name: str) -> np.ndarray:
        return sum((m[name] for m in self._masks), np.zeros_like(self.age[name]))

    def advance(self, old: State, new: State) -> None:
        """After ``old -> new``: ages grow by one, changed elements restart at 1 with their sign."""
        masks = {}
        for name, t in old.items():
            step = _keys(new[name]) - _keys(t)
            moved = step != 0
            self.age[name] = np.where(moved, 1, np.minimum(self.age[name] + 1, _NEVER))
            self.direction[name] = np.where(moved, np.sign(step), self.direction[name])
            masks[name] = moved.astype(np.int64)
        self._masks = [*self._masks, masks][-WINDOW:]


ROWS = [  # label, position model, sign model, magnitude model
    ("today's contexts, ideal", "pos_class", "sign_raw", "mag_class"),
    ("+ one class per exponent", "pos_exponent", "sign_raw", "mag_exponent"),
    ("+ age of the last change", "pos_exponent_age", "sign_raw", "mag_exponent_age"),
    ("+ its direction for the sign", "pos_exponent_age", "sign_direction_age", "mag_exponent_age"),
    ("+ changes in the last 4 versions", "pos_exponent_age_recent", "sign_direction_age", "mag_exponent_age"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=2.2e-6, help="2.2e-6 changes ~2%% of the elements a version here")
    parser.add_argument("--warmup", type=int, default=8, help="Adam steps before the first export")
    parser.add_argument("--history", type=int, default=4, help="deltas that only build the context")
    parser.add_argument("--deltas", type=int, default=5, help="deltas measured")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-every", type=int, default=50, help="versions per full anchor in the chain figure")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.deltas < 1 or args.history < 0:
        parser.error("--deltas must be at least 1 and --history at least 0")
    torch.set_num_threads(2)
    started = time.monotonic()
    states = chain(lr=args.lr, versions=args.history + args.deltas + 1, warmup=args.warmup, hidden=args.hidden,
                   layers=args.layers, vocab=args.vocab, batch=args.batch, seq=args.seq, seed=args.seed)
    context = Context(states[0])
    for old, new in zip(states[: args.history], states[1 : args.history + 1], strict=True):
        context.advance(old, new)
    totals: dict[str, float] = {}
    delta_bytes = changed = elements = 0
    for old, new in zip(states[args.history : -1], states[args.history + 1 :], strict=True):
        for key, value in measure_delta(old, new, context).items():
            totals[key] = totals.get(key, 0.0) + value
        delta_bytes += len(encode_delta(old, new))
        n_changed, n_elements = count_changed(old, new)
        changed, elements = changed + n_changed, elements + n_elements
        context.advance(old, new)
    full = sum(t.numel() * t.element_size() for t in states[-1].values())
    anchor_pct = 100 * len(encode_anchor(states[-1])) / full
    today_bytes = delta_bytes / changed
    per = {k: v / totals["changed"] for k, v in totals.items() if k != "changed"}
    baseline = per["pos_class"] + per["sign_raw"] + per["mag_class"]

    def chain_pct(bytes_per_changed: float) -> float:
        delta_pct = 100 * bytes_per_changed * changed / args.deltas / full
        return (anchor_pct + (args.full_every - 1) * delta_pct) / args.full_every

    rows: list[dict[str, Any]] = [{"label": "today's codec", "bytes_per_changed": today_bytes,
                                   "chain_pct": chain_pct(today_bytes)}]
    for label, pos, sign, mag in ROWS:
        total = per[pos] + per[sign] + per[mag]
        projected = today_bytes * total / baseline
        rows.append({"label": label, "position_bits": per[pos], "sign_bits": per[sign], "magnitude_bits": per[mag],
                     "ideal_bits": total, "bytes_per_changed": projected, "chain_pct": chain_pct(projected)})
    result = {"lr": args.lr, "deltas": args.deltas, "history": args.history, "elements": elements // args.deltas,
              "fraction_changed": changed / elements, "anchor_pct": anchor_pct, "full_every": args.full_every,
              "seconds": round(time.monotonic() - started, 1), "rows": rows}
    print(f"{elements // args.deltas / 1e6:.1f}M bf16 elements, {100 * changed / elements:.2f}% changed a version "
          f"(lr {args.lr:g}, {args.deltas} deltas after {args.history} of history); anchor {anchor_pct:.2f}% of raw")
    print(f"{'':<32} {'position':>8} {'sign':>6} {'magn.':>6} {'bits':>6} {'B/changed':>10} {f'chain/{args.full_every}%':>9}")
    for r in rows:
        ideal = (f"{r['position_bits']:>8.2f} {r['sign_bits']:>6.2f} {r['magnitude_bits']:>6.2f} {r['ideal_bits']:>6.2f}"
                 if "ideal_bits" in r else f"{'':>8} {'':>6} {'':>6} {'':>6}")
        print(f"{r['label']:<32} {ideal} {r['bytes_per_changed']:>10.3f} {r['chain_pct']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
