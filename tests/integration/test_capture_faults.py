"""Capture under real faults: the gateway is a subprocess (``python -m launch.cli gateway``) in
front of the canned OpenAI upstream (``bench/upstream.py``), shipping to a Tansu broker, while
client threads keep sending chat completions (plain and streamed), each in its own session.

Faults: the broker frozen (SIGSTOP: every request to it times out) and then killed and restarted;
the gateway killed with SIGKILL while events wait in its spool, then restarted on the same spool;
SIGTERM under load (with the bus up, and with the bus down). After recovery the generations
topic is read back and checked against what every client saw:

- a response that carried ``X-Flywheel-Generation`` (a stream: that reached ``[DONE]``) has
  exactly one generation event, after dedup by ``event_id`` (the bus is at-least-once);
- a request answered with an error (HTTP status, or a stream that ended in an error event) has
  none; so has one whose connection failed, except when the gateway was SIGKILLed under it (the
  event may then be spooled with nobody told: at most one);
- every event belongs to a request a client made.

Tansu keeps topics in memory, so a killed broker comes back empty. To check what was on it, the
test reads the topic just before the kill with the gateway paused (SIGSTOP), so nothing is
acknowledged between that read and the kill; records the gateway had in flight are in its spool
and are replayed to the new broker. The union of both reads is what a durable broker would hold.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.upstream import running as running_upstream
from flywheel.bus.base import Record
from flywheel.bus.envelope import Reassembler
from flywheel.events import GenerationEvent
from serving.gateway.spool import Spool
from serving.protocol import GENERATION_HEADER, SESSION_HEADER
from testbed.broker import TansuBroker, start_tansu
from testbed.procs import free_port
from tests.fixtures.roles import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny-sim", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 8}


# The gateway process ----------------------------------------------------------------------------


class GatewayProcess:
    """``flywheel gateway`` as a child process; same data dir (spool) and port across restarts."""

    def __init__(self, data_dir: Path, upstream: str, bootstrap: str, prefix: str, **gateway: Any) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstream = upstream
        self.log_path = data_dir.parent / f"gateway-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        env.update(
            PYTHONPATH=str(REPO),
            FLYWHEEL_DATA_DIR=str(data_dir),
            FLYWHEEL_LOG_LEVEL="INFO",
            FLYWHEEL_BUS__KIND="kafka",
            FLYWHEEL_BUS__BOOTSTRAP_SERVERS=bootstrap,
            FLYWHEEL_BUS__TOPIC_PREFIX=prefix,
            FLYWHEEL_GATEWAY__SHIP_TIMEOUT_S="1",
        )
        env.update({f"FLYWHEEL_GATEWAY__{k.upper()}": str(v) for k, v in gateway.items()})
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "gateway", "--port", str(self.port),
                 "--upstream", self.upstream],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200

        wait_until("the gateway to answer /health", ready, timeout_s=60)
        return self

    def depth(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=5).json()["capture"]

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def drained(self, timeout_s: float = 60) -> None:
        wait_until("the spool to drain to the bus", lambda: self.depth()["events"] == 0 and self.depth()["bus_up"],
                   timeout_s=timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


# Client load ------------------------------------------------------------------------------------


@dataclass
class Result:
    session: str
    stream: bool
    started: float
    ended: float = 0.0
    status: int | None = None
    generation: str | None = None
    done: bool = False  # a stream reached [DONE]
    error: str | None = None  # the connection failed

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.generation is not None and (self.done or not self.stream)

    @property
    def refused(self) -> bool:
        """Answered, and not with a generation: nothing may be recorded."""
        return self.status is not None and self.error is None and not self.ok


class Load:
    """``workers`` threads, each sending the next request (every third one streamed) when the last ended."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.url = url
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(workers)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _work(self, worker: int) -> None:
        with httpx.Client(timeout=15) as client:
            i = 0
            while not self._stop.is_set():
                result = Result(f"w{worker}-{i}-{uuid.uuid4().hex[:6]}", stream=i % 3 == 2, started=time.monotonic())
                try:
                    self._one(client, result)
                except httpx.HTTPError as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                    time.sleep(0.05)  # the gateway is down: do not spin
                result.ended = time.monotonic()
                with self._lock:
                    self.results.append(result)
                i += 1

    def _one(self, client: httpx.Client, result: Result) -> None:
        headers = {SESSION_HEADER: result.session}
        url = f"{self.url}/v1/chat/completions"
        if not result.stream:
            response = client.post(url, json=BODY, headers=headers)
            result.status = response.status_code
            result.generation = response.headers.get(GENERATION_HEADER) if response.status_code == 200 else None
            return
        with client.stream("POST", url, json={**BODY, "stream": True}, headers=headers) as response:
            result.status = response.status_code
            result.generation = response.headers.get(GENERATION_HEADER) if response.status_code == 200 else None
            for line in response.iter_lines():
                if line.strip() == "data: [DONE]":
                    result.done = True

    def snapshot(self) -> list[Result]:
        with self._lock:
            return list(self.results)

    def successes_since(self, t: float) -> int:
        return sum(1 for r in self.snapshot() if r.ok and r.started >= t)


