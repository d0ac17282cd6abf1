"""Streaming (SSE) and text completions through the gateway, over real HTTP, captured once.

One node + gateway pair per module (the real entry points in threads, a local-log bus, SQLite:
the database is not what these tests exercise), and a gateway in front of a deliberately faulty
OpenAI-compatible upstream (a real HTTP server) for the streams that break off. Every test uses
its own sessions and finds its events by generation id, so tests share the stack safely.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from flywheel import lm
from flywheel.bus import make_bus
from flywheel.events import GenerationEvent
from flywheel.settings import Settings, load_settings
from testbed.procs import free_port
from tests.fixtures.roles import MESSAGES, RefusingProducer, RoleThread, served_app, wait_until

pytestmark = pytest.mark.integration


@dataclass
class Served:
    settings: Settings
    gateway: str
    node: str | None
    bus: Any

    def events(self, generation_ids: list[str], timeout_s: float = 10.0) -> dict[str, list[GenerationEvent]]:
        """Every recorded event of these generations (a fresh consumer group reads the whole topic)."""
        import time

        consumer = self.bus.consumer(f"check-{uuid.uuid4().hex[:8]}", [self.settings.topic("generations")])
        found: dict[str, list[GenerationEvent]] = {g: [] for g in generation_ids}
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                records = consumer.poll(timeout_s=0.2, max_records=1000)
                for record in records:
                    event = GenerationEvent.from_bytes(record.value)
                    if event.generation_id in found:
                        found[event.generation_id].append(event)
                if (not records and all(found.values())) or time.monotonic() > deadline:
                    return found
        finally:
            consumer.close()


@contextlib.contextmanager
def running_stack(data_dir: Path, model_dir: Path, *, node: bool = True, **gateway: Any) -> Iterator[Served]:
    """The node (optional) and the gateway through their entry points until the block ends."""
    from flywheel.db.session import upgrade
    from serving.gateway.main import run as run_gateway
    from serving.node.main import run as run_node

    db_url = f"sqlite:///{data_dir / 'db' / 'flywheel.db'}"
    upgrade(db_url)
    settings = load_settings(
        data_dir=str(data_dir),
        db={"url": db_url, "wait_s": 10},
        bus={"kind": "local", "partitions": 2, "topic_prefix": f"st-{uuid.uuid4().hex[:8]}."},
        model={"path": str(model_dir)},
        node={"port": free_port(), "poll_s": 0.5, "node_id": "node-st", "max_new_tokens": 16},
        gateway={"port": free_port(), **gateway},
    )
    stop = threading.Event()
    roles = [RoleThread("gateway", run_gateway, settings, stop)]
    roles += [RoleThread("node", run_node, settings, stop)] if node else []
    bus = make_bus(settings)
    node_url = f"http://127.0.0.1:{settings.node.port}"
    gateway_url = f"http://127.0.0.1:{settings.gateway.port}"
    try:
        for role in roles:
            role.start()

        def up(url: str, role: RoleThread) -> bool:
            if role.error is not None:
                raise AssertionError(f"{role.name} failed to start: {role.error!r}") from role.error
            return httpx.get(url, timeout=2).status_code == 200

        if node:
            wait_until("the node", lambda: up(f"{node_url}/health", roles[1]), timeout_s=120)
        wait_until("the gateway", lambda: up(f"{gateway_url}/health", roles[0]))
        yield Served(settings, gateway_url, node_url if node else None, bus)
    finally:
        stop.set()
        for role in roles:
            role.join(timeout=30)
        bus.close()
    for role in roles:
        assert not role.is_alive() and role.error is None, (role.name, role.error)


def sse(response: httpx.Response) -> list[Any]:
    """The data of every event of a streamed response: parsed JSON, or the string ``[DONE]``."""
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def stream(client: httpx.Client, url: str, body: dict[str, Any], **headers: str) -> tuple[httpx.Response, list[Any]]:
    with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        assert response.headers["content-type"].startswith("text/event-stream")
        return response, sse(response)


# Through the real node ---------------------------------------------------------------------------


def test_a_stream_is_relayed_whole_and_captured_once(served, tokenizer):
    body = {"messages": MESSAGES, "max_tokens": 12, "seed": 7, "stream": True, "logprobs": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client:
        r, events = stream(client, f"{served.gateway}/v1/chat/completions", body, **{"X-Flywheel-Session": "st-1"})
        assert r.status_code == 200
        assert r.headers["X-Flywheel-Session"] == "st-1" and r.headers["X-Flywheel-Model-Version"] == "0"
        generation = r.headers["X-Flywheel-Generation"]
        # The same seeded request without streaming: the stream is the same completion, cut up.
        plain = client.post(f"{served.gateway}/v1/chat/completions",
                            json={k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        assert plain.status_code == 200

    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *content_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    assert all(c["usage"] is None for c in content_chunks)
    assert content_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content_chunks[0]["prompt_token_ids"] == lm.chat_prompt_ids(tokenizer, MESSAGES)
    finishes = [c["choices"][0]["finish_reason"] for c in content_chunks]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}

    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content_chunks)
    ids: list[int] = []
    logprobs: list[float] = []
    for c in content_chunks:
        choice = c["choices"][0]
        entries = (choice["logprobs"] or {}).get("content") or []
        assert len(entries) == len(choice.get("token_ids") or [])  # aligned chunk by chunk
        ids += choice.get("token_ids") or []
        logprobs += [e["logprob"] for e in entries]
    assert len(ids) == usage_chunk["usage"]["completion_tokens"]
    assert text == lm.completion_text(tokenizer, ids)
    rich = plain.json()["choices"][0]
    assert (text, ids, logprobs) == (rich["message"]["content"], rich["token_ids"],
                                     [e["logprob"] for e in rich["logprobs"]["content"]])

    found = served.events([generation])[generation]
    assert len(found) == 1
    event = found[0]
    assert event.session_id == "st-1" and event.model_version == 0 and event.node_id == "node-st"
    assert event.completion_token_ids == ids and event.completion_logprobs == logprobs
    assert event.prompt_token_ids == content_chunks[0]["prompt_token_ids"]
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in event.completion_logprobs)
    assert event.finish_reason == finishes[-1] and event.sampling.seed == 7 and event.sampling.max_tokens == 12
    assert event.request == body  # the client's body, untouched
    assert event.response["object"] == "chat.completion"
    assert event.response["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert event.response["usage"] == usage_chunk["usage"]


def test_a_stream_loses_what_the_client_did_not_ask_for(served):
    body = {"messages": MESSAGES, "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=60) as client:
        r, events = stream(client, f"{served.gateway}/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["X-Flywheel-Session"]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks and all(len(c["choices"]) == 1 for c in chunks)  # no usage chunk
    for c in chunks:
        assert "usage" not in c and "prompt_token_ids" not in c
        choice = c["choices"][0]
        assert choice["logprobs"] is None and "token_ids" not in choice

    generation = r.headers["X-Flywheel-Generation"]
    (event,) = served.events([generation])[generation]
    # ... but the gateway asked the node for all of it, and recorded it.
    assert len(event.completion_token_ids) == len(event.completion_logprobs) in range(1, 9)
    assert event.session_id == r.headers["X-Flywheel-Session"]
    assert event.response["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_text_completions_are_served_and_captured(served, tokenizer):
    prompt = "sort: 3 1 2"
    prompt_ids = list(tokenizer.encode(prompt))
    with httpx.Client(timeout=60) as client:
        r = client.post(f"{served.gateway}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "seed": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and choice["logprobs"] is None
        assert "token_ids" not in choice and "prompt_token_ids" not in choice

        rich = client.post(f"{served.gateway}/v1/completions",
                           json={"prompt": prompt, "max_tokens": 6, "seed": 3, "logprobs": 0, "return_token_ids": True})
        assert rich.status_code == 200, rich.text
        rich_choice = rich.json()["choices"][0]
        assert rich_choice["text"] == choice["text"] and rich_choice["prompt_token_ids"] == prompt_ids
        assert len(rich_choice["logprobs"]["token_logprobs"]) == len(rich_choice["token_ids"])

        streamed, events = stream(client, f"{served.gateway}/v1/completions",
                                  {"prompt": prompt, "max_tokens": 6, "seed": 3, "stream": True,
                                   "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] == len(prompt_ids)
        assert "".join(c["choices"][0]["text"] for c in events[:-2]) == choice["text"]

        by_ids = client.post(f"{served.gateway}/v1/completions", json={"prompt": prompt_ids, "max_tokens": 6, "seed": 3})
        assert by_ids.status_code == 200 and by_ids.json()["choices"][0]["text"] == choice["text"]
        bad = client.post(f"{served.gateway}/v1/completions", json={"prompt": [10_000], "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        bad = client.post(f"{served.gateway}/v1/completions", json={"prompt": "x", "echo": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"

    generations = [x.headers["X-Flywheel-Generation"] for x in (r, rich, streamed, by_ids)]
    found = served.events(generations)
    assert [len(found[g]) for g in generations] == [1, 1, 1, 1]
    events_ = [found[g][0] for g in generations]
    for event in events_:
        assert event.prompt_token_ids == prompt_ids
        assert event.completion_token_ids == rich_choice["token_ids"]  # same seed, same completion
        assert event.completion_logprobs == rich_choice["logprobs"]["token_logprobs"]
        assert event.response["choices"][0]["text"] == choice["text"]
    assert events_[0].request == {"prompt": prompt, "max_tokens": 6, "seed": 3}


def test_a_bad_stream_request_is_an_http_error_before_any_event(served):
    with httpx.Client(timeout=60) as client:
        url = f"{served.gateway}/v1/chat/completions"
        r, _ = stream(client, url, {"messages": MESSAGES, "stream": True, "top_logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r, _ = stream(client, url, {"messages": MESSAGES, "stream": True, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r, _ = stream(client, url, {"messages": MESSAGES, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# Through a faulty upstream -----------------------------------------------------------------------


def _chunk(version: int | None, choice: dict[str, Any] | None, **extra: Any) -> bytes:
    data: dict[str, Any] = {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 1, "model": "tiny-sim",
                            "choices": [choice] if choice else []}
    if version is not None:
        data["model_version"] = version
    data.update(extra)
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def faulty_upstream_app() -> FastAPI:
    """An OpenAI-compatible upstream shaped like vLLM (prompt ids on the first chunk, finish reason on
    the last token's chunk) whose stream does what the request's ``fault`` field says."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        fault = body.get("fault", "none")
        assert body["logprobs"] is True and body["return_token_ids"] is True
        assert body["stream_options"]["include_usage"] is True
        header_version = fault != "version_in_chunk"

        async def events() -> AsyncIterator[bytes]:
            v = None if header_version else 5
            yield _chunk(v, {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}, prompt_token_ids=[1, 2, 3], usage=None)
            yield _chunk(v, {"index": 0, "delta": {"content": "ab"}, "token_ids": [7, 8], "finish_reason": None,
                             "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []},
                                                      {"token": "b", "logprob": -0.25, "bytes": [98],
                                                       "top_logprobs": []}]}}, usage=None)
            if fault == "error":
                yield b'data: {"error": {"message": "engine crashed", "type": "internal_server_error", ' \
                      b'"param": null, "code": "engine_failure"}}\n\n'
                return
            if fault == "drop":
                raise RuntimeError("connection lost")  # uvicorn aborts the response mid-body
            yield _chunk(v, {"index": 0, "delta": {"content": "c"}, "token_ids": [9], "finish_reason": "stop",
                             "logprobs": {"content": [{"token": "c", "logprob": -1.0, "bytes": [99],
                                                       "top_logprobs": []}]}}, usage=None)
            if fault == "huge_usage":  # no reader of the event could decode it (flywheel/jsonpolicy.py)
                yield b'data: {"choices": [], "usage": {"prompt_tokens": 100000000000000000000000}}\n\n'
                return
            yield _chunk(v, None, usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
            if fault != "no_done":
                yield b"data: [DONE]\n\n"

        headers = {"X-Flywheel-Model-Version": "4", "X-Flywheel-Node": "faulty"} if header_version else {}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


@contextlib.contextmanager
def faulty_upstream() -> Iterator[str]:
    with served_app(faulty_upstream_app(), ready_path="/nowhere") as url:
        yield url


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, tiny_model_dir) -> Iterator[Served]:
    with faulty_upstream() as upstream, running_stack(
        tmp_path_factory.mktemp("faulty"), tiny_model_dir, node=False, upstream=upstream
    ) as stack:
        yield stack


