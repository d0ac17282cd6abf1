"""The full-mode vLLM node's front (serving/node/vllm_front.py) over real HTTP, in front of the
stand-in vLLM (tests/fixtures/vllm_standin.py), with the adapter and the node's Updater on a real
registry: every answer is stamped with the version whose weights decoded all of its tokens (the
stand-in records them per token), a reload waits for the requests in flight and holds new ones
back, and the front refuses rather than mislabels."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import load_settings
from flywheel.weights.codec.state import encode_full
from flywheel.weights.registry import Registry, VersionInfo
from flywheel.weights.store import FolderStore
from serving.node.updater import Updater
from serving.node.vllm_adapter import VllmAdapter
from serving.node.vllm_front import VersionGate, create_front
from tests.fixtures.roles import MESSAGES, served_app, wait_until
from tests.fixtures.vllm_standin import Generation, VllmStandIn
from tests.integration.test_registry import make_state, train_step

pytestmark = pytest.mark.integration

LINE = "front-line"
NODE = "vllm-front-0"


@dataclass
class Front:
    url: str
    standin: VllmStandIn
    gate: VersionGate
    adapter: VllmAdapter
    updater: Updater
    infos: list[VersionInfo]

    def generation(self, answer_id: str) -> Generation:
        return next(g for g in self.standin.generations if g.id == answer_id)

    def sha(self, version: int) -> str:
        return self.infos[version].sha256


@contextlib.contextmanager
def front(tmp_path: Path, versions: int = 3, *, wait_s: float = 30.0, drain_timeout_s: float = 600.0,
          vllm_version: str = "0.18", api_key: str = "") -> Iterator[Front]:
    """A registry with ``versions`` versions (0 is what vLLM was started from), the stand-in, the
    adapter and Updater as ``flywheel node`` builds them, and the front served on a free port."""
    rng = random.Random(11)
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    registry = Registry(make_session_factory(db), FolderStore(tmp_path / "weights"), LINE)
    states = [make_state(rng)]
    infos = [registry.publish(states[0], parent=None)]
    for v in range(1, versions):
        states.append(train_step(rng, states[-1]))
        infos.append(registry.publish(states[v], parent=v - 1, parent_state=states[v - 1]))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(encode_full(states[0]))
    with VllmStandIn(served_model_name=LINE, weights_path=str(model), vllm_version=vllm_version,
                     api_key=api_key) as standin:
        settings = load_settings(data_dir=str(tmp_path), model={"line": LINE, "path": str(model)},
                                 node={"engine": "vllm", "vllm_url": standin.url, "node_id": NODE,
                                       "vllm_api_key": api_key})
        gate = VersionGate(drain_timeout_s=drain_timeout_s)
        adapter = VllmAdapter(standin.url, registry, tmp_path / "work", mode="full", served_model_name=LINE,
                              base_version=0, base_path=model, gate=gate, api_key=api_key)
        adapter.prepare()  # as flywheel node does once vLLM answers
        standin.calls.clear()  # the tests read the calls requests and reloads make
        updater = Updater(adapter, registry, settings)
        try:
            with served_app(create_front(adapter, gate, settings, updater, wait_s=wait_s)) as url:
                yield Front(url, standin, gate, adapter, updater, infos)
        finally:
            adapter.close()
            db.dispose()


class InThread(threading.Thread):
    """``fn()`` in a thread; ``result()`` joins it and returns (or raises) what it did."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True)
        self._fn, self._out, self._exc = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self._out = self._fn()
        except BaseException as exc:
            self._exc = exc

    def result(self, timeout_s: float = 30.0) -> Any:
        self.join(timeout_s)
        assert not self.is_alive(), "still running"
        if self._exc is not None:
            raise self._exc
        return self._out


def stream(url: str, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None,
           **body: Any) -> tuple[httpx.Response, list[Any]]:
    """A streamed request: the response (headers) and its events (JSON, or the string ``[DONE]``)."""
    payload = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "sort: 3 1 2"}
    with httpx.stream("POST", f"{url}{path}", json={**payload, "stream": True, **body}, headers=headers or {},
                      timeout=30) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return r, [e if e == "[DONE]" else json.loads(e) for e in events]


def post(url: str, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None,
         **body: Any) -> httpx.Response:
    payload = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "sort: 3 1 2"}
    return httpx.post(f"{url}{path}", json={**payload, **body}, headers=headers or {}, timeout=30)


