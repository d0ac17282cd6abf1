"""Size and speed of flywheel's lossless weight deltas on checkpoint pairs from real Adam updates.

A small Llama-style transformer (built locally from a config, random init, roughly 10M parameters
by default) is trained with Adam on an LM loss over random tokens: fp32 master weights, bf16
exports. For each learning rate it warms up for a few steps, then exports the bf16 state at step
``s``, ``s + 1`` and ``s + 16``; the pairs ``(s, s+1)`` and ``(s, s+16)`` are what a delta ships.

For each pair, in the same run, it reports:

- ``fraction_changed``: share of elements whose bits differ;
- ``flywheel_pct``: ``len(encode_delta(old, new))`` as % of the full bf16 bytes;
  ``bytes_per_changed``: the same delta's bytes per changed element;
- ``anchor_pct``: the new state as a compressed full anchor (:func:`encode_anchor`, what the
  registry stores for a full version) as % of the raw bf16 bytes; ``anchor_encode_gbps`` /
  ``anchor_decode_gbps``: raw bytes per second through :func:`encode_anchor` / :func:`decode_anchor`
  (the decode checks every tensor's SHA-256); ``anchor_exact``: the decoded state hashes to the new one;
- ``chain_pct``: the average object a node fetches per version over a chain of ``--full-every``
  versions (default 50) with one full anchor, each later version a delta like this pair's:
  ``(anchor bytes + (full_every - 1) * delta bytes) / full_every`` as % of the raw bytes (the
  1-step rows are the chain the registry builds when a version is published every step);
- ``xor_zstd_pct``: the naive baseline, XOR of the bits with the old state, zstd level 3, whole state;
- ``floor_pct``: the order-0 entropy floor (H(p)/p bits per changed position plus the empirical
  entropy of the steps), as % of full;
- ``encode_gbps`` / ``decode_gbps``: full bf16 bytes per second of the codec work alone
  (:func:`encode_delta_with_summary` with both hashes supplied, :func:`decode_unverified`);
  ``encode_hashed_gbps`` / ``decode_hashed_gbps``: :func:`encode_delta` and :func:`apply_delta`
  computing every SHA-256 they need; ``decode_verified_gbps``: :func:`apply_delta` with the base
  hash known (target hash still checked); ``sha256_gbps``: :func:`state_sha256` alone;
- ``bit_exact``: the applied delta hashes to the new state;
- with ``--device D`` (``cuda``, ``cuda:N``, ``auto``: a GPU if there is one, or ``cpu``: torch's
  CPU kernels), also ``device``, ``encode_device_gbps`` (the codec work as for ``encode_gbps``, on
  states already on ``D``, their changed elements found by torch there) and ``device_identical``
  (that delta equals the numba path's, byte for byte);
- ``load_avg_1m``: the machine's 1-minute load average after the timings (other work on a shared
  machine slows every rate above; ``sha256_gbps`` is a control that this codec does not affect).

It prints a table and, with ``--json PATH``, writes ``{"pairs": [...]}``. Timings are the best of
``--repeats`` runs; on a shared machine they are noisy.

    .venv/bin/python -m bench.weights --json /tmp/weights.json
    .venv/bin/python -m bench.weights --hidden 128 --layers 2 --vocab 2048 --lrs 1e-5 --gaps 1 --json /tmp/w.json
    .venv/bin/python -m bench.weights --device cuda --json /tmp/weights-gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from flywheel.weights.codec.anchor import decode_anchor, encode_anchor
from flywheel.weights.codec.bitview import element_bits, order_keys, zigzag
from flywheel.weights.codec.delta import (
    apply_delta,
    decode_unverified,
    encode_delta,
    encode_delta_with_summary,
    resolve_device,
)
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.codec.stats import count_changed

State = dict[str, torch.Tensor]


def build_model(hidden: int, layers: int, vocab: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


def export(model: torch.nn.Module) -> State:
    return {n: p.detach().to(torch.bfloat16).contiguous().clone() for n, p in model.named_parameters()}


def adam_pairs(*, lr: float, gaps: list[int], warmup: int, hidden: int, layers: int, vocab: int,
               batch: int, seq: int, seed: int) -> list[tuple[int, State, State]]:
    """``[(gap, bf16 at step s, bf16 at step s + gap)]`` from one Adam run at ``lr``."""
    model = build_model(hidden, layers, vocab, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    snapshots: dict[int, State] = {}
    wanted = {warmup} | {warmup + g for g in gaps}
    for step in range(1, max(wanted) + 1):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in wanted:
            snapshots[step] = export(model)
    return [(g, snapshots[warmup], snapshots[warmup + g]) for g in gaps]


def xor_zstd_bytes(old: State, new: State) -> int:
    cctx = zstandard.ZstdCompressor(level=3)
    return sum(len(cctx.compress((element_bits(old[n]) ^ element_bits(new[n])).tobytes())) for n in new)


def floor_bytes(old: State, new: State) -> float:
    """Order-0 floor: per tensor, n*H(k/n) bits for the positions plus the empirical entropy of the
    zigzag steps."""
    bits = 0.0
    for name, t in new.items():
        a, b = element_bits(old[name]), element_bits(t)
        idx = np.flatnonzero(a != b)
        n, k = a.size, idx.size
        if k == 0 or k == n:
            pos = 0.0
        else:
            p = k / n
            pos = -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))
        steps = zigzag(order_keys(b[idx], True) - order_keys(a[idx], True))
        counts = np.unique(steps, return_counts=True)[1].astype(np.float64)
        q = counts / max(1, k)
        bits += pos + float(-(counts * np.log2(q)).sum())
    return bits / 8


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def measure_device(old: State, new: State, old_sha: str, new_sha: str, delta: bytes, device: torch.device,
                   repeats: int) -> dict[str, Any]:
    """The encoder's codec work on states that live on ``device``, its changes found there."""
    old_d = {n: t.to(device) for n, t in old.items()}
    new_d = {n: t.to(device) for n, t in new.items()}

    def encode() -> bytes:
        return encode_delta_with_summary(old_d, new_d, old_sha256=old_sha, new_sha256=new_sha, device=device)[0]

    identical = encode() == delta  # also the warm-up (CUDA context, kernels)
    enc_s, _ = _best(encode, repeats)
    full = sum(t.numel() * t.element_size() for t in new.values())
    return {"device": str(device), "encode_device_gbps": full / enc_s / 1e9, "device_identical": identical}