# Reading the topic back -------------------------------------------------------------------------


def read_generations(bootstrap: str, topic: str, timeout_s: float = 60) -> list[GenerationEvent]:
    """Every generation event on ``topic`` now (up to the end offsets at the start), reassembled."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             request_timeout_ms=10_000)
    try:
        partitions = wait_until(f"partitions of {topic}", lambda: consumer.partitions_for_topic(topic), timeout_s=30)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        reassembler = Reassembler()
        events = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end offsets {end}"
            for messages in consumer.poll(timeout_ms=500).values():
                for m in messages:
                    headers = {k: v.decode() for k, v in m.headers or []}
                    record = Record(m.topic, m.partition, m.offset, m.key and m.key.decode(), m.value, headers)
                    whole = reassembler.feed(record)
                    if whole is not None:
                        events.append(GenerationEvent.from_bytes(whole.value))
        return events
    finally:
        consumer.close()


def check(results: list[Result], events: list[GenerationEvent], *, killed: bool = False) -> dict[str, int]:
    """The promise (see the module docstring); returns the counts, for the assertion messages."""
    by_generation: dict[str, set[str]] = defaultdict(set)
    by_session: dict[str, set[str]] = defaultdict(set)
    for event in events:
        by_generation[event.generation_id].add(event.event_id)
        by_session[event.session_id].add(event.event_id)
    ok = [r for r in results if r.ok]
    refused = [r for r in results if r.refused]
    broken = [r for r in results if r.error is not None]
    assert ok, "no request succeeded"
    missing = [r.session for r in ok if len(by_generation[r.generation]) != 1 or len(by_session[r.session]) != 1]
    assert not missing, f"{len(missing)} of {len(ok)} answered generations lack exactly one event: {missing[:5]}"
    recorded = [r.session for r in refused if by_session[r.session]]
    assert not recorded, f"requests answered with an error have events: {recorded[:5]}"
    limit = 1 if killed else 0
    extra = [r.session for r in broken if len(by_session[r.session]) > limit]
    assert not extra, f"requests whose connection failed have too many events: {extra[:5]}"
    strangers = set(by_session) - {r.session for r in results}
    assert not strangers, f"events for requests nobody made: {sorted(strangers)[:5]}"
    return {"ok": len(ok), "refused": len(refused), "broken": len(broken), "events": len(events),
            "distinct": len({e.event_id for e in events})}


# Fixtures ---------------------------------------------------------------------------------------


@dataclass
class Stack:
    broker: TansuBroker
    upstream: str
    prefix: str
    tmp: Path

    @property
    def topic(self) -> str:
        return f"{self.prefix}generations"

    def gateway(self, **settings: Any) -> GatewayProcess:
        return GatewayProcess(self.tmp / "data", self.upstream, self.broker.bootstrap, self.prefix, **settings)


@contextmanager
def frozen(process: subprocess.Popen[bytes] | None) -> Iterator[None]:
    """SIGSTOP ``process`` for the block (a broker that hangs, or a gateway paused by the test)."""
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    port = free_port()
    broker = start_tansu(log_dir=tmp_path)
    try:
        with running_upstream(port, delay_ms=20):
            yield Stack(broker, f"http://127.0.0.1:{port}", f"cf{uuid.uuid4().hex[:8]}.", tmp_path)
    finally:
        if broker.process is not None:
            broker.process.send_signal(signal.SIGCONT)
        broker.stop()


# Tests ------------------------------------------------------------------------------------------


def test_broker_hangs_then_dies_and_returns_while_clients_keep_being_served(stack: Stack) -> None:
    gateway = stack.gateway().start()
    try:
        with Load(gateway.url) as load:
            wait_until("traffic", lambda: load.successes_since(0) >= 20, timeout_s=30)
            gateway.drained()  # shipping works

            # The broker hangs: requests to it time out; the gateway serves from its spool.
            with frozen(stack.broker.process):
                hung = time.monotonic()
                wait_until("a ship attempt to time out", lambda: not gateway.depth()["bus_up"], timeout_s=30)
                wait_until("serving during the hang", lambda: load.successes_since(hung) >= 20, timeout_s=30)
                assert gateway.depth()["events"] > 0
            gateway.drained()

            # The broker dies: read what it holds with the gateway paused, kill it, resume.
            with frozen(gateway.proc):
                before = read_generations(stack.broker.bootstrap, stack.topic)
                stack.broker.kill()
            down = time.monotonic()
            wait_until("the gateway to see the bus gone", lambda: not gateway.depth()["bus_up"], timeout_s=30)
            wait_until("serving while the broker is gone", lambda: load.successes_since(down) >= 40, timeout_s=30)
            assert gateway.depth()["events"] > 0
            stack.broker.start()
            gateway.drained()
        gateway.drained()
        assert gateway.metric("flywheel_capture_replayed_total") > 0
        after = read_generations(stack.broker.bootstrap, stack.topic)
    finally:
        gateway.stop()
    counts = check(load.results, before + after)
    assert counts["refused"] == counts["broken"] == 0, counts  # nobody noticed the outages


def test_a_gateway_killed_with_events_in_its_spool_ships_them_after_restart(stack: Stack) -> None:
    gateway = stack.gateway().start()
    try:
        with Load(gateway.url) as load:
            wait_until("traffic", lambda: load.successes_since(0) >= 20, timeout_s=30)
            with frozen(stack.broker.process):  # events pile up in the spool
                wait_until("events waiting in the spool", lambda: gateway.depth()["events"] >= 20, timeout_s=30)
                gateway.signal(signal.SIGKILL)
                gateway.wait(10)
                restarted = gateway.start()
                back = time.monotonic()
                assert restarted.depth()["events"] >= 20  # the new process found them
            wait_until("serving after the restart", lambda: load.successes_since(back) >= 20, timeout_s=30)
        gateway.drained()
        assert gateway.metric("flywheel_capture_replayed_total") >= 20
        events = read_generations(stack.broker.bootstrap, stack.topic)
    finally:
        gateway.stop()
    counts = check(load.results, events, killed=True)
    assert counts["refused"] == 0, counts


def test_sigterm_drains_in_flight_requests_and_ships_the_spool(stack: Stack) -> None:
    gateway = stack.gateway(drain_timeout_s=20).start()
    try:
        with Load(gateway.url, workers=6) as load:
            wait_until("traffic", lambda: load.successes_since(0) >= 30, timeout_s=30)
            term = time.monotonic()
            gateway.signal(signal.SIGTERM)
            assert gateway.wait(30) == 0, gateway.log_tail()
            exited = time.monotonic()
            time.sleep(0.3)  # clients keep trying: refused connections
    finally:
        gateway.stop()
    results = load.snapshot()
    in_flight = [r for r in results if r.started < term < r.ended]
    assert in_flight and all(r.ok for r in in_flight), [r for r in in_flight if not r.ok][:3]
    assert any(r.error for r in results if r.started > exited)  # it really stopped listening
    spool = Spool(gateway.data_dir / "spool" / "gateway-0")
    spool.open()
    assert spool.events == 0  # everything reached the bus before exit
    spool.close()
    counts = check(results, read_generations(stack.broker.bootstrap, stack.topic))
    assert counts["refused"] == 0, counts


def test_sigterm_with_the_bus_down_keeps_the_spool_for_the_next_start(stack: Stack) -> None:
    gateway = stack.gateway(drain_timeout_s=20).start()
    try:
        with Load(gateway.url) as load:
            wait_until("traffic", lambda: load.successes_since(0) >= 10, timeout_s=30)
            with frozen(stack.broker.process):
                wait_until("events waiting in the spool", lambda: gateway.depth()["events"] >= 20, timeout_s=30)
                term = time.monotonic()
                gateway.signal(signal.SIGTERM)
                assert gateway.wait(30) == 0, gateway.log_tail()
                assert time.monotonic() - term < 15  # the bus is down: no point waiting it out
                load.stop()
                left = Spool(gateway.data_dir / "spool" / "gateway-0")
                left.open()
                assert left.events >= 20
                left.close()
        gateway.start()
        gateway.drained()
        events = read_generations(stack.broker.bootstrap, stack.topic)
    finally:
        gateway.stop()
    check(load.results, events)


def test_a_second_gateway_on_the_same_spool_refuses_to_start(stack: Stack) -> None:
    first = stack.gateway().start()
    second = stack.gateway()
    try:
        with pytest.raises(AssertionError, match="exited with 3"):
            second.start()
        assert f"is in use by another gateway process (pid {first.proc.pid})" in second.log_tail(80)
    finally:
        second.stop()
        first.stop()


def test_large_events_are_split_on_the_bus_and_ingested_whole(tmp_path: Path) -> None:
    """Events over ``max_record_bytes`` travel as compressed chunks; the ingest worker stores them whole."""
    import random

    from sqlalchemy import select

    from flywheel.bus import make_bus
    from flywheel.db.models import Feedback, Generation
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.settings import load_settings
    from ingest.worker import run as run_ingest
    from serving.gateway.main import run as run_gateway
    from tests.fixtures.roles import RoleThread

    upstream_port = free_port()
    settings = load_settings(
        data_dir=str(tmp_path),
        bus={"kind": "local", "partitions": 2, "topic_prefix": f"lg{uuid.uuid4().hex[:8]}."},
        gateway={"port": free_port(), "upstream": f"http://127.0.0.1:{upstream_port}", "max_record_bytes": 1024},
    )
    stop = threading.Event()
    roles = [RoleThread("gateway", run_gateway, settings, stop), RoleThread("ingest", run_ingest, settings, stop)]
    url = f"http://127.0.0.1:{settings.gateway.port}"
    comment = "".join(random.choice("abcdefghij klmnop") for _ in range(8000))
    with running_upstream(upstream_port, prompt_tokens=3000) as upstream:
        try:
            for role in roles:
                role.start()
            wait_until("the gateway", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200)
            generations = []
            with httpx.Client(timeout=15) as client:
                for i in range(5):
                    response = client.post(f"{url}/v1/chat/completions", json=BODY,
                                           headers={SESSION_HEADER: f"big-{i}"})
                    assert response.status_code == 200, response.text
                    generations.append(response.headers[GENERATION_HEADER])
                response = client.post(f"{url}/v1/feedback", json={
                    "feedback_id": "fb-big", "session_id": "big-0", "generation_id": generations[0],
                    "kind": "explicit", "signal": "comment", "comment": comment})
                assert response.status_code == 202, response.text

            sessions = make_session_factory(make_engine(settings.database_url))

            def stored() -> bool:
                with sessions() as db:
                    return (len(db.scalars(select(Generation)).all()) == 5
                            and db.scalars(select(Feedback)).first() is not None)

            wait_until("the ingest worker to store every event", stored, timeout_s=60)
            with sessions() as db:
                rows = {g.generation_id: g.payload for g in db.scalars(select(Generation))}
                feedback = db.scalars(select(Feedback)).one()
            assert sorted(rows) == sorted(generations)
            assert all(p["prompt_token_ids"] == upstream.prompt_ids for p in rows.values())
            assert feedback.payload["comment"] == comment
        finally:
            stop.set()
            for role in roles:
                role.join(timeout=30)
    for role in roles:
        assert not role.is_alive() and role.error is None, (role.name, role.error)
    consumer = make_bus(settings).consumer("raw", [settings.topic("generations"), settings.topic("feedback")])
    raw: list[Record] = []
    try:
        wait_until("the raw records", lambda: raw.extend(consumer.poll(0.5)) or len(raw) > 6, timeout_s=30)
    finally:
        consumer.close()
    assert all(len(r.value) + sum(len(k) + len(v) for k, v in r.headers.items()) <= 1024 for r in raw)
    assert {r.headers.get("fw.chunk", "").split("/")[-1] for r in raw} - {""}  # chunked, not truncated
