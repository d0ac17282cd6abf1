"""How fast a new version reaches a multi-region fleet, and how many bytes cross region boundaries.

``--nodes`` real ``flywheel node`` processes (the tiny model), spread over ``--regions`` regions.
The trainer's store is the origin; each region has a cache folder its nodes share
(``store.cache_path``), so a version crosses into a region once (``RegionalCache``). The fleet
starts on version 0 (a full checkpoint, pulled once per region, not measured). Then the bench
publishes version 1 as a delta (a synthetic training step: ``--changed`` of the bf16 elements move
by one ULP, as an RL step with small learning rates does) and promotes it to stable:

- ``publish_to_all_nodes_s``: from the promotion until every node reports version 1 live in the
  ``nodes`` table. With ``--live redis`` (the default when Redis answers on 127.0.0.1:6379) the
  promotion wakes the nodes through Redis pub/sub; with ``--live memory`` they find it at their
  next registry poll (every ``--poll`` seconds);
- ``cross_region_bytes``: what the regions' caches pulled from the origin for version 1;
- ``full_checkpoint_bytes``: what shipping version 1 as a full checkpoint to every node would move
  (``full_checkpoint_per_region_bytes``: to every region, with the same caches).

    .venv/bin/python -m bench.rollout --nodes 4 --regions 2 --json out/rollout.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from testbed.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
LINE = "bench-rollout"


def cache_bytes(folder: Path) -> int:
    # Objects only: not the locks nor the pull ledger (hidden names, see flywheel.weights.store).
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def synthetic_step(state: dict[str, torch.Tensor], changed: float, seed: int) -> dict[str, torch.Tensor]:
    """``changed`` of every bf16 tensor's elements move one ULP up or down; the rest is copied."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.dtype != torch.bfloat16:
            out[name] = t.clone()
            continue
        bits = t.clone().view(torch.int16)
        moved = torch.rand(bits.shape, generator=g) < changed
        step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        out[name] = torch.where(moved, bits + step, bits).view(torch.bfloat16)
    return out


def _redis_answers() -> bool:
    import redis

    try:
        return bool(redis.Redis(socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def node_config(tmp: Path, i: int, region: str, model_dir: Path, poll_s: float, live: dict[str, str]) -> Path:
    path = tmp / f"node-{i}.json"
    path.write_text(json.dumps({
        "data_dir": str(tmp / f"node-{i}"),
        "db": {"url": f"sqlite:///{tmp / 'fleet.db'}"},
        "store": {"path": str(tmp / "origin"), "cache_path": str(tmp / f"cache-{region}")},
        "model": {"line": LINE, "path": str(model_dir)},
        "node": {"port": free_port(), "node_id": f"node-{i}", "region": region, "poll_s": poll_s},
        "live": live,
        "log_level": "WARNING",
    }))
    return path


def live_versions(url: str) -> dict[str, int | None]:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(text("SELECT node_id, live_version FROM nodes WHERE model_line = :l"),
                                     {"l": LINE}).all())
    finally:
        engine.dispose()


def wait_for(what: str, check: Any, timeout_s: float, procs: list[subprocess.Popen], every_s: float = 0.02) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if check():
            return time.perf_counter()
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} node(s) exited while waiting for {what}")
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from demo.tinymodel.build import ensure_default_model
    from flywheel.db.session import make_engine, make_session_factory, upgrade
    from flywheel.settings import load_settings
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import FolderStore
    from serving.rollout_actions import node_waker

    regions = [f"region-{chr(ord('a') + r)}" for r in range(args.regions)]
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = ensure_default_model(args.model_cache, quick=True)
        db_url = f"sqlite:///{tmp / 'fleet.db'}"
        upgrade(db_url)
        engine = make_engine(db_url)
        live = {"kind": args.live, "key_prefix": f"bench-rollout-{os.getpid()}:"}
        waker = node_waker(load_settings(None, live=live, model={"line": LINE}))
        registry = Registry(make_session_factory(engine), FolderStore(tmp / "origin"), LINE, announce=waker)
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for i in range(args.nodes):
                config = node_config(tmp, i, regions[i % len(regions)], model_dir, args.poll, live)
                log = open(tmp / f"node-{i}.log", "wb")
                logs.append(log)
                procs.append(subprocess.Popen([sys.executable, "-m", "launch.cli", "--config", str(config), "node"],
                                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"}))
                if i == 0:  # the first node publishes the base model as version 0; the rest find it
                    wait_for("version 0", lambda: live_versions(db_url).get("node-0") == 0, args.timeout, procs)
            wait_for("every node on version 0", lambda: list(live_versions(db_url).values()) == [0] * args.nodes,
                     args.timeout, procs)
            before = {r: cache_bytes(tmp / f"cache-{r}") for r in regions}

            base = registry.load(0)
            info = registry.publish(synthetic_step(base, args.changed, args.seed), parent=0, parent_state=base,
                                    train_step=1)
            assert info.kind == "delta", info
            promoted = time.perf_counter()
            registry.set_status(info.version, "stable", reason="bench: promote")
            done = wait_for("every node on version 1",
                            lambda: list(live_versions(db_url).values()) == [info.version] * args.nodes,
                            args.timeout, procs)
            pulled = {r: cache_bytes(tmp / f"cache-{r}") - before[r] for r in regions}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            for log in logs:
                log.close()
            engine.dispose()
        return {
            "nodes": args.nodes,
            "regions": args.regions,
            "poll_s": args.poll,
            "live": args.live,
            "version": info.version,
            "kind": info.kind,
            "delta_bytes": info.bytes,
            "fraction_changed": info.fraction_changed,
            "publish_to_all_nodes_s": done - promoted,
            "cross_region_bytes": sum(pulled.values()),
            "cross_region_bytes_by_region": pulled,
            "full_checkpoint_bytes": info.full_bytes * args.nodes,
            "full_checkpoint_per_region_bytes": info.full_bytes * args.regions,
            "full_bytes": info.full_bytes,
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--changed", type=float, default=0.02, help="share of bf16 elements the new version moves")
    parser.add_argument("--poll", type=float, default=1.0, help="node.poll_s: how often nodes look at the registry")
    parser.add_argument("--live", choices=["redis", "memory"], default=None,
                        help="how nodes learn of a promotion: redis pub/sub, or memory (their poll only); "
                             "default: redis when it answers on 127.0.0.1:6379")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=ROOT / ".flywheel" / "models")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.live is None:
        args.live = "redis" if _redis_answers() else "memory"
    if args.nodes < args.regions or args.regions < 1:
        parser.error("need at least one node per region")
    result = run(args)
    print(f"{'nodes':>5} {'regions':>7} {'live':>7} {'changed':>8} {'publish -> all nodes':>21} "
          f"{'cross-region bytes':>19} {'full to every node':>19} {'ratio':>7}")
    print(f"{result['nodes']:>5} {result['regions']:>7} {result['live']:>7} {100 * (result['fraction_changed'] or 0):>7.2f}% "
          f"{result['publish_to_all_nodes_s']:>19.2f} s {result['cross_region_bytes']:>19,} "
          f"{result['full_checkpoint_bytes']:>19,} {result['cross_region_bytes'] / result['full_checkpoint_bytes']:>7.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