def test_answers_whole_and_streamed_are_stamped_with_the_live_version(tmp_path: Path) -> None:
    with front(tmp_path) as f:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = post(f.url, path, max_tokens=3, logprobs=True if path.endswith("chat/completions") else 0,
                     return_token_ids=True, top_k=5)
            assert r.status_code == 200, r.text
            body = r.json()
            assert r.headers["X-Flywheel-Model-Version"] == "0" and r.headers["X-Flywheel-Node"] == NODE
            assert (body["model"], body["model_version"]) == (LINE, 0)
            assert len(body["choices"][0]["token_ids"]) == 3  # vLLM's fields reach the caller untouched
            sent = f.standin.calls[-1].body
            assert sent["model"] == LINE and sent["top_k"] == 5  # vendor fields reach vLLM untouched
            assert f.generation(body["id"]).weights == [f.sha(0)] * 3

            r, events = stream(f.url, path, max_tokens=3, stream_options={"include_usage": True})
            assert r.status_code == 200 and r.headers["X-Flywheel-Model-Version"] == "0"
            assert events[-1] == "[DONE]" and len(events) >= 4
            assert all((e["model"], e["model_version"]) == (LINE, 0) for e in events[:-1])
            assert f.generation(events[0]["id"]).weights == [f.sha(0)] * 3

        models = httpx.get(f"{f.url}/v1/models").json()["data"][0]
        assert (models["id"], models["model_version"], models["versions"]) == (LINE, 0, [0])
        health = httpx.get(f"{f.url}/health")
        assert health.status_code == 200
        assert {k: health.json()[k] for k in ("status", "node_id", "model_line", "version", "sha256", "versions",
                                              "update_status")} == {
            "status": "ok", "node_id": NODE, "model_line": LINE, "version": 0, "sha256": f.sha(0), "versions": [0],
            "update_status": "serving"}

        # The sticky-version header: the live version is served, any other is the built-in node's 409.
        assert post(f.url, headers={"X-Flywheel-Model-Version": "0"}).json()["model_version"] == 0
        stale = post(f.url, headers={"X-Flywheel-Model-Version": "1"})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_unavailable"
        assert stale.json()["error"]["param"] == "X-Flywheel-Model-Version"
        assert "version 1 is not loaded on this node; it holds [0]" in stale.json()["error"]["message"]
        assert post(f.url, headers={"X-Flywheel-Model-Version": "x"}).status_code == 400
        wrong = post(f.url, model="another-model")
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        calls = len(f.standin.calls)
        assert calls == len(f.standin.completions)  # none of the refused requests reached vLLM

        # vLLM's errors: a 4xx keeps its status and message, anything else is a 502.
        f.standin.fail("/v1/chat/completions", 400, "This model's maximum context length is 16 tokens")
        refused = post(f.url)
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
        f.standin.fail("/v1/chat/completions", 500, "EngineDeadError")
        failed = post(f.url, stream=True)
        assert failed.status_code == 502 and "EngineDeadError" in failed.json()["error"]["message"]
        assert f.gate.readers == 0


def test_a_reload_waits_for_the_request_in_flight_and_holds_later_ones_until_it_is_done(tmp_path: Path) -> None:
    with front(tmp_path) as f:
        f.standin.token_delay_s = 0.15
        in_flight = InThread(lambda: stream(f.url, max_tokens=10))
        wait_until("vLLM decoding the stream", lambda: f.standin.in_flight == 1, timeout_s=10)
        promotion = InThread(lambda: f.updater.update_to(1))
        wait_until("the reload waiting", lambda: f.gate.reloading, timeout_s=10)
        later = InThread(lambda: post(f.url, max_tokens=2))
        wait_until("the later request held back", lambda: f.gate.queued == 1, timeout_s=10)
        assert "/pause" not in f.standin.paths() and f.adapter.current()[0] == 0  # vLLM untouched so far
        assert httpx.get(f"{f.url}/health").json()["engine"] | {"requests": 0} == {
            "kind": "vllm", "mode": "full", "requests": 0, "in_flight": 1, "queued": 1, "reloading": True}

        r, events = in_flight.result()
        assert r.status_code == 200 and r.headers["X-Flywheel-Model-Version"] == "0" and events[-1] == "[DONE]"
        assert {e["model_version"] for e in events[:-1]} == {0}
        assert f.generation(events[0]["id"]).weights == [f.sha(0)] * 10  # every token decoded by version 0

        assert promotion.result().ok and f.adapter.current()[0] == 1
        answer = later.result()
        assert answer.status_code == 200 and answer.headers["X-Flywheel-Model-Version"] == "1"
        assert answer.json()["model_version"] == 1
        assert f.generation(answer.json()["id"]).weights == [f.sha(1)] * 2

        # In vLLM's order: the stream, then the reload, then the request that waited for it.
        paths = f.standin.paths()
        assert paths == ["/v1/chat/completions", "/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
                         "/v1/chat/completions"]
        assert f.gate.readers == 0 and not f.gate.reloading


