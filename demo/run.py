"""``flywheel demo``: the whole loop on embedded defaults, with simulated users, measured.

Runs ``up`` (every role in its own process) in a fresh run directory, drives it with simulated
users over the real HTTP API, prints progress (versions shipped, delta size against the full
checkpoint, reward trend), then checks what must hold and writes a summary (JSON and a PNG plot):

- every generation a user received was persisted (captured == persisted),
- every generation names the version that served it, and every shipped version was verified by
  sha256 on the node,
- the held-out success rate of the served model, before and after (held-out problems never reach
  traffic, so never reach training).

Its pieces are shared with ``bench.trainer``, which runs the same loop several times: the loop's
settings (:func:`loop_settings`), a started stack with its node watcher (:func:`live_stack`), the
traffic loop (:func:`run_traffic`), held-out evaluation of versions (:class:`HeldoutEvaluator`)
and the users' first answers (:func:`first_answers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from demo.users import Behaviour, Served, UserPool
from flywheel.settings import Settings
from launch.up import Stack, prepare, with_model

log = logging.getLogger("flywheel.demo")


@dataclass(frozen=True)
class DemoOptions:
    quick: bool = False
    minutes: float | None = None
    lr: float | None = None
    users: int | None = None
    json_path: str | None = None
    plot_path: str | None = None
    port: int | None = None
    seed: int = 0
    #: The product's sampling settings (temperature, top_p, top_k) where given; the rest as the
    #: model's defaults and OpenAI's leave them.
    sampling: tuple[tuple[str, float | int], ...] = ()
    #: Promote through a canary gated on the users' success metric (:data:`DEMO_CANARY`).
    canary: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        knobs = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        return cls(args.quick, args.minutes, args.lr, args.users, args.json_path, args.plot_path, args.port, args.seed,
                   tuple((k, v) for k, v in knobs.items() if v is not None), getattr(args, "canary", False))

    @property
    def traffic_minutes(self) -> float:
        return self.minutes if self.minutes is not None else (2.0 if self.quick else 12.0)


#: Settings the demo runs with, on top of the user's (fast schedules: seconds, not hours).
DEMO_OVERRIDES: dict[str, Any] = {
    # Versions come every few seconds: no canary (a canary needs minutes of traffic to judge);
    # candidates still pass the held-out and parity gates before they go stable.
    "rollout": {"interval_s": 4.0, "canary_fraction": 0.0},
    "ingest": {"inactivity_timeout_s": 4.0},
    "node": {"poll_s": 0.5},
    # Versions come every few seconds here, so behaviour data is a few versions old by the time
    # it is scored; the importance ratio corrects for it.
    "trainer": {"max_staleness": 8},
}
#: ``flywheel demo --canary``: the newest candidate is a canary for half the new sessions and is
#: promoted only once it beats stable on ``solved`` (a session-level boolean the users report:
#: solved, or given up) by more than 1 point, at alpha 0.05 under continuous looks
#: (serving/rollout_evidence.py; the mixture is tuned to effects of about 5 points); no win within
#: 2 minutes rolls it back. The held-out reward gate (a fixed-sample comparison of held-out rewards,
#: noisy at a canary's size) waits for 1,000 held-out trajectories a version: here the live gate is
#: the evidence. Stable serves for a minute or more while the trainer publishes every few seconds, so
#: the trainer keeps samples up to 64 versions old (importance-corrected).
SUCCESS_METRIC = "solved"
DEMO_CANARY: dict[str, Any] = {
    "metrics": {"declared": {SUCCESS_METRIC: {"type": "boolean", "level": "session", "direction": "max"}}},
    "rollout": {"canary_fraction": 0.5, "window_s": 0.0, "min_samples": 100, "max_window_s": 120.0,
                "held_out_min_samples": 1000,
                "must_win": [{"metric": SUCCESS_METRIC, "min_effect": 0.01, "alpha": 0.05, "mixing_sd": 0.05}]},
    "trainer": {"max_staleness": 64},
}
HELDOUT_N = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(settings: Settings, label: str = "flywheel demo") -> Path:
    """The model directory the loop serves: ``model.path``, else the default tiny model (built once)."""
    if not settings.model.path:
        print(f"{label}: building/loading the tiny model (cache {settings.data_path / 'models'})", flush=True)
    return Path(with_model(settings).model.path)


def loop_settings(settings: Settings, run_dir: Path, model_path: Path, *, port: int | None = None,
                  overrides: dict[str, Any] | None = None) -> Settings:
    """``settings`` with :data:`DEMO_OVERRIDES`, then ``overrides``, in ``run_dir`` on free ports."""
    from flywheel.settings import deep_merge

    merged = deep_merge(settings.model_dump(), DEMO_OVERRIDES)
    merged = deep_merge(merged, overrides or {})
    merged["data_dir"] = str(run_dir)
    merged["model"]["path"] = str(model_path)
    merged["gateway"]["port"] = port or free_port()
    merged["gateway"]["upstream"] = ""
    merged["node"]["port"] = free_port()
    return Settings.model_validate(merged)


def _demo_settings(settings: Settings, options: DemoOptions, run_dir: Path, model_path: Path) -> Settings:
    from flywheel.settings import deep_merge

    overrides: dict[str, Any] = DEMO_CANARY if options.canary else {}
    if options.lr is not None:
        overrides = deep_merge(overrides, {"trainer": {"lr": options.lr}})
    return loop_settings(settings, run_dir, model_path, port=options.port, overrides=overrides)


class NodeWatcher(threading.Thread):
    """Polls the node's /health: which versions it went live with, and the sha256 it verified."""

    def __init__(self, url: str, stop: threading.Event, t0: float):
        super().__init__(name="node-watcher", daemon=True)
        self.url, self.stop, self.t0 = url, stop, t0
        self.seen: dict[int, dict[str, Any]] = {}

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.wait(0.25):
                try:
                    health = client.get(self.url).json()
                except (httpx.HTTPError, ValueError):
                    continue
                version = health.get("version")
                if version is not None and version not in self.seen:
                    self.seen[version] = {"sha256": health.get("sha256"), "t": time.monotonic() - self.t0}


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class HeldoutEvaluator:
    """Held-out success rate of registry versions, sampled with the product's settings (``sampling``:
    request fields, applied over the model's defaults as the node applies them).

    The same :data:`HELDOUT_N` problems and ``seed`` for every version; results are memoised, and
    each version is rebuilt from the nearest version already loaded below it on its chain.
    """

    def __init__(self, model_dir: str | Path, registry: Any, seed: int, n: int = HELDOUT_N,
                 sampling: dict[str, Any] | None = None):
        import torch

        from demo.tinymodel.task import heldout_problems
        from flywheel.lm import load_model
        from flywheel.sampling import Processing, applied, generation_defaults

        self.processing = Processing.of(applied(sampling or {}, generation_defaults(model_dir)))

        torch.set_num_threads(2)
        self.model, self.tokenizer = load_model(model_dir)
        self.problems = heldout_problems(n)
        self.registry, self.seed = registry, seed
        self.results: dict[int, float] = {}
        self._states: dict[int, Any] = {}

    def __call__(self, version: int) -> float:
        from demo.tinymodel.evaluate import evaluate
        from flywheel.lm import load_state

        if version not in self.results:
            below = [v for v in self._states if v < version]
            base = (max(below), self._states[max(below)]) if below else None
            weights = self.registry.load(version, base=base)
            self._states = {version: weights}  # the newest loaded; versions are mostly asked in order
            load_state(self.model, weights)
            self.results[version] = evaluate(self.model, self.tokenizer, self.problems, seed=self.seed,
                                             processing=self.processing)
        return self.results[version]


