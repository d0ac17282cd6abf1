"""Proof that the async trainer pays: async vs synchronous training on the simulated product.

Three runs, one after the other, each a fresh stack (``flywheel demo``'s loop: every role in its
own process, embedded defaults, :data:`demo.run.DEMO_OVERRIDES`: a rollout tick every 4 s,
no canary) in a fresh data directory, with the same seed, the same simulated users, the same
minutes of traffic and the same simulated serving latency (``node.simulated_latency_s``):

- ``async``: ``trainer.mode = "async"``, the product setting: train on whatever arrives within
  the staleness bound;
- ``sync``: ``trainer.mode = "sync"``: train only on samples served by the version being
  trained, waiting for them after each publish (classic on-policy RL);
- ``control``: async with ``trainer.lr = 0``: the whole loop runs, nothing can be learnt.

After each run (its stack stopped, so evaluation never competes with the loop for the CPU) the
versions that went live on the node are evaluated on the demo's held-out problems (same problems,
same sampling seed for every run): ``--eval-points`` of them evenly spread, then bisection between
the first one at or above ``--target`` and the evaluated one before it, so the *time to target* is
when the first live version at or above the target went live, counted from the start of traffic
(the crossing found is the first one among the evaluated versions, refined to one version).
Versions with identical weights (same sha256) are evaluated once. *Final success* is the held-out
success of the last version that went live.

Why the default latency is 0.3 s: a production chat model answering this task's completions
(up to 16 tokens) on vLLM decodes at roughly 50-100 tokens/s per sequence under load plus
50-100 ms to the first token, so 0.2-0.4 s per generation; the tiny model answers in a few ms,
which would make serving free and hide what waiting for fresh samples costs. The latency is an
``asyncio.sleep`` on the node, so it costs no CPU on this 2-core machine. With 32 users the node
serves about 50 answers (35 sessions) a second, so a batch of 32 trajectories fills in about a
second: the async trainer is fed as fast as it trains, and what the synchronous one loses is the
wait for each version to go live and gather its own samples (a rollout tick every 4 s, as in the
demo). Five minutes of traffic per run keep the whole bench near 20 minutes; a sync run that does
not reach the target in that time still bounds the speed-up from below (its traffic time over
async's time to target, ``speedup_lower_bound``).

``--target`` (default 0.60) was fixed before any run: well above the base model's ~37%, below
the ~70% the quick demo reaches in 2 minutes of (latency-free) traffic.

Per run the JSON also has: versions published and live, samples trained, samples dropped by
reason (the trainer's buffer counters, as of its last version), the staleness histogram summed
over versions (samples by versions behind the version trained), parity mean / p99 / max over
versions (per-token |logp_train - logp_served| on on-policy tokens, nats), the held-out success
of every evaluated version with the time it went live, and the served first-answer success.

    .venv/bin/python -m bench.trainer --json out/trainer.json --plot docs/bench-trainer.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from demo.run import (
    HELDOUT_N,
    HeldoutEvaluator,
    first_answers,
    live_stack,
    loop_settings,
    model_path,
    pick_spread,
    run_traffic,
)
from demo.users import UserPool
from flywheel.settings import Settings, load_settings
from launch.up import prepare

RUNS: dict[str, dict[str, Any]] = {
    "async": {"trainer": {"mode": "async"}},
    "sync": {"trainer": {"mode": "sync"}},
    "control": {"trainer": {"mode": "async", "lr": 0.0}},
}
DEFAULT_TARGET = 0.60
DEFAULT_LATENCY_S = 0.3
DEFAULT_MINUTES = 5.0
DEFAULT_USERS = 32


@dataclass(frozen=True)
class BenchOptions:
    minutes: float
    users: int
    seed: int
    latency_s: float
    target: float
    runs: tuple[str, ...]
    data_dir: Path
    model: Path | None
    eval_points: int
    heldout_n: int


@dataclass
class LiveVersion:
    """A version the node went live with, seconds after traffic started (0: before traffic)."""

    version: int
    sha256: str
    live_at_s: float
    heldout: float | None = None


@dataclass
class RunResult:
    name: str
    trainer_mode: str
    lr: float
    traffic_s: float
    live: list[LiveVersion]
    versions: list[dict[str, Any]]  # every registered version: number, sha256, metrics
    served: list[Any] = field(default_factory=list)  # demo.users.Served, first answers only
    sessions: int = 0
    answers: int = 0
    client_errors: dict[str, int] = field(default_factory=dict)


# --- one run --------------------------------------------------------------------------------------


def run_one(name: str, base: Settings, options: BenchOptions, model_dir: Path, stop: threading.Event) -> RunResult:
    """A fresh stack in ``{data_dir}/{name}``, ``options.users`` simulated users for ``options.minutes``."""
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    run_dir = options.data_dir / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = {
        "node": {"simulated_latency_s": options.latency_s, "seed": options.seed},
        "trainer": {**RUNS[name]["trainer"], "seed": options.seed},
    }
    settings = prepare(loop_settings(base, run_dir, model_dir, overrides=overrides))
    engine = make_engine(settings.database_url)
    registry = Registry(make_session_factory(engine), make_store(settings), settings.model.line)
    t0 = time.monotonic()
    try:
        with live_stack(settings, t0) as live:
            deadline = time.monotonic() + 60
            while not live.watcher.seen:  # the base version, live before traffic: at 0 s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the node reported no live version in 60 s:\n{live.stack.tail('node')}")
                time.sleep(0.05)
            pool = UserPool(live.gateway, settings.model.line, options.users, options.seed,
                            max_tokens=settings.node.max_new_tokens, t0=t0)
            print(f"bench.trainer [{name}]: stack up in {time.monotonic() - t0:.0f}s; trainer mode="
                  f"{settings.trainer.mode} lr={settings.trainer.lr:g}; {options.users} users for "
                  f"{options.minutes:g} min, serving latency {options.latency_s:g}s", flush=True)
            t_traffic = run_traffic(live.stack, pool, options.minutes, stop,
                                    report=lambda s: _progress(name, pool, registry, live.watcher, s), every_s=15.0)
            traffic_s = min(time.monotonic() - t_traffic, options.minutes * 60)
            seen = dict(live.watcher.seen)
        offset = t_traffic - t0
        versions = [{"version": v.version, "sha256": v.sha256, "metrics": v.metrics} for v in registry.versions()]
        live_versions = [LiveVersion(v, s["sha256"], round(max(0.0, s["t"] - offset), 2))
                         for v, s in sorted(seen.items()) if s["t"] - offset <= traffic_s]  # not while users stopped
        served = [replace(s, t=s.t - offset) for s in first_answers(pool) if 0 <= s.t - offset <= traffic_s]
        result = RunResult(name, settings.trainer.mode, settings.trainer.lr, traffic_s, live_versions, versions,
                           served, pool.stats.sessions, len(pool.stats.served), dict(pool.stats.errors))
        evaluate_live(result, HeldoutEvaluator(settings.model.path, registry, options.seed, options.heldout_n),
                      options.target, options.eval_points)
        return result
    finally:
        engine.dispose()


def _progress(name: str, pool: UserPool, registry: Any, watcher: Any, elapsed: float) -> None:
    served = first_answers(pool)
    recent = [s.correct for s in served if s.t >= served[-1].t - 30] if served else []
    rate = sum(recent) / len(recent) if recent else float("nan")
    latest = registry.latest()
    print(f"  [{name}] t={elapsed:4.0f}s answers={len(pool.stats.served):6d} first-answer success (30s)={rate:5.1%} "
          f"node v{max(watcher.seen) if watcher.seen else None} published v{latest.version if latest else None}",
          flush=True)


# --- evaluation -----------------------------------------------------------------------------------


def evaluate_live(run: RunResult, evaluator: Any, target: float, points: int) -> None:
    """Fill in the held-out success of ``points`` evenly spread live versions (the first and the last
    among them) and, by bisection, of the first live version at or above ``target`` after the last
    evaluated one below it. Versions with the same weights share one evaluation."""
    by_sha: dict[str, float] = {}

    def heldout(lv: LiveVersion) -> float:
        if lv.heldout is None:
            if lv.sha256 not in by_sha:
                by_sha[lv.sha256] = evaluator(lv.version)
            lv.heldout = by_sha[lv.sha256]
        return lv.heldout

    live = run.live
    if not live:
        return
    index = {lv.version: i for i, lv in enumerate(live)}
    picked = [index[v] for v in pick_spread([lv.version for lv in live], max(2, points))]
    for i in picked:
        heldout(live[i])
    hit = next((i for i in picked if heldout(live[i]) >= target), None)
    if hit is None or hit == 0:
        return
    lo = max(i for i in picked if i < hit)  # evaluated and below the target
    while hit - lo > 1:
        mid = (lo + hit) // 2
        if heldout(live[mid]) >= target:
            hit = mid
        else:
            lo = mid


def time_to_target(run: RunResult, target: float) -> float | None:
    """When the first evaluated live version at or above ``target`` went live (s after traffic start)."""
    return next((lv.live_at_s for lv in run.live if lv.heldout is not None and lv.heldout >= target), None)


def final_success(run: RunResult) -> float | None:
    return run.live[-1].heldout if run.live else None


# --- summaries ------------------------------------------------------------------------------------


def summarise(run: RunResult, target: float) -> dict[str, Any]:
    """The run's figures as plain JSON data."""
    trained = [v for v in run.versions if "samples" in v["metrics"]]  # published by the trainer (not the base)
    counters = next((v["metrics"] for v in reversed(trained) if "added" in v["metrics"]), {})
    staleness: Counter[str] = Counter()
    for v in trained:
        staleness.update({str(k): int(n) for k, n in (v["metrics"].get("staleness") or {}).items()})
    parity = [
        {"version": v["version"], **{k: v["metrics"][k] for k in ("parity", "parity_p99", "parity_max") if k in v["metrics"]}}
        for v in trained if "parity" in v["metrics"]
    ]
    served_success = fmean(s.correct for s in run.served) if run.served else None
    return {
        "trainer_mode": run.trainer_mode,
        "lr": run.lr,
        "traffic_s": round(run.traffic_s, 1),
        "sessions": run.sessions,
        "answers": run.answers,
        "client_errors": run.client_errors,
        "served_first_answer_success": served_success,
        "versions_published": len(trained),
        "versions_live": len(run.live),
        "distinct_weights": len({v["sha256"] for v in run.versions}),
        "samples_trained": int(sum(v["metrics"]["samples"] for v in trained)),
        "samples_dropped": {k[len("dropped_"):]: int(n) for k, n in sorted(counters.items()) if k.startswith("dropped_")},
        "buffer": {k: counters[k] for k in ("added", "taken", "buffered") if k in counters},
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        # over the versions that measured it: the mean of their means and of their p99s, the max of maxima
        "parity_mean": _mean([p["parity"] for p in parity]),
        "parity_p99": _mean([p["parity_p99"] for p in parity if "parity_p99" in p]),
        "parity_max": max((p["parity_max"] for p in parity if "parity_max" in p), default=None),
        "parity_by_version": parity,
        "heldout_start": run.live[0].heldout if run.live else None,
        "final_success": final_success(run),
        "time_to_target_s": time_to_target(run, target),
        "live_versions": [{"version": lv.version, "live_at_s": lv.live_at_s, "heldout": lv.heldout} for lv in run.live],
        "served_success_10s": binned_success(run.served, 10.0),
    }


