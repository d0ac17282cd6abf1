"""Consent, pure: tenants' policies, the header that may only tighten them, the training sample by
session, the mark on the wire, and the mark carried from generations to trajectory, scored sample
and trainer (which drops it before any batch)."""

from __future__ import annotations

import json

import pytest

from flywheel import consent
from flywheel.consent import TenantPolicy
from flywheel.events import GenerationEvent, ScoredTrajectory, TrajectoryEvent
from flywheel.settings import SettingsError, load_settings
from ingest.assemble import assemble
from rewards.guards import held_out_point
from rewards.scorer import Scorer
from rewards.spec import load_spec
from serving.gateway import capture
from tests.unit.test_assemble import gen
from tests.unit.test_loss import scored

pytestmark = pytest.mark.unit


def test_a_tenant_has_its_own_policy_else_the_default_else_train() -> None:
    tenants = {"acme": TenantPolicy(data_use="none"), "*": TenantPolicy(data_use="store_only")}
    assert consent.policy_for(tenants, "acme").data_use == "none"
    assert consent.policy_for(tenants, "other").data_use == "store_only"
    assert consent.policy_for({"acme": TenantPolicy(data_use="none")}, "other") == TenantPolicy()
    assert TenantPolicy() == TenantPolicy(data_use="train", train_fraction=1.0)


@pytest.mark.parametrize(("policy", "header", "expected"), [
    ("train", None, "train"), ("train", "", "train"), ("train", "no-train", "store_only"),
    ("train", "no-store", "none"), ("train", " No-Store ", "none"),
    ("store_only", None, "store_only"), ("store_only", "no-train", "store_only"), ("store_only", "no-store", "none"),
    ("none", None, "none"), ("none", "no-train", "none"),  # a looser header is not applied
])
def test_the_header_only_tightens_the_tenant_policy(policy, header, expected) -> None:
    assert consent.request_use(TenantPolicy(data_use=policy), header) == expected


@pytest.mark.parametrize("header", ["train", "store", "yes", "no-train, no-store"])
def test_an_unknown_header_value_is_refused_naming_the_header(header) -> None:
    with pytest.raises(ValueError, match="X-Flywheel-Data must be one of"):
        consent.request_use(TenantPolicy(), header)


def test_tightest() -> None:
    assert consent.tightest() == "train"
    assert consent.tightest("store_only", "train") == "store_only"
    assert consent.tightest("train", "none", "store_only") == "none"


def test_the_training_sample_takes_whole_sessions_near_the_fraction() -> None:
    half = TenantPolicy(train_fraction=0.3)
    sessions = [f"s{i}" for i in range(4000)]
    uses = [consent.sampled("train", half, "acme", s) for s in sessions]
    assert 0.27 < uses.count("train") / len(uses) < 0.33
    assert uses == [consent.sampled("train", half, "acme", s) for s in sessions]  # deterministic
    assert all(consent.sampled("train", TenantPolicy(), "acme", s) == "train" for s in sessions)
    assert all(consent.sampled("train", TenantPolicy(train_fraction=0), "acme", s) == "store_only" for s in sessions)
    # Tighter uses stay as they are; another tenant's sample is another draw.
    assert {consent.sampled(u, half, "acme", "s1") for u in ("store_only", "none")} == {"store_only", "none"}
    assert uses != [consent.sampled("train", half, "evil", s) for s in sessions]
    # Independent of the rewards stage's held-out slice (the same pair, hashed without the salt).
    low_held_out = [s for s in sessions if held_out_point("acme", s) < 0.3]
    share = sum(consent.sampled("train", half, "acme", s) == "train" for s in low_held_out) / len(low_held_out)
    assert 0.24 < share < 0.36


def test_tenants_are_a_settings_section_checked_at_load() -> None:
    s = load_settings(tenants={"*": {"train_fraction": 0.5}, "acme": {"data_use": "none"}})
    assert s.tenants["acme"] == TenantPolicy(data_use="none")
    assert consent.policy_for(s.tenants, "other") == TenantPolicy(train_fraction=0.5)
    assert load_settings().tenants == {}
    for bad in ({"a b": {}}, {"acme": {"data_use": "never"}}, {"acme": {"train_fraction": 1.5}},
                {"acme": {"sample": 0.5}}):
        with pytest.raises(SettingsError):
            load_settings(tenants=bad)


def test_the_mark_is_on_the_wire_only_when_it_is_not_the_default() -> None:
    served = capture.Served(1, "n", [1], [7], [-0.1], "stop")
    common = dict(request_id="g", tenant="acme", session_id="s", model_line="m", request_body={}, response_body={},
                  served=[served], latency_ms=1.0, sampling_defaults={})
    (train,) = capture.generation_events(**common)
    (kept,) = capture.generation_events(**common, data_use="store_only")
    assert train.data_use == "train" and "data_use" not in json.loads(train.to_bytes())  # what older consumers read
    assert json.loads(kept.to_bytes())["data_use"] == "store_only"
    assert GenerationEvent.from_bytes(kept.to_bytes()).data_use == "store_only"
    assert GenerationEvent.from_bytes(train.to_bytes()) == train
    sample = scored("a", [1])
    assert "data_use" not in json.loads(sample.to_bytes())
    marked = sample.model_copy(update={"data_use": "store_only"})
    assert ScoredTrajectory.from_bytes(marked.to_bytes()).data_use == "store_only"
    with pytest.raises(ValueError):
        GenerationEvent.from_bytes(json.dumps({**json.loads(train.to_bytes()), "data_use": "none"}).encode())


def test_one_generation_not_for_training_marks_the_trajectory_and_its_score() -> None:
    g1 = gen("g1", [1, 2], [3], [-0.1], at=0)
    g2 = gen("g2", [1, 2, 3, 4], [5], [-0.2], at=1)
    assert assemble("acme", "s1", [g1, g2], [], closed_reason="inactivity").data_use == "train"
    g2 = g2.model_copy(update={"data_use": "store_only"})
    traj = assemble("acme", "s1", [g1, g2], [], closed_reason="inactivity")
    assert traj.data_use == "store_only"
    assert TrajectoryEvent.from_bytes(traj.to_bytes()).data_use == "store_only"
    scorer = Scorer(load_spec())
    out = scorer(traj)
    assert scorer.scored(traj, out, advantages=None, held_out=False).data_use == "store_only"


def test_samples_not_for_training_never_enter_a_batch_and_are_counted() -> None:
    from trainer.buffer import SampleBuffer

    buf = SampleBuffer(max_staleness=4)
    marked = scored("m", [1]).model_copy(update={"data_use": "store_only"})
    assert buf.add(scored("a", [1]), None, current_version=1) is None
    assert buf.add(marked, None, current_version=1) == "not_for_training"
    assert buf.add(scored("b", [1]), None, current_version=1) is None
    assert [e.sample.event_id for e in buf.take(2)] == ["a", "b"]
    assert buf.counters()["dropped_not_for_training"] == 1
    restored = SampleBuffer(max_staleness=4)
    restored.load_state_dict(buf.state_dict())
    assert restored.counters()["dropped_not_for_training"] == 1