def _evaluate_versions(settings: Settings, registry: Any, versions: list[int], seed: int,
                       sampling: dict[str, Any]) -> dict[int, float]:
    """Held-out success rate of each version's weights, sampled with the product's settings."""
    evaluator = HeldoutEvaluator(settings.model.path, registry, seed, sampling=sampling)
    return {version: evaluator(version) for version in sorted(set(versions))}


@dataclass
class LiveStack:
    """A started stack: its processes, the node watcher and the gateway's base URL."""

    stack: Stack
    watcher: NodeWatcher
    gateway: str


@contextmanager
def live_stack(settings: Settings, t0: float) -> Iterator[LiveStack]:
    """Start every role, wait until the node and the gateway answer, watch the node's versions
    (times relative to ``t0``); stop everything on exit."""
    stack = Stack(settings)
    stack.start()
    watcher_stop = threading.Event()
    try:
        stack.wait_ready()
        gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
        watcher = NodeWatcher(f"http://{settings.node.host}:{settings.node.port}/health", watcher_stop, t0)
        watcher.start()
        yield LiveStack(stack, watcher, gateway)
    finally:
        watcher_stop.set()
        stack.stop()


def run_traffic(stack: Stack, pool: UserPool, minutes: float, stop: threading.Event,
                report: Callable[[float], None] | None = None, every_s: float = 10.0) -> float:
    """Run ``pool``'s users for ``minutes`` (or until ``stop``), restarting crashed roles and calling
    ``report(seconds of traffic)`` every ``every_s``; returns the monotonic time traffic started."""
    users_stop = threading.Event()
    try:
        pool.start(users_stop)
        t_traffic = time.monotonic()
        next_report = t_traffic + every_s
        while time.monotonic() - t_traffic < minutes * 60 and not stop.is_set():
            time.sleep(0.5)
            for role in stack.supervise_once():
                print(f"  ! {role} crashed and was restarted (see {stack.log_dir / (role + '.log')})", flush=True)
            if report is not None and time.monotonic() >= next_report:
                next_report += every_s
                report(time.monotonic() - t_traffic)
    finally:
        users_stop.set()
    pool.join()
    return t_traffic