def _mean(values: list[float]) -> float | None:
    return fmean(values) if values else None


def report(results: dict[str, RunResult], options: BenchOptions) -> dict[str, Any]:
    runs = {name: summarise(run, options.target) for name, run in results.items()}

    def get(name: str, key: str) -> Any:
        return runs[name][key] if name in runs else None

    a, s = get("async", "time_to_target_s"), get("sync", "time_to_target_s")
    out: dict[str, Any] = {
        "async_time_to_target_s": a,
        "sync_time_to_target_s": s,
        "async_final_success": get("async", "final_success"),
        "sync_final_success": get("sync", "final_success"),
        "control_final_success": get("control", "final_success"),
        "target_success": options.target,
        # sync / async time to target; when sync never got there, the traffic time over async's
        # time is a lower bound on it.
        "speedup": (s / a) if a and s else None,
        "speedup_lower_bound": (runs["sync"]["traffic_s"] / a) if a and s is None and "sync" in runs else None,
        "minutes": options.minutes,
        "users": options.users,
        "seed": options.seed,
        "simulated_latency_s": options.latency_s,
        "heldout_n": options.heldout_n,
        "eval_points": options.eval_points,
        "runs": runs,
    }
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _secs(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f} s"


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nbench.trainer: {summary['users']} users, {summary['minutes']:g} min of traffic per run, serving latency "
          f"{summary['simulated_latency_s']:g} s, seed {summary['seed']}, target held-out success "
          f"{summary['target_success']:.0%} ({summary['heldout_n']} problems, T=1)")
    print(f"{'run':8s} {'published/live':>14s} {'trained':>8s} {'dropped':>22s} {'time to target':>15s} "
          f"{'held-out start -> final':>24s} {'parity mean/p99/max':>22s}  staleness (versions: samples)")
    for name, r in summary["runs"].items():
        ttt = _secs(r["time_to_target_s"])
        dropped = ", ".join(f"{k} {n}" for k, n in r["samples_dropped"].items() if n) or "0"
        parity = "-" if r["parity_mean"] is None else "/".join(
            "-" if r[k] is None else f"{r[k]:.4f}" for k in ("parity_mean", "parity_p99", "parity_max"))
        hs = f"{_pct(r['heldout_start'])} -> {_pct(r['final_success'])}"
        stale = " ".join(f"{k}:{n}" for k, n in r["staleness"].items()) or "-"
        print(f"{name:8s} {r['versions_published']:>7d}/{r['versions_live']:<6d} {r['samples_trained']:>8d} {dropped:>22s} "
              f"{ttt:>15s} {hs:>24s} {parity:>22s}  {stale}")
    if summary["speedup"] is not None:
        print(f"async reaches {summary['target_success']:.0%} {summary['speedup']:.2f}x faster than sync "
              f"({summary['async_time_to_target_s']:.0f} s vs {summary['sync_time_to_target_s']:.0f} s)")
    elif summary["speedup_lower_bound"] is not None:
        print(f"sync never reached {summary['target_success']:.0%}: async is at least "
              f"{summary['speedup_lower_bound']:.2f}x faster")


