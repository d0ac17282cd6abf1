"""What the gateway costs: direct-to-upstream vs through the gateway, in one run, same load.

Three processes on this machine: the canned upstream (:mod:`bench.upstream`, vLLM-shaped
responses, ``--delay-ms`` of simulated decode per completion), ``flywheel gateway --upstream``
in front of it on embedded defaults (local-log bus, write-ahead spool, in-process state), and this
load generator: ``concurrency`` keep-alive connections, each sending the next chat completion as
soon as the last one answered, for ``--seconds`` per level after a warm-up.

Per level it reports p50/p99 latency direct and through the gateway, the added latency (gateway
percentile minus direct percentile), and both throughputs. After the last level the gateway gets
SIGTERM (it drains and ships its spool), then the generations topic is read back: the capture
ratio is (distinct generation events on the bus whose id a client received) / (responses received,
warm-up included);
``duplicates`` counts records of one event beyond the first (consumers dedup by event id),
``orphans`` counts events whose id no client received.

    .venv/bin/python -m bench.gateway --json /tmp/gateway.json
    .venv/bin/python -m bench.gateway --delay-ms 0 --levels 1 16 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.profiling import cpu_seconds
from testbed.procs import free_port

REQUEST = {
    "model": "tiny-sim",
    "messages": [
        {"role": "system", "content": "You are a careful assistant that sorts letters."},
        {"role": "user", "content": "sort: q w e r t y u i o p a s d f g h j k l"},
    ],
    "max_tokens": 32,
    "temperature": 1.0,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1))))]


# Load -------------------------------------------------------------------------------------------


async def _connection(port: int, request: bytes, deadline: float, record: bool,
                      latencies: list[float], generations: list[str], errors: list[str]) -> None:
    """One keep-alive connection sending requests back to back; ``record`` False (warm-up) keeps
    only the generation ids."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length, generation, status = 0, None, int(head[9:12])
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"x-flywheel-generation":
                    generation = value.strip().decode()
            await reader.readexactly(length)
            elapsed = time.perf_counter() - start
            if status == 200 and generation is not None:
                generations.append(generation)
            if not record:
                continue
            if status != 200:
                errors.append(str(status))
                continue
            latencies.append(elapsed)
    finally:
        writer.close()


async def _load(port: int, concurrency: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    body = json.dumps(REQUEST).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    latencies: list[float] = []
    generations: list[str] = []
    errors: list[str] = []
    if warmup_s:
        deadline = time.perf_counter() + warmup_s
        await asyncio.gather(*(_connection(port, request, deadline, False, [], generations, [])
                               for _ in range(concurrency)))
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(_connection(port, request, deadline, True, latencies, generations, errors)
                           for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"latencies": latencies, "generations": generations, "errors": errors, "rps": len(latencies) / wall}



def load(port: int, concurrency: int, seconds: float, warmup_s: float = 1.0) -> dict[str, Any]:
    try:
        import uvloop

        return uvloop.run(_load(port, concurrency, seconds, warmup_s))
    except ImportError:
        return asyncio.run(_load(port, concurrency, seconds, warmup_s))


# Processes --------------------------------------------------------------------------------------


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_upstream(port: int, delay_ms: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "bench.upstream", "--port", str(port), "--delay-ms", str(delay_ms)])
    _wait_http(f"http://127.0.0.1:{port}/v1/models")
    return proc


def start_gateway(port: int, upstream_port: int, data_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    full_env = {**os.environ, "FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_LOG_LEVEL": "WARNING", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "gateway", "--upstream", f"http://127.0.0.1:{upstream_port}",
         "--port", str(port)],
        env=full_env,
    )
    _wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def captured(data_dir: Path, env: dict[str, str]) -> dict[str, list[str]]:
    """generation_id -> event ids of every record on the generations topic."""
    from flywheel.bus import make_bus
    from flywheel.settings import load_settings

    old = dict(os.environ)
    os.environ.update({"FLYWHEEL_DATA_DIR": str(data_dir), **env})
    try:
        settings = load_settings()
    finally:
        os.environ.clear()
        os.environ.update(old)
    bus = make_bus(settings)
    consumer = bus.consumer(f"bench-{time.time_ns()}", [settings.topic("generations")])
    out: dict[str, list[str]] = {}
    idle = 0
    try:
        while idle < 3:
            records = consumer.poll(timeout_s=1.0, max_records=5000)
            idle = 0 if records else idle + 1
            for record in records:
                event = json.loads(record.value)
                out.setdefault(event["generation_id"], []).append(event["event_id"])
    finally:
        consumer.close()
        bus.close()
    return out