def main(args: argparse.Namespace, settings: Settings) -> int:
    """``flywheel demo`` (named by the command line's table, launch/cli.py): run it until done or
    SIGTERM/SIGINT."""
    from launch.cli import stop_on_signals

    return run_demo(settings, DemoOptions.from_args(args), stop_on_signals())


def run_demo(settings: Settings, options: DemoOptions, stop: threading.Event) -> int:
    from sqlalchemy import func, select

    from flywheel.db.models import Generation, ScoredTrajectoryRow, Trajectory
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    t_start = time.monotonic()
    base = settings.data_path
    run_dir = base / ("demo-quick" if options.quick else "demo")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    settings = prepare(_demo_settings(settings, options, run_dir, model_path(settings)))
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    registry = Registry(sessions, make_store(settings), settings.model.line)

    with live_stack(settings, t_start) as live:
        gateway, watcher = live.gateway, live.watcher
        n_users = options.users or 8
        behaviour = Behaviour(success_metric=SUCCESS_METRIC if options.canary else None)
        pool = UserPool(gateway, settings.model.line, n_users, options.seed, behaviour,
                        max_tokens=settings.node.max_new_tokens, t0=t_start, sampling=dict(options.sampling) or None)
        minutes = options.traffic_minutes
        print(
            f"flywheel demo: stack up in {time.monotonic() - t_start:.0f}s; {n_users} simulated users for "
            f"{minutes:g} min; trainer lr={settings.trainer.lr:g}; gateway {gateway}/v1; console {gateway}/console",
            flush=True,
        )
        t_traffic_wall = datetime.now(UTC)
        run_traffic(live.stack, pool, minutes, stop, report=lambda elapsed: _progress(pool, registry, watcher, elapsed))
        received = len(pool.stats.served)
        captured, persisted = _drain(gateway, sessions, Generation, received)
        with sessions() as s:
            rows = s.execute(select(Generation.generation_id, Generation.model_version)).all()
            trajectories = s.scalar(select(func.count()).select_from(Trajectory)) or 0
            scored = s.scalar(select(func.count()).select_from(ScoredTrajectoryRow)) or 0

    versions = registry.versions()
    by_version = {v.version: v for v in versions}
    served_version = {s.generation_id: s.version for s in pool.stats.served}
    persisted_version = dict(rows)
    mismatched = sum(1 for g, v in served_version.items() if persisted_version.get(g) != v)
    unregistered = sum(1 for v in persisted_version.values() if v not in by_version)
    shipped = []
    for version, seen in sorted(watcher.seen.items()):
        info = by_version[version]
        shipped.append(
            {
                "version": version,
                "kind": info.kind,
                "parent": info.parent,
                "bytes": info.bytes,
                "full_bytes": info.full_bytes,
                "pct_of_full": round(100.0 * info.bytes / info.full_bytes, 3),
                "fraction_changed": info.fraction_changed,
                "sha256": info.sha256,
                "verified_on_node": seen["sha256"] == info.sha256,
                "live_at_s": round(seen["t"], 1),
            }
        )

    print("flywheel demo: evaluating shipped versions on held-out problems", flush=True)
    live_versions = [s["version"] for s in shipped]
    eval_versions = pick_spread(live_versions, 8)
    heldout = _evaluate_versions(settings, registry, eval_versions, options.seed, pool.sampling)
    trainable = _trainable_tokens(registry, versions)
    served_success = _served_success_by_version(pool)
    summary = {
        "quick": options.quick,
        "lr": settings.trainer.lr,
        "traffic_minutes": options.traffic_minutes,
        "users": n_users,
        "sessions": pool.stats.sessions,
        "responses_received": received,
        "generations_captured": captured,
        "generations_persisted": persisted,
        "generations_version_mismatch": mismatched,
        "generations_unregistered_version": unregistered,
        "every_generation_names_its_version": mismatched == 0 and unregistered == 0 and persisted >= received,
        "feedback_sent": pool.stats.feedback_sent,
        "trajectories": trajectories,
        "scored_trajectories": scored,
        "client_errors": pool.stats.errors,
        "versions_published": len(versions),
        "versions_shipped": shipped,
        "deltas_shipped": sum(1 for s in shipped if s["kind"] == "delta"),
        "max_delta_pct_of_full": max((s["pct_of_full"] for s in shipped if s["kind"] == "delta"), default=None),
        "all_shipped_verified": all(s["verified_on_node"] for s in shipped),
        "heldout_n": HELDOUT_N,
        "heldout_by_version": {str(k): v for k, v in heldout.items()},
        "heldout_success_start": heldout[eval_versions[0]],
        "heldout_success_end": heldout[eval_versions[-1]],
        "sampling": pool.sampling,
        # Trainable completion tokens of the trajectories the trainer took, over all their completion
        # tokens (the rest: greedy turns, unsupported knobs, outside the support), from version metrics.
        "trainable_token_fraction": trainable["fraction"],
        "masked_tokens": trainable["masked"],
        "trained_tokens": trainable["trained"],
        "completion_tokens": trainable["completion"],
        "served_success_by_version": served_success,
        "rollout": rollout_summary(registry.transitions(), t_traffic_wall),
        "wall_seconds": round(time.monotonic() - t_start, 1),
    }
    _print_summary(summary)
    if options.json_path:
        Path(options.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json_path).write_text(json.dumps(summary, indent=2))
        print(f"summary written to {options.json_path}")
    if options.plot_path:
        _plot(options.plot_path, pool, shipped, heldout)
        print(f"plot written to {options.plot_path}")
    return 0


