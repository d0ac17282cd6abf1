"""Sticky-version policy: canary split by session hash, pins, no stable; heartbeat parsing; batching by version."""

from __future__ import annotations

import uuid
from concurrent.futures import Future

import pytest

from flywheel.sampling import Processing
from serving.gateway.routing import (
    NodeInfo,
    RoutingTable,
    canary_bucket,
    new_session_version,
    nodes_from_heartbeats,
    servable,
    servable_pins,
)
from serving.node.engine import GenerationRequest, _Pending, group_requests

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_the_canary_gets_its_fraction_of_new_sessions(fraction):
    table = RoutingTable(stable=4, canary=5, canary_fraction=fraction)
    n = 10_000
    sessions = [uuid.uuid4().hex for _ in range(n)]
    picks = [new_session_version(table, "acme", s) for s in sessions]
    assert set(picks) <= {4, 5}
    share = picks.count(5) / n
    # Binomial standard deviation is at most 0.005 at n = 10k: 4 sigma.
    assert abs(share - fraction) <= 0.02, share
    # Deterministic: the same session always lands on the same side.
    assert [new_session_version(table, "acme", s) for s in sessions[:500]] == picks[:500]


def test_the_split_depends_on_tenant_and_session_and_is_uniform():
    buckets = [canary_bucket("t", str(i)) for i in range(10_000)]
    assert all(0.0 <= b < 1.0 for b in buckets)
    deciles = [sum(1 for b in buckets if k / 10 <= b < (k + 1) / 10) for k in range(10)]
    assert all(900 <= d <= 1100 for d in deciles), deciles
    assert canary_bucket("a", "s1") != canary_bucket("b", "s1")
    assert canary_bucket("ab", "c") != canary_bucket("a", "bc")  # the separator keeps fields apart


def test_a_tenant_pin_wins_over_canary_and_stable():
    table = RoutingTable(stable=4, canary=5, canary_fraction=1.0, pins={"acme": 2})
    assert {new_session_version(table, "acme", uuid.uuid4().hex) for _ in range(100)} == {2}
    assert {new_session_version(table, "other", uuid.uuid4().hex) for _ in range(100)} == {5}


def test_no_stable_version_means_none_and_no_canary_means_stable():
    assert new_session_version(RoutingTable(stable=None), "t", "s") is None
    assert new_session_version(RoutingTable(stable=None, canary=3, canary_fraction=0.0), "t", "s") is None
    assert {new_session_version(RoutingTable(stable=7, canary_fraction=1.0), "t", str(i)) for i in range(100)} == {7}


def test_heartbeats_become_nodes_of_the_line():
    beats = {
        "n2": {"url": "http://b:1/", "model_line": "m", "live_version": 3, "versions": [3, 2], "status": "serving"},
        "n1": {"url": "http://a:1", "model_line": "m", "live_version": 4},  # an older node: no versions
        "n3": {"url": "http://c:1", "model_line": "other", "live_version": 4, "versions": [4]},
        "n4": {"model_line": "m", "live_version": 4, "versions": [4]},  # no url: cannot be routed to
    }
    nodes = nodes_from_heartbeats(beats, "m")
    assert [(n.node_id, n.url, n.live_version, n.versions) for n in nodes] == [
        ("n1", "http://a:1", 4, (4,)),
        ("n2", "http://b:1", 3, (2, 3)),
    ]


def test_only_versions_the_fleet_holds_are_proposed():
    a = NodeInfo("a", "http://a", 4, (3, 4))
    b = NodeInfo("b", "http://b", 5, (4, 5, 6))
    assert servable((5, 6), [a, b]) == (5, 6)
    assert servable((7, 6), [a, b]) == (5, 6)  # 7 promoted, on no node yet: the newest live version
    assert servable((5, 8), [a]) == (4, None)  # the canary on no node: none yet
    assert servable((7, 8), []) == (7, 8)  # no heartbeats: the registry as it is
    assert servable((None, None), [a]) == (4, None)
    assert servable_pins({"t1": 3, "t2": 9}, [a, b]) == {"t1": 3}  # a pin on no node is ignored
    assert servable_pins({"t1": 3, "t2": 9}, []) == {"t1": 3, "t2": 9}


def _pending(version: int | None, temperature: float = 1.0, seed: int | None = None) -> _Pending:
    return _Pending(GenerationRequest([1, 2], 4, processing=Processing(temperature=temperature), seed=seed,
                                      version=version), Future())


def test_a_batch_is_split_by_version_and_unnamed_requests_join_the_live_one():
    batch = [_pending(None), _pending(3), _pending(2), _pending(None),
             _pending(3, temperature=0.5), _pending(2, seed=1), _pending(None, temperature=0.5)]
    groups = group_requests(batch, live=3)
    as_versions = sorted(sorted(p.request.version or 0 for p in g) for g in groups)
    assert as_versions == [[0, 0, 3], [0, 3], [2], [2]]  # equal processing shares a batch, seeds run alone
    assert all(len({p.request.version for p in g} - {None}) <= 1 for g in groups)  # one named version per group


def test_a_node_that_names_its_versions_by_model_holds_only_those_and_its_answers_become_the_lines():
    from serving.gateway.capture import CaptureError
    from serving.gateway.routing import Upstream, as_line

    beats = {
        "lora": {"url": "http://vllm:8000/", "model_line": "m", "live_version": 3, "versions": [2, 3, 4],
                 "model_names": {"2": "m-v2", "3": "m-v3", "x": "bad", "5": ""}},
        "plain": {"url": "http://node:1", "model_line": "m", "live_version": 3, "versions": [3]},
    }
    lora, plain = nodes_from_heartbeats(beats, "m")
    assert lora.versions == (2, 3) and lora.model_names == ((2, "m-v2"), (3, "m-v3"))  # 4: no name, not held
    assert (lora.model_for(3), lora.model_for(4), lora.model_for(None)) == ("m-v3", None, None)
    assert plain.model_names is None and plain.model_for(3) is None

    target = Upstream("http://vllm:8000", "lora", names_versions=True, model="m-v3", version=3)
    answer = {"id": "x", "model": "m-v3", "choices": [{"index": 0}]}
    assert as_line(answer, target, "m") == {"id": "x", "model": "m", "model_version": 3, "choices": [{"index": 0}]}
    assert answer["model"] == "m-v3"  # a copy: the upstream's answer is not touched
    with pytest.raises(CaptureError, match="m-v2"):
        as_line({"model": "m-v2"}, target, "m")  # vLLM served another adapter than it was sent
    assert as_line(answer, Upstream("http://node:1", "plain"), "m") is answer  # other nodes: unchanged
    assert Upstream("u", names_versions=True).unavailable and not target.unavailable and not Upstream("u").unavailable
