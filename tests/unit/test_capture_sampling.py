"""What the gateway sends upstream and records about sampling: nothing added that shapes sampling,
the engine's defaults recorded where the client is silent, reasoning hidden from a client that
asked so while capture keeps token ids and logprobs."""

from __future__ import annotations

from flywheel.events import GenerationEvent
from serving.gateway import capture
from serving.gateway.routing import nodes_from_heartbeats
from serving.protocol import parse_chat_request

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_upstream_request_adds_no_sampling_knob_and_keeps_capture_whole() -> None:
    body = {"messages": MESSAGES, "include_reasoning": False, "stream": True}
    out = capture.upstream_request(body, "line")
    assert "temperature" not in out and "top_p" not in out and "top_k" not in out
    assert out["logprobs"] is True and out["return_token_ids"] is True
    assert "include_reasoning" not in out  # vLLM drops token ids and logprobs otherwise
    assert out["stream_options"] == {"include_usage": True}
    assert body == {"messages": MESSAGES, "include_reasoning": False, "stream": True}  # the client's body untouched


def test_reasoning_is_cut_from_what_a_client_that_hid_it_gets() -> None:
    hidden = parse_chat_request({"messages": MESSAGES, "include_reasoning": False})
    shown = parse_chat_request({"messages": MESSAGES})
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
                         "token_ids": [5], "logprobs": {"content": []}}], "prompt_token_ids": [1]}
    assert "reasoning_content" not in capture.client_response(body, hidden)["choices"][0]["message"]
    assert capture.client_response(body, shown)["choices"][0]["message"]["reasoning_content"] == "2+2"
    chunk = {"choices": [{"index": 0, "delta": {"reasoning": "thinking"}}]}
    assert capture.client_chunk(chunk, hidden)["choices"][0]["delta"] == {}
    assert body["choices"][0]["message"]["reasoning_content"] == "2+2"  # never mutated in place


def test_the_event_records_what_the_engine_applied() -> None:
    beats = {"n": {"url": "http://n:1", "model_line": "m", "live_version": 3, "versions": [3],
                   "sampling_defaults": {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05}}}
    (node,) = nodes_from_heartbeats(beats, "m")
    defaults = dict(node.sampling_defaults)
    body = {"messages": MESSAGES, "temperature": 0.9, "logit_bias": {"17": -5}, "response_format": {"type": "json_object"}}
    served = capture.Served(3, "n", [1, 2], [7, 8], [-0.1, -0.2], "stop")
    (event,) = capture.generation_events(request_id="g", tenant="t", session_id="s", model_line="m",
                                         request_body=body, response_body={}, served=[served], latency_ms=1.0,
                                         sampling_defaults=defaults)
    s = event.sampling
    assert (s.temperature, s.top_k, s.repetition_penalty, s.top_p, s.presence_penalty) == (0.9, 20, 1.05, 1.0, 0.0)
    assert s.logit_bias == {"17": -5.0} and s.unsupported == ["response_format"]
    assert GenerationEvent.from_bytes(event.to_bytes()).sampling == s  # survives the bus


def test_the_gateway_records_sampling_without_importing_torch() -> None:
    import subprocess
    import sys

    code = "import sys, serving.gateway.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