def pick_spread(versions: list[int], k: int) -> list[int]:
    """The first and last versions and up to k-2 evenly spaced between them."""
    if len(versions) <= k:
        return versions
    step = (len(versions) - 1) / (k - 1)
    return sorted({versions[round(i * step)] for i in range(k)})


def _drain(gateway: str, sessions: Any, generation_model: Any, received: int, timeout_s: float = 90.0) -> tuple[int, int]:
    """Wait until ingest persisted every captured generation; return (captured, persisted)."""
    from sqlalchemy import func, select

    deadline = time.monotonic() + timeout_s
    captured = persisted = 0
    while time.monotonic() < deadline:
        captured = int(_metric(httpx.get(f"{gateway}/metrics", timeout=5.0).text, "flywheel_generations_captured_total"))
        with sessions() as s:
            persisted = s.scalar(select(func.count()).select_from(generation_model)) or 0
        if persisted >= captured and captured >= received:
            break
        time.sleep(1.0)
    return captured, persisted


def _trainable_tokens(registry: Any, versions: list[Any]) -> dict[str, Any]:
    """Over every published version's metrics: trainable tokens / completion tokens of the
    trajectories trained, and the tokens left out by reason."""
    tokens = completion = 0
    masked: dict[str, int] = {}
    for info in versions:
        tokens += int(info.metrics.get("tokens", 0))
        completion += int(info.metrics.get("completion_tokens", 0))
        for reason, n in (info.metrics.get("masked_tokens") or {}).items():
            masked[reason] = masked.get(reason, 0) + int(n)
    return {"fraction": round(tokens / completion, 4) if completion else None, "masked": masked,
            "trained": tokens, "completion": completion}