def test_a_request_held_back_longer_than_wait_s_gets_503_and_retry_after(tmp_path: Path) -> None:
    with front(tmp_path, wait_s=0.3) as f:
        f.standin.hang("/collective_rpc", 2.0)  # a slow reload
        promotion = InThread(lambda: f.updater.update_to(1))
        wait_until("the reload under way", lambda: "/collective_rpc" in f.standin.paths(), timeout_s=10)
        r = post(f.url)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "version_loading"
        assert promotion.result().ok
        r = post(f.url)
        assert r.status_code == 200 and r.json()["model_version"] == 1
        assert f.gate.readers == 0 and f.gate.queued == 0


def test_a_reload_gives_up_when_requests_outlast_the_drain_and_vllm_is_untouched(tmp_path: Path) -> None:
    with front(tmp_path, drain_timeout_s=0.3) as f:
        f.standin.token_delay_s = 0.15
        in_flight = InThread(lambda: stream(f.url, path="/v1/completions", max_tokens=12))
        wait_until("vLLM decoding the stream", lambda: f.standin.in_flight == 1, timeout_s=10)
        outcome = f.updater.update_to(1)
        assert not outcome.ok and "DrainTimeout" in outcome.detail and "still in flight" in outcome.detail
        assert f.updater.status == "failed_update" and f.adapter.current()[0] == 0
        assert not any(p in f.standin.paths() for p in ("/pause", "/collective_rpc"))
        r, events = in_flight.result()
        assert r.headers["X-Flywheel-Model-Version"] == "0" and {e["model_version"] for e in events[:-1]} == {0}
        assert f.generation(events[0]["id"]).weights == [f.sha(0)] * 12
        health = httpx.get(f"{f.url}/health").json()
        assert (health["status"], health["version"], health["update_status"]) == ("ok", 0, "failed_update")

        # The admin surface retries it once nothing is in flight.
        f.standin.token_delay_s = 0
        retried = httpx.post(f"{f.url}/admin/update_weights", json={"version": 1}, timeout=30)
        assert retried.status_code == 200 and retried.json()["version"] == 1
        assert post(f.url).json()["model_version"] == 1