def measure_anchor(new: State, delta_bytes: int, full_every: int, repeats: int) -> dict[str, Any]:
    """The compressed full anchor of ``new``: size, speed, and the chain average it gives."""
    full = sum(t.numel() * t.element_size() for t in new.values())
    enc_s, blob = _best(lambda: encode_anchor(new), repeats)
    dec_s, (decoded, sha) = _best(lambda: decode_anchor(blob), repeats)
    return {
        "anchor_bytes": len(blob),
        "anchor_exact": sha == state_sha256(new) == state_sha256(decoded),
        "anchor_pct": 100 * len(blob) / full,
        "anchor_encode_gbps": full / enc_s / 1e9,
        "anchor_decode_gbps": full / dec_s / 1e9,
        "full_every": full_every,
        "chain_pct": 100 * (len(blob) + (full_every - 1) * delta_bytes) / full_every / full,
    }


def measure(old: State, new: State, repeats: int, device: torch.device | None = None,
            full_every: int = 50) -> dict[str, Any]:
    full = sum(t.numel() * t.element_size() for t in new.values())
    changed, elements = count_changed(old, new)
    old_sha, new_sha = state_sha256(old), state_sha256(new)
    enc_s, delta = _best(lambda: encode_delta_with_summary(old, new, old_sha256=old_sha, new_sha256=new_sha)[0],
                         repeats)
    enc_h_s, _ = _best(lambda: encode_delta(old, new), repeats)
    # apply_delta always verifies the target hash; with old_sha256 given it skips hashing the base.
    dec_s, _ = _best(lambda: decode_unverified(old, delta), repeats)
    dec_v_s, result = _best(lambda: apply_delta(old, delta, old_sha256=old_sha), repeats)
    dec_h_s, _ = _best(lambda: apply_delta(old, delta), repeats)
    hash_s, _ = _best(lambda: state_sha256(new), repeats)
    exact = state_sha256(result) == new_sha and all(
        hashlib.sha256(element_bits(result[n]).tobytes()).digest() == hashlib.sha256(element_bits(new[n]).tobytes()).digest()
        for n in new)
    on_device = measure_device(old, new, old_sha, new_sha, delta, device, repeats) if device is not None else {}
    return {
        "elements": elements,
        "fraction_changed": changed / elements,
        "full_bytes": full,
        "flywheel_bytes": len(delta),
        "flywheel_pct": 100 * len(delta) / full,
        "bytes_per_changed": len(delta) / max(changed, 1),
        "xor_zstd_pct": 100 * xor_zstd_bytes(old, new) / full,
        "floor_pct": 100 * floor_bytes(old, new) / full,
        "encode_gbps": full / enc_s / 1e9,
        "decode_gbps": full / dec_s / 1e9,
        "encode_hashed_gbps": full / enc_h_s / 1e9,
        "decode_hashed_gbps": full / dec_h_s / 1e9,
        "decode_verified_gbps": full / dec_v_s / 1e9,
        "sha256_gbps": full / hash_s / 1e9,
        "bit_exact": bool(exact),
        **measure_anchor(new, len(delta), full_every, repeats),
        **on_device,
        "load_avg_1m": os.getloadavg()[0],
    }