def _served_success_by_version(pool: UserPool) -> dict[str, dict[str, float]]:
    out: dict[str, list[bool]] = {}
    for s in pool.stats.served:
        if s.attempt == 0:
            out.setdefault(str(s.version), []).append(s.correct)
    return {v: {"first_answers": len(xs), "success": round(sum(xs) / len(xs), 4)} for v, xs in out.items()}


def rollout_summary(transitions: list[dict[str, Any]], started: datetime) -> dict[str, Any]:
    """The controller's canaries from the audit log: each one's outcome and seconds (after traffic
    started) at canary and at its end; promotions with the canary's length, rollbacks by reason."""
    canaries: dict[int, dict[str, Any]] = {}
    direct = 0
    for t in transitions:
        at = round((t["at"] - started).total_seconds(), 1)
        if t["to_status"] == "canary":
            canaries[t["version"]] = {"version": t["version"], "canary_at_s": at, "outcome": "running"}
        elif t["version"] in canaries and canaries[t["version"]]["outcome"] == "running":
            run = canaries[t["version"]]
            run.update(outcome={"stable": "promoted", "rolled_back": "rolled_back"}.get(t["to_status"], t["to_status"]),
                       ended_at_s=at, canary_s=round(at - run["canary_at_s"], 1), reason=t["reason"][:300])
        elif t["to_status"] == "stable" and t["from_status"] == "candidate":
            direct += 1
    runs = list(canaries.values())
    promoted = [r for r in runs if r["outcome"] == "promoted"]
    rolled = [r for r in runs if r["outcome"] == "rolled_back"]
    return {
        "canaries": runs,
        "promotions": len(promoted),
        "direct_promotions": direct,
        "rollbacks_no_evidence": sum("no evidence of a win" in r["reason"] for r in rolled),
        "rollbacks_other": sum("no evidence of a win" not in r["reason"] for r in rolled),
        "seconds_to_promotion": [r["canary_s"] for r in promoted],
    }


def _progress(pool: UserPool, registry: Any, watcher: NodeWatcher, elapsed: float) -> None:
    served = list(pool.stats.served)
    recent = [s.correct for s in served if s.attempt == 0 and s.t >= served[-1].t - 30] if served else []
    rate = sum(recent) / len(recent) if recent else float("nan")
    latest = registry.latest()
    live = max(watcher.seen) if watcher.seen else None
    shipped = ""
    if latest is not None:
        share = 100 * latest.bytes / latest.full_bytes
        shipped = f"latest v{latest.version} {latest.kind} {latest.bytes / 1024:.0f} KiB ({share:.1f}% of full)"
    print(
        f"  t={elapsed:5.0f}s sessions={pool.stats.sessions:5d} answers={len(served):5d} "
        f"first-answer success (30s)={rate:5.1%} node v{live} | {shipped}",
        flush=True,
    )