# --- plot -----------------------------------------------------------------------------------------

COLOURS = {"async": "tab:blue", "sync": "tab:orange", "control": "tab:gray"}


def binned_success(served: list[Any], bin_s: float) -> list[list[float]]:
    """``[bin start s, success, answers]`` of ``served`` answers per ``bin_s`` seconds of traffic."""
    bins: dict[int, list[bool]] = {}
    for s in served:
        bins.setdefault(int(s.t // bin_s), []).append(s.correct)
    return [[k * bin_s, round(fmean(bins[k]), 4), len(bins[k])] for k in sorted(bins)]


def plot(path: Path, summary: dict[str, Any]) -> None:
    """From the summary alone: held-out success of live versions vs seconds of traffic (target
    line); served first-answer success over time; staleness histograms of async and sync; parity
    per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_h, ax_s), (ax_st, ax_p) = axes
    target = summary["target_success"]
    for name, run in summary["runs"].items():
        colour = COLOURS.get(name)
        points = [(v["live_at_s"], v["heldout"]) for v in run["live_versions"] if v["heldout"] is not None]
        ax_h.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=4, color=colour, label=name)
        if run["time_to_target_s"] is not None:
            ax_h.axvline(run["time_to_target_s"], color=colour, ls=":", lw=1)
        bins = [b for b in run["served_success_10s"] if b[2] >= 20]  # skip a last, nearly empty bin
        ax_s.plot([b[0] + 5 for b in bins], [b[1] for b in bins], ".-", ms=3, lw=1, color=colour, label=name)
    ax_h.axhline(target, color="red", ls="--", lw=1, label=f"target {target:.0%}")
    ax_h.set_xlabel("seconds of traffic (when the version went live on the node)")
    ax_h.set_ylabel(f"held-out success ({summary['heldout_n']} problems, T=1)")
    ax_h.set_title("held-out success of live versions; dotted: time to target")
    ax_h.legend(fontsize=8, loc="upper left")
    ax_s.set_xlabel("seconds of traffic")
    ax_s.set_ylabel("served first-answer success (10 s bins)")
    ax_s.set_title("what users saw")
    ax_s.legend(fontsize=8, loc="upper left")

    hist_runs = [n for n in ("async", "sync") if n in summary["runs"] and summary["runs"][n]["staleness"]]
    if hist_runs:
        top = max(int(k) for n in hist_runs for k in summary["runs"][n]["staleness"])
        width = 0.8 / len(hist_runs)
        for j, name in enumerate(hist_runs):
            hist = summary["runs"][name]["staleness"]
            total = sum(hist.values())
            xs = list(range(top + 1))
            ax_st.bar([x + (j - (len(hist_runs) - 1) / 2) * width for x in xs], [hist.get(str(x), 0) / total for x in xs],
                      width=width, color=COLOURS[name], label=f"{name} ({total} samples)")
        ax_st.set_xticks(list(range(top + 1)))
        ax_st.legend(fontsize=8)
    else:
        ax_st.text(0.5, 0.5, "no staleness recorded", ha="center", va="center", transform=ax_st.transAxes)
    ax_st.set_xlabel("staleness: version trained - behaviour version")
    ax_st.set_ylabel("share of trained samples")
    ax_st.set_title("staleness of trained samples")

    plotted = False
    for name in summary["runs"]:
        parity = summary["runs"][name]["parity_by_version"]
        if not parity:
            continue
        plotted = True
        colour = COLOURS.get(name)
        # markers only: async measures parity only on the few versions that trained on-policy samples
        for key, marker in (("parity", "o"), ("parity_p99", "^"), ("parity_max", "x")):
            points = [(p["version"], p[key]) for p in parity if key in p]
            if points:
                ax_p.plot([x for x, _ in points], [y for _, y in points], marker, ms=3, ls="none", color=colour,
                          label=f"{name} {key.removeprefix('parity_') if key != 'parity' else 'mean'}")
    if plotted:
        ax_p.set_yscale("log")
        ax_p.legend(fontsize=8)
    else:
        ax_p.text(0.5, 0.5, "no parity recorded", ha="center", va="center", transform=ax_p.transAxes)
    ax_p.set_xlabel("version (each run numbers its own)")
    ax_p.set_ylabel("|logp_train - logp_served| per token (nats)")
    ax_p.set_title("parity on on-policy tokens, per version")
    fig.suptitle(f"async vs sync trainer: {summary['users']} simulated users, {summary['minutes']:g} min each, "
                 f"serving latency {summary['simulated_latency_s']:g} s, seed {summary['seed']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- entry point ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None, stop: threading.Event | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="traffic per run")
    parser.add_argument("--users", type=int, default=DEFAULT_USERS, help="concurrent simulated users")
    parser.add_argument("--seed", type=int, default=0, help="users, trainer, node sampling and evaluation")
    parser.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S,
                        help="simulated serving latency per generation, seconds (node.simulated_latency_s)")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="held-out success to reach")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--eval-points", type=int, default=8, help="live versions evaluated per run before bisection")
    parser.add_argument("--heldout-n", type=int, default=HELDOUT_N, help="held-out problems per evaluation")
    parser.add_argument("--data-dir", type=Path, help="runs go to DIR/<run> (default: {data_dir}/bench-trainer)")
    parser.add_argument("--model", type=Path, help="model directory (default: model.path, else the default tiny model)")
    parser.add_argument("--config", help="a flywheel settings file the runs start from")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    if not runs or set(runs) - set(RUNS):
        parser.error(f"--runs takes a subset of {','.join(RUNS)}")
    if not 0 < args.target <= 1:
        parser.error("--target is a success rate in (0, 1]")
    base = load_settings(args.config)
    options = BenchOptions(args.minutes, args.users, args.seed, args.latency, args.target,
                           tuple(r for r in RUNS if r in runs), args.data_dir or base.data_path / "bench-trainer",
                           args.model, args.eval_points, args.heldout_n)
    model_dir = options.model or model_path(base, "bench.trainer")
    stop = stop or threading.Event()
    results: dict[str, RunResult] = {}
    for name in options.runs:
        results[name] = run_one(name, base, options, model_dir, stop)
        r = summarise(results[name], options.target)
        print(f"bench.trainer [{name}]: {r['versions_published']} versions published, {r['versions_live']} live; "
              f"held-out {_pct(r['heldout_start'])} -> {_pct(r['final_success'])}; time to target "
              f"{_secs(r['time_to_target_s'])}", flush=True)
    summary = report(results, options)
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    if args.plot:
        plot(args.plot, summary)
        print(f"plot written to {args.plot}")
    return summary


if __name__ == "__main__":
    main()
