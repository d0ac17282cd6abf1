"""Tools and function calls pass through the gateway untouched, plain and streamed, with the
official openai SDK: the request's ``tools`` and the conversation's tool messages reach the
upstream as sent, the call comes back to the client, and the recorded event holds it (streamed
calls assembled from their argument deltas)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from bench.upstream import running
from flywheel.bus import make_bus
from flywheel.events import GenerationEvent
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from testbed.procs import free_port
from tests.fixtures.roles import served_app, wait_until

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {
    "name": "sort_letters", "description": "Sort letters alphabetically",
    "parameters": {"type": "object", "properties": {"letters": {"type": "string"}}, "required": ["letters"]}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port()
    with running(port) as upstream:
        settings = load_settings(data_dir=str(tmp_path_factory.mktemp("tools")),
                                 bus={"kind": "local", "partitions": 1, "topic_prefix": "tools."},
                                 gateway={"upstream": f"http://127.0.0.1:{port}"})
        with served_app(create_app(settings)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            yield settings, url, upstream, client


def _events(settings, url: str) -> dict[str, GenerationEvent]:
    wait_until("the spool to ship", lambda: httpx.get(f"{url}/admin/capture").json()["events"] == 0)
    bus = make_bus(settings)
    consumer = bus.consumer(f"check-{free_port()}", [settings.topic("generations")])
    out = {}
    try:
        for _ in range(3):
            for record in consumer.poll(timeout_s=0.3, max_records=1000):
                event = GenerationEvent.from_bytes(record.value)
                out[event.generation_id] = event
    finally:
        consumer.close()
        bus.close()
    return out


def test_a_tool_call_round_trip(stack):
    settings, url, upstream, client = stack
    messages = [{"role": "user", "content": "sort: q w e"}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-sim", messages=messages, tools=TOOLS, tool_choice="auto",
        extra_headers={"X-Flywheel-Session": "tools-1"})
    first = raw.parse()
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "sort_letters" and json.loads(call.function.arguments) == {"letters": "q w e"}
    assert upstream.last_request["tools"] == TOOLS and upstream.last_request["tool_choice"] == "auto"

    # The tool's result goes back in the next turn of the same session, exactly as sent.
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "e q w"},
    ]
    second = client.chat.completions.with_raw_response.create(
        model="tiny-sim", messages=follow_up, tools=TOOLS, tool_choice="none",
        extra_headers={"X-Flywheel-Session": "tools-1"})
    assert second.parse().choices[0].message.content
    forwarded = upstream.last_request["messages"]
    assert forwarded[1]["tool_calls"][0]["id"] == call.id and forwarded[2] == follow_up[2]

    events = _events(settings, url)
    recorded = events[raw.headers["X-Flywheel-Generation"]]
    assert recorded.response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "sort_letters"
    assert recorded.request["tools"] == TOOLS
    assert events[second.headers["X-Flywheel-Generation"]].request["messages"][2]["tool_call_id"] == call.id


def test_a_streamed_tool_call_is_relayed_and_recorded_whole(stack):
    settings, url, upstream, client = stack
    with client.chat.completions.with_streaming_response.create(
        model="tiny-sim", messages=[{"role": "user", "content": "sort: a c b"}], tools=TOOLS, stream=True,
        extra_headers={"X-Flywheel-Session": "tools-2"},
    ) as response:
        generation = response.headers["X-Flywheel-Generation"]
        chunks = list(response.parse())
    parts = [tc for c in chunks for choice in c.choices for tc in (choice.delta.tool_calls or [])]
    assert parts[0].function.name == "sort_letters" and len(parts) > 1
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"letters": "q w e"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    message = _events(settings, url)[generation].response["choices"][0]["message"]
    (recorded,) = message["tool_calls"]
    assert recorded["function"] == {"name": "sort_letters", "arguments": '{"letters": "q w e"}'}
    assert recorded["id"] == parts[0].id and recorded["type"] == "function"