def _print_summary(s: dict[str, Any]) -> None:
    print("\nflywheel demo summary")
    print(f"  wall time                 {s['wall_seconds']:.0f} s")
    print(f"  sessions / answers        {s['sessions']} / {s['responses_received']}")
    print(f"  generations captured      {s['generations_captured']}  persisted {s['generations_persisted']}")
    print(f"  every generation names its version: {s['every_generation_names_its_version']}")
    print(f"  versions published/shipped {s['versions_published']} / {len(s['versions_shipped'])} (deltas {s['deltas_shipped']})")
    print("  version  kind   bytes      % of full  verified  held-out")
    for v in s["versions_shipped"]:
        h = s["heldout_by_version"].get(str(v["version"]))
        print(
            f"  v{v['version']:<7d} {v['kind']:<6s} {v['bytes']:<10d} {v['pct_of_full']:>8.2f}%  "
            f"{str(v['verified_on_node']):<8s}  {'' if h is None else f'{h:.1%}'}"
        )
    print(f"  held-out success          {s['heldout_success_start']:.1%} -> {s['heldout_success_end']:.1%}"
          f"  (sampling {s['sampling']})")
    rollout = s["rollout"]
    if rollout["canaries"]:
        waits = rollout["seconds_to_promotion"]
        spans = f" (after {min(waits):.0f}-{max(waits):.0f} s as canary)" if waits else ""
        print(f"  canaries                  {len(rollout['canaries'])}: {rollout['promotions']} promoted{spans}, "
              f"{rollout['rollbacks_no_evidence']} rolled back for no evidence of a win, {rollout['rollbacks_other']} other")
    fraction = s["trainable_token_fraction"]
    print(f"  trainable tokens          {'n/a' if fraction is None else f'{fraction:.1%}'} of completion tokens trained"
          f"{'; left out: ' + str(s['masked_tokens']) if s['masked_tokens'] else ''}")


def first_answers(pool: UserPool) -> list[Served]:
    """Each session's first answer (a retry is not a fresh draw from the policy), in time order."""
    return sorted((s for s in pool.stats.served if s.attempt == 0), key=lambda s: s.t)


def _plot(path: str, pool: UserPool, shipped: list[dict[str, Any]], heldout: dict[int, float]) -> None:
    """Top: served first-answer success over time (rolling, and the mean of each version while it
    served). Bottom: held-out success of the evaluated versions, at the time each went live."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    served = first_answers(pool)
    window = max(20, len(served) // 30)
    if len(served) >= window:
        xs = [served[j].t for j in range(window - 1, len(served))]
        ys = [sum(p.correct for p in served[j - window + 1 : j + 1]) / window for j in range(window - 1, len(served))]
        ax1.plot(xs, ys, color="0.6", lw=1, label=f"rolling mean of {window} answers")
    by_version: dict[int, list[Any]] = {}
    for s in served:
        by_version.setdefault(s.version, []).append(s)
    cmap = plt.get_cmap("viridis", max(2, len(by_version)))
    for i, (_version, pts) in enumerate(sorted(by_version.items())):
        mean = sum(p.correct for p in pts) / len(pts)
        ax1.hlines(mean, pts[0].t, pts[-1].t, colors=[cmap(i)], lw=3)
    ax1.plot([], [], color=cmap(0), lw=3, label="mean of each serving version")
    ax1.set_ylabel("first-answer success (served)")
    ax1.set_title("reward over time, per serving version")
    ax1.legend(fontsize=8, loc="upper left")
    live_at = {s["version"]: s["live_at_s"] for s in shipped}
    points = [(live_at[v], heldout[v], v) for v in sorted(heldout) if v in live_at]
    ax2.plot([p[0] for p in points], [p[1] for p in points], "o-", label="held-out success of the version that went live")
    for x, y, v in points:
        ax2.annotate(f"v{v}", (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    ax2.set_xlabel("seconds since the demo started")
    ax2.set_ylabel("held-out success")
    ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