def test_streams_that_break_off_end_in_an_error_event_and_record_nothing(faulty):
    url = f"{faulty.gateway}/v1/chat/completions"
    base = {"messages": MESSAGES, "stream": True, "logprobs": True}
    generations = {}
    with httpx.Client(timeout=30) as client:
        for fault, code in (("error", "engine_failure"), ("drop", "upstream_error"), ("no_done", "upstream_error"),
                            ("huge_usage", "bad_upstream_response")):
            r, events = stream(client, url, {**base, "fault": fault}, **{"X-Flywheel-Session": f"f-{fault}"})
            assert r.status_code == 200 and r.headers["X-Flywheel-Model-Version"] == "4"
            generations[fault] = r.headers["X-Flywheel-Generation"]
            *relayed, last = events
            assert "[DONE]" not in events, fault
            assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}
            assert last["error"]["code"] == code and last["error"]["type"] == "upstream_error", last
            # What arrived before the failure was relayed as it came (the client asked for logprobs).
            assert relayed[1]["choices"][0]["delta"]["content"] == "ab"
            assert [e["logprob"] for e in relayed[1]["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25]

        # The same upstream, whole: relayed and recorded; the version came from the response header.
        r, events = stream(client, url, base)
        assert events[-1] == "[DONE]" and r.headers["X-Flywheel-Model-Version"] == "4"
        generations["none"] = r.headers["X-Flywheel-Generation"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1]) == "abc"
        assert all("usage" not in c and "prompt_token_ids" not in c for c in events[:-1])
        # No version header: the first chunk names it, and the header still leads the stream.
        r, events = stream(client, url, {**base, "fault": "version_in_chunk"})
        assert events[-1] == "[DONE]" and r.headers["X-Flywheel-Model-Version"] == "5"
        generations["version_in_chunk"] = r.headers["X-Flywheel-Generation"]

    found = faulty.events(list(generations.values()), timeout_s=3)
    assert {fault: len(found[g]) for fault, g in generations.items()} == {
        "error": 0, "drop": 0, "no_done": 0, "huge_usage": 0, "none": 1, "version_in_chunk": 1}
    event = found[generations["none"]][0]
    assert (event.prompt_token_ids, event.completion_token_ids, event.completion_logprobs) == (
        [1, 2, 3], [7, 8, 9], [-0.5, -0.25, -1.0])
    assert (event.model_version, event.node_id, event.finish_reason) == (4, "faulty", "stop")
    assert event.response["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert found[generations["version_in_chunk"]][0].model_version == 5
    metrics = httpx.get(f"{faulty.gateway}/metrics").text
    assert "flywheel_stream_errors_total 4.0" in metrics


def test_a_stream_whose_event_cannot_be_spooled_ends_in_an_error_event(tmp_path):
    """[DONE] is the acknowledgement: if the event cannot be recorded the client never gets it.
    The bus refuses everything and ``spool_full = "reject"``: a stream is admitted while the spool
    has room, then a large feedback batch fills the spool while the upstream is still decoding, so the
    stream's event is refused at its end and the stream ends with the error instead of [DONE]."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.upstream import running
    from serving.gateway.app import create_app

    upstream_port = free_port()
    with running(upstream_port, delay_ms=1500) as upstream:
        settings = load_settings(data_dir=str(tmp_path), bus={"kind": "local", "topic_prefix": "refuse."}, gateway={
            "upstream": f"http://127.0.0.1:{upstream_port}", "spool_max_bytes": 65_536, "spool_full": "reject"})
        with served_app(create_app(settings, producer_factory=RefusingProducer)) as url, \
                httpx.Client(timeout=30) as client, ThreadPoolExecutor(1) as pool:
            first = client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES},
                                headers={"X-Flywheel-Session": "s-full"})
            assert first.status_code == 200, first.text
            streamed = pool.submit(stream, client, f"{url}/v1/chat/completions",
                                   {"messages": MESSAGES, "stream": True})
            # The filler must come after the stream is admitted (it reached the upstream), else the
            # stream itself is refused with 503, and before the upstream's decode ends.
            wait_until("the stream to reach the upstream", lambda: upstream.received >= 2, timeout_s=10, every_s=0.01)
            items = [{"feedback_id": f"big-{i}", "kind": "explicit", "signal": "comment", "comment": "y" * 9_000}
                     for i in range(8)]
            filler = client.post(f"{url}/v1/feedback", json={"feedback": items},
                                 headers={"X-Flywheel-Session": "s-full"})
            assert filler.status_code == 202, filler.text
            r, events = streamed.result()
            assert client.get(f"{url}/admin/capture").json()["bytes"] >= 65_536
    assert r.status_code == 200 and "[DONE]" not in events
    assert all("choices" in e for e in events[:-1]) and len(events) > 1
    assert events[-1]["error"]["code"] == "capture_unavailable" and "retry" in events[-1]["error"]["message"]


def test_a_stream_whose_session_state_is_lost_ends_in_an_error_event(tmp_path):
    """Redis dies while the upstream decodes: the stream's event cannot be recorded against its
    session, so the client gets the ``state_unavailable`` error event instead of [DONE] (it used
    to get a connection dropped mid-body) and nothing is captured."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.upstream import running
    from serving.gateway.app import create_app
    from testbed.redis import RedisServer

    upstream_port = free_port()
    redis = RedisServer(tmp_path).start()
    try:
        with running(upstream_port, delay_ms=600) as upstream:
            settings = load_settings(data_dir=str(tmp_path), bus={"kind": "local", "topic_prefix": "lost."},
                                     live={"kind": "redis", "redis_url": redis.url},
                                     gateway={"upstream": f"http://127.0.0.1:{upstream_port}"})
            bus = make_bus(settings)
            with served_app(create_app(settings)) as url, httpx.Client(timeout=30) as client, \
                    ThreadPoolExecutor(1) as pool:
                wait_until("redis", lambda: client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES})
                           .status_code == 200)
                streamed = pool.submit(stream, client, f"{url}/v1/chat/completions",
                                       {"messages": MESSAGES, "stream": True})
                wait_until("the stream to reach the upstream", lambda: upstream.received == 2)
                redis.kill()
                r, events = streamed.result()
            stack = Served(settings, url, None, bus)
            found = stack.events([r.headers["X-Flywheel-Generation"]], timeout_s=2)
            bus.close()
    finally:
        redis.kill()
    assert r.status_code == 200 and "[DONE]" not in events and len(events) > 1
    assert events[-1]["error"]["code"] == "state_unavailable", events[-1]
    assert found == {r.headers["X-Flywheel-Generation"]: []}