def test_a_client_gone_mid_stream_does_not_hold_the_version(tmp_path: Path) -> None:
    with front(tmp_path, drain_timeout_s=10) as f:
        f.standin.token_delay_s = 0.1
        with httpx.stream("POST", f"{f.url}/v1/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "stream": True, "max_tokens": 200}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert f.gate.readers == 1
        # The client hung up after one event: the front lets go and stops reading vLLM.
        wait_until("the hold released", lambda: f.gate.readers == 0, timeout_s=10)
        wait_until("vLLM's request ended", lambda: f.standin.in_flight == 0, timeout_s=10)
        assert f.updater.update_to(1).ok


def test_unknown_weights_are_refused_rather_than_mislabelled(tmp_path: Path) -> None:
    with front(tmp_path) as f:
        f.standin.fail("/collective_rpc", 500, "engine dead", times=2)  # the reload, and its restore
        outcome = f.updater.update_to(1)
        assert not outcome.ok and f.adapter.current() == (None, "")
        r = post(f.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "weights unknown" in r.json()["error"]["message"]
        health = httpx.get(f"{f.url}/health")
        assert health.status_code == 503 and (health.json()["status"], health.json()["version"]) == ("unknown", None)
        assert httpx.get(f"{f.url}/v1/models").json()["data"][0]["model_version"] is None
        served = len(f.standin.completions)

        assert f.updater.update_to(2).ok  # a full reconstruction brings it back
        r = post(f.url, max_tokens=2)
        assert r.status_code == 200 and r.json()["model_version"] == 2
        assert f.generation(r.json()["id"]).weights == [f.sha(2)] * 2
        assert len(f.standin.completions) == served + 1


# --- vLLM 0.33: paused engines answer 503, weight-version labels; the API key ---------------------


def test_on_033_requests_during_a_reload_wait_behind_the_gate_and_never_see_vllms_503(tmp_path: Path) -> None:
    """vLLM 0.33 rejects requests that reach it while paused (503, or an error event in a stream);
    the front holds its own behind the gate, so they are answered by the new version."""
    with front(tmp_path, vllm_version="0.33") as f:
        direct = f.standin
        f.standin.hang("/collective_rpc", 1.0)  # a reload that takes a while
        promotion = InThread(lambda: f.updater.update_to(1))
        wait_until("vLLM paused", lambda: direct.paused, timeout_s=10)
        # What the front protects against: vLLM itself refuses while paused.
        r = httpx.post(f"{direct.url}/v1/completions", json={"model": LINE, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        whole = InThread(lambda: post(f.url, max_tokens=2))
        streamed = InThread(lambda: stream(f.url, "/v1/completions", max_tokens=2))
        wait_until("both held back", lambda: f.gate.queued == 2, timeout_s=10)
        assert promotion.result().ok
        answer = whole.result()
        assert answer.status_code == 200 and answer.json()["model_version"] == 1
        r, events = streamed.result()
        assert r.status_code == 200 and events[-1] == "[DONE]" and {e["model_version"] for e in events[:-1]} == {1}
        assert direct.rejected_while_paused == 1  # only the direct request
        assert all("weight_versions" not in c for e in [answer.json(), *events[:-1]] for c in e["choices"])


def test_on_033_each_answer_is_checked_against_vllms_weight_labels(tmp_path: Path) -> None:
    with front(tmp_path, vllm_version="0.33") as f:
        assert f.adapter.weight_versions and f.standin.weight_version == f"{LINE}-v0"
        asked = post(f.url, max_tokens=3, return_weight_versions=True)
        assert asked.status_code == 200
        assert asked.json()["choices"][0]["weight_versions"] == [{"version": f"{LINE}-v0", "start": 0, "end": 3}]
        forwarded = [c.body for c in f.standin.calls if c.path == "/v1/chat/completions"]
        assert forwarded[-1]["return_weight_versions"] is True

        # vLLM's weights relabelled behind the adapter's back: refused, never stamped version 0.
        httpx.post(f"{f.standin.url}/update_weight_version", json={"new_version": "someone-else"})
        r = post(f.url, max_tokens=2)
        assert r.status_code == 502 and r.json()["error"]["code"] == "weight_version_mismatch"
        assert "someone-else" in r.json()["error"]["message"]
        r, events = stream(f.url, "/v1/completions", max_tokens=2)
        assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "weight_version_mismatch"

        # A reload relabels while paused, so the front's stamp and vLLM's label agree again.
        assert f.updater.update_to(1).ok and f.standin.weight_version == f"{LINE}-v1"
        r = post(f.url, max_tokens=2)
        assert r.status_code == 200 and r.json()["model_version"] == 1 and "weight_versions" not in r.json()["choices"][0]


def test_n_choices_are_relayed_and_every_choice_is_checked_against_the_labels(tmp_path: Path) -> None:
    with front(tmp_path, vllm_version="0.33") as f:
        r = post(f.url, max_tokens=2, n=3, return_token_ids=True)
        assert r.status_code == 200 and r.json()["model_version"] == 0
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
        assert len({tuple(c["token_ids"]) for c in r.json()["choices"]}) == 3
        r, events = stream(f.url, "/v1/completions", max_tokens=2, n=2)
        assert events[-1] == "[DONE]" and [e["choices"][0]["index"] for e in events[:-1]] == [0, 1, 0, 1]
        httpx.post(f"{f.standin.url}/update_weight_version", json={"new_version": "someone-else"})
        r = post(f.url, max_tokens=2, n=2)
        assert r.status_code == 502 and "choice 0" in r.json()["error"]["message"]
        assert post(f.url, n=9).json()["error"]["param"] == "n"  # node.max_n, before vLLM is called


def test_on_018_without_labels_the_front_carries_on(tmp_path: Path) -> None:
    with front(tmp_path, vllm_version="0.18") as f:
        assert f.adapter.weight_versions is False
        r = post(f.url, max_tokens=2)
        assert r.status_code == 200 and "return_weight_versions" not in f.standin.calls[-1].body


def test_the_front_sends_vllms_api_key(tmp_path: Path) -> None:
    with front(tmp_path, api_key="k-123") as f:
        r = post(f.url, max_tokens=2)
        assert r.status_code == 200
        r, events = stream(f.url, max_tokens=2)
        assert events[-1] == "[DONE]"
        assert f.updater.update_to(1).ok
        assert httpx.post(f"{f.standin.url}/v1/completions", json={"model": LINE, "prompt": "x"}).status_code == 401