# The run ----------------------------------------------------------------------------------------


def run(levels: list[int], seconds: float, delay_ms: float, env: dict[str, str]) -> dict[str, Any]:
    upstream_port, gateway_port = free_port(), free_port()
    rows: list[dict[str, Any]] = []
    received: list[str] = []
    errors = 0
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        data_dir = Path(tmp)
        upstream = start_upstream(upstream_port, delay_ms)
        try:
            gateway = start_gateway(gateway_port, upstream_port, data_dir, env)
            try:
                for concurrency in levels:
                    direct = load(upstream_port, concurrency, seconds)
                    warm = load(gateway_port, concurrency, 1.0, warmup_s=0)  # its responses count for capture
                    received += warm["generations"]
                    cpu_before = cpu_seconds(gateway.pid)
                    through = load(gateway_port, concurrency, seconds, warmup_s=0)
                    cpu = cpu_seconds(gateway.pid) - cpu_before
                    received += through["generations"]
                    errors += len(through["errors"]) + len(direct["errors"])
                    row = {
                        "concurrency": concurrency,
                        "direct_p50_ms": percentile(direct["latencies"], 50) * 1e3,
                        "direct_p99_ms": percentile(direct["latencies"], 99) * 1e3,
                        "gateway_p50_ms": percentile(through["latencies"], 50) * 1e3,
                        "gateway_p99_ms": percentile(through["latencies"], 99) * 1e3,
                        "direct_rps": direct["rps"],
                        "gateway_rps": through["rps"],
                        "responses": len(through["latencies"]),
                        "gateway_cpu_us_per_request": cpu / max(1, len(through["latencies"])) * 1e6,
                        "errors": len(through["errors"]),
                    }
                    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
                    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
                    rows.append(row)
                    print(_row(row), flush=True)
            finally:
                exit_code = stop(gateway)
        finally:
            stop(upstream, 10)
        events = captured(data_dir, env)
    got = set(received)
    persisted_once = sum(1 for g in got if len(set(events.get(g, ()))) == 1)
    return {
        "delay_ms": delay_ms,
        "seconds_per_level": seconds,
        "levels": rows,
        "responses": len(received),
        "distinct_generation_ids": len(got),
        "persisted": persisted_once,
        "capture_ratio": persisted_once / len(received) if received else 0.0,
        "duplicates": sum(len(ids) - 1 for ids in events.values()),
        "distinct_event_ids_per_generation_max": max((len(set(ids)) for ids in events.values()), default=0),
        "orphans": sum(1 for g in events if g not in got),
        "errors": errors,
        "gateway_exit_code": exit_code,
    }


HEADER = (f"{'conc':>4} {'direct p50':>10} {'p99':>7} {'gateway p50':>11} {'p99':>7} {'added p50':>9} "
          f"{'p99':>7} {'direct rps':>10} {'gw rps':>7} {'gw cpu us/req':>13}")


def _row(r: dict[str, Any]) -> str:
    return (f"{r['concurrency']:>4} {r['direct_p50_ms']:>10.2f} {r['direct_p99_ms']:>7.2f} {r['gateway_p50_ms']:>11.2f} "
            f"{r['gateway_p99_ms']:>7.2f} {r['added_p50_ms']:>9.2f} {r['added_p99_ms']:>7.2f} "
            f"{r['direct_rps']:>10.0f} {r['gateway_rps']:>7.0f} {r['gateway_cpu_us_per_request']:>13.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="simulated decode time of the upstream")
    parser.add_argument("--env", action="append", default=[], metavar="FLYWHEEL_X=V",
                        help="settings for the gateway (e.g. FLYWHEEL_GATEWAY__CAPTURE_ACK=fsynced)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    print(f"upstream delay {args.delay_ms} ms, {args.seconds} s per level; latencies in ms")
    print(HEADER, flush=True)
    result = run(args.levels, args.seconds, args.delay_ms, env)
    print(f"responses {result['responses']}, persisted once {result['persisted']}, capture ratio "
          f"{result['capture_ratio']:.4f}, duplicates {result['duplicates']}, orphans {result['orphans']}, "
          f"errors {result['errors']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