def bench_device(name: str | None) -> torch.device | None:
    """``--device``: None (not given, or ``auto`` without a GPU), torch's CPU for ``cpu``, else as
    :func:`flywheel.weights.codec.delta.resolve_device`."""
    if name is None:
        return None
    return torch.device("cpu") if name == "cpu" else resolve_device(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1.8e-6, 3e-6, 1e-5])
    parser.add_argument("--gaps", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warmup", type=int, default=8, help="Adam steps before the first export")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-every", type=int, default=50, help="versions per full anchor in chain_pct")
    parser.add_argument("--json", type=Path, help="write {'pairs': [...]} here")
    parser.add_argument("--device", help="also time the encoder finding changes with torch here: cuda[:N], auto "
                                         "(a GPU if any) or cpu")
    args = parser.parse_args(argv)
    try:
        device = bench_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    if args.full_every < 1:
        parser.error("--full-every must be at least 1")
    torch.set_num_threads(2)
    rows = []
    for lr in args.lrs:
        started = time.monotonic()
        pairs = adam_pairs(lr=lr, gaps=args.gaps, warmup=args.warmup, hidden=args.hidden, layers=args.layers,
                           vocab=args.vocab, batch=args.batch, seq=args.seq, seed=args.seed)
        train_s = time.monotonic() - started
        for gap, old, new in pairs:
            row = {"lr": lr, "steps_apart": gap, **measure(old, new, args.repeats, device, args.full_every),
                   "train_s": round(train_s, 1)}
            rows.append(row)
            print(f"lr={lr:g} gap={gap}: changed {row['fraction_changed']:.4f} flywheel {row['flywheel_pct']:.3f}% "
                  f"floor {row['floor_pct']:.3f}% anchor {row['anchor_pct']:.2f}% chain {row['chain_pct']:.3f}% "
                  f"(load {row['load_avg_1m']:.1f})", flush=True)
    params = rows[0]["elements"] if rows else 0
    print(f"\nmodel: {params / 1e6:.1f}M parameters, {rows[0]['full_bytes'] / 1e6:.1f} MB bf16" if rows else "")
    head = (f"{'lr':>7} {'apart':>5} {'changed':>8} {'flywheel%':>9} {'B/chg':>6} {'xor+zstd%':>9} {'floor%':>7} "
            f"{'fw/floor':>8} {'enc GB/s':>8} {'dec GB/s':>8} {'enc+h':>6} {'dec+h':>6} {'sha GB/s':>8} {'exact':>5}")
    print(head)
    for r in rows:
        print(f"{r['lr']:>7g} {r['steps_apart']:>5} {r['fraction_changed']:>8.4f} {r['flywheel_pct']:>9.3f} "
              f"{r['bytes_per_changed']:>6.3f} {r['xor_zstd_pct']:>9.3f} {r['floor_pct']:>7.3f} "
              f"{r['flywheel_pct'] / r['floor_pct']:>8.3f} {r['encode_gbps']:>8.2f} {r['decode_gbps']:>8.2f} "
              f"{r['encode_hashed_gbps']:>6.2f} {r['decode_hashed_gbps']:>6.2f} {r['sha256_gbps']:>8.2f} "
              f"{str(r['bit_exact']):>5}")
    if rows:
        every = rows[0]["full_every"]
        print(f"\nfull anchor (compressed) and the chain average at one full anchor per {every} versions, "
              f"each later version a delta like the pair's")
        print(f"{'lr':>7} {'apart':>5} {'anchor%':>8} {'anc enc GB/s':>12} {'anc dec GB/s':>12} {f'chain/{every}%':>10}")
        for r in rows:
            print(f"{r['lr']:>7g} {r['steps_apart']:>5} {r['anchor_pct']:>8.2f} {r['anchor_encode_gbps']:>12.2f} "
                  f"{r['anchor_decode_gbps']:>12.2f} {r['chain_pct']:>10.3f}")
    for r in rows:
        if "device" in r:
            print(f"lr={r['lr']:g} apart={r['steps_apart']}: encode on {r['device']} "
                  f"{r['encode_device_gbps']:.2f} GB/s (numba {r['encode_gbps']:.2f}), "
                  f"identical delta: {r['device_identical']}")
    if args.json:
        args.json.write_text(json.dumps({"pairs": rows}, indent=2))


if __name__ == "__main__":
    main()
