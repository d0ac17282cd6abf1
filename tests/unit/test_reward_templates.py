"""The shipped reward templates and the ``metrics`` builder, against hand-computed rewards.

Sessions are built as the gateway stores them: each turn a real ``GenerationEvent`` (its request
and response, which the text guards read) and one token segment; feedback as ``FeedbackEvent``s.
:class:`Sessions` builds them and is the scorer's generations source (``rewards.texts``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flywheel.events import FeedbackEvent, GenerationEvent, SamplingParams, Segment, TrajectoryEvent, Turn
from rewards.builders import metric_value, metrics
from rewards.scorer import Scorer
from rewards.spec import BooleanMetric, FloatMetric, MetricsParams, RewardSpec, SpecError, builtin_specs, load_spec, parse_spec

pytestmark = pytest.mark.unit

BUILTIN_KINDS = {"thumbs": "explicit", "rating": "explicit", "edit_accepted": "implicit", "text_kept": "implicit",
                 "abandon": "implicit", "retry": "implicit", "task_solved": "outcome", "tests_passed": "outcome"}


@dataclass
class Said:
    """One turn as a test describes it: what the user said, what the model answered."""

    answer: str = "Done."
    user: str = "Please rename the function parse_row to parse_record in reader.py and update its callers."
    #: Tool calls as ``(name, arguments)``; arguments a dict (sent as JSON) or a raw string.
    calls: list[tuple[str, Any]] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    tokens: int = 20
    finish: str | None = None
    #: ``tool``: the turn answers a tool result (a step of an agent loop), not the user.
    after: str = "user"
    #: A text completion (``prompt`` = ``user``), as an editor's tab completion is.
    completion: bool = False


class Sessions:
    """Builds sessions and serves their generations: ``Scorer(..., generations=sessions)``."""

    def __init__(self) -> None:
        self.payloads: dict[str, dict[str, Any]] = {}

    def __call__(self, traj: TrajectoryEvent) -> dict[str, dict[str, Any]]:
        return {g: self.payloads[g] for g in traj.generation_ids if g in self.payloads}

    def make(self, name: str, turns: list[Said], feedback: list[tuple[str, float | None, int | None]] = ()) -> TrajectoryEvent:
        """Session ``name``; ``feedback`` as ``(signal, value, turn index or None for the session)``."""
        tokens: list[int] = []
        mask: list[int] = []
        spans: list[Turn] = []
        for i, t in enumerate(turns):
            gid = f"{name}/{i}"
            tokens.append(100)
            mask.append(0)
            spans.append(Turn(generation_id=gid, start=len(tokens), end=len(tokens) + t.tokens, behaviour_version=0))
            tokens += [7] * t.tokens
            mask += [1] * t.tokens
            self.payloads[gid] = self.generation(name, gid, t).model_dump(mode="json")
        events = [FeedbackEvent(tenant="t", session_id=name, feedback_id=f"{name}-{k}", kind=BUILTIN_KINDS.get(s, "custom"),
                                signal=s, value=v, generation_id=None if i is None else f"{name}/{i}")
                  for k, (s, v, i) in enumerate(feedback)]
        segment = Segment(tokens=tokens, mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask], turns=spans)
        return TrajectoryEvent(tenant="t", session_id=name, trajectory_id=name, model_line="m", segments=[segment],
                               generation_ids=[s.generation_id for s in spans], feedback=events, closed_reason="outcome")

    @staticmethod
    def generation(session: str, gid: str, t: Said) -> GenerationEvent:
        if t.completion:
            request: dict[str, Any] = {"model": "m", "prompt": t.user}
            choice: dict[str, Any] = {"index": 0, "text": t.answer, "finish_reason": t.finish or "stop"}
        else:
            messages = [{"role": "user", "content": t.user}]
            if t.after == "tool":
                messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
                              "function": {"name": "run_tests", "arguments": "{}"}}]},
                             {"role": "tool", "tool_call_id": "c0", "content": "2 passed"}]
            tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in t.tools]
            request = {"model": "m", "messages": messages, "tools": tools}
            calls = [{"id": f"call{k}", "type": "function",
                      "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
                     for k, (n, a) in enumerate(t.calls)]
            message: dict[str, Any] = {"role": "assistant", "content": t.answer or None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": t.finish or ("tool_calls" if calls else "stop")}
        return GenerationEvent(tenant="t", session_id=session, generation_id=gid, model_line="m", model_version=0,
                               node_id="n", request=request, response={"id": gid, "choices": [choice]},
                               prompt_token_ids=[100], completion_token_ids=[7] * t.tokens,
                               completion_logprobs=[-1.0] * t.tokens, sampling=SamplingParams(), latency_ms=1.0)


def without(spec: RewardSpec, kind: str) -> RewardSpec:
    """``spec`` with its ``kind`` builders disabled (and its version marked so)."""
    data = spec.model_dump(mode="json")
    for b in data["builders"]:
        if b["kind"] == kind:
            b["enabled"] = False
    data["version"] = f"{spec.version}-no-{kind}"
    return parse_spec(data)


# --- the templates ---------------------------------------------------------------------------------


def test_templates_ship_load_and_validate(tmp_path: Path) -> None:
    assert builtin_specs() == ["coding-agent", "default", "support-agent", "tab-completion"]
    kinds = {"tab-completion": ["metrics", "echo", "length"],  # length off: a suggestion's reward is flat
             "coding-agent": ["metrics", "tool_calls", "clarify", "echo", "length"],
             "support-agent": ["metrics", "explicit", "length", "tool_calls", "clarify", "echo"]}
    for name, expected in kinds.items():
        spec = load_spec(name)
        assert spec.version == f"{name}-v1"
        assert [b.kind for b in spec.builders] == expected
        assert parse_spec(spec.model_dump(mode="json")) == spec  # a stored spec reads back as itself
        assert spec.normalise == load_spec().normalise  # the rest comes from the default spec
    off = {name: [b.kind for b in load_spec(name).builders if not b.enabled] for name in kinds}
    assert off == {"tab-completion": ["length"], "coding-agent": ["echo"], "support-agent": []}
    # a spec of one's own starts from a template by name, from a file anywhere
    (tmp_path / "mine.toml").write_text('extends = "tab-completion"\nversion = "mine"\n[guards]\nheld_out_fraction = 0.1\n')
    mine = load_spec(tmp_path / "mine.toml")
    assert mine.builders == load_spec("tab-completion").builders and mine.guards.held_out_fraction == 0.1
    assert mine.guards.clip_turn == 0.75
    # a name that is no shipped spec is a path, and a missing one says so
    with pytest.raises(SpecError, match="cannot read reward spec"):
        load_spec("no-such-template")


def test_tab_completion_scores_as_cursor_tab() -> None:
    """Accepted +0.75, shown and rejected -0.25, not shown (no event) 0; an acceptance reported
    twice is still worth one (clip_turn)."""
    sessions = Sessions()
    scorer = Scorer(load_spec("tab-completion"), generations=sessions)
    code = Said(completion=True, user="def area(r):\n    ", answer="return math.pi * r ** 2", tokens=8)
    traj = sessions.make("tab", [code] * 4, [("accepted", 1, 0), ("accepted", 0, 1), ("accepted", None, 3),
                                             ("accepted", 1, 3)])
    out = scorer(traj)
    assert out.turn_rewards == pytest.approx([0.75, -0.25, 0.0, 0.75])
    assert out.components == pytest.approx({"accepted": 0.75 - 0.25 + 1.5, "clip": -0.75})
    assert out.total == pytest.approx(1.25)


def test_coding_agent_scores_kept_edits_tests_and_complaints() -> None:
    sessions = Sessions()
    scorer = Scorer(load_spec("coding-agent"), generations=sessions)
    edit = Said(answer="", tools=["apply_patch", "run_tests"],
                calls=[("apply_patch", {"path": "reader.py", "patch": "-def parse_row(\n+def parse_record("})])
    report = Said(answer="Renamed parse_row to parse_record and updated the 3 callers; the tests pass.",
                  tools=["apply_patch", "run_tests"], after="tool")
    traj = sessions.make("code", [edit, report], [("edits_kept", 0.8, 0), ("tests_passed", 0.5, None),
                                                  ("dissatisfied_followup", 1, 1)])
    out = scorer(traj)
    # edits_kept 0.8 -> -0.5 + 0.8 * 1.0 = 0.3 on turn 0; tests 0.5 -> 0.25, uniform over 2 turns;
    # the complaint -0.5 on turn 1; no guard fires on honest turns
    assert out.turn_rewards == pytest.approx([0.3 + 0.125, 0.125 - 0.5])
    assert out.components == pytest.approx({"edits_kept": 0.3, "tests_passed": 0.25, "dissatisfied_followup": -0.5})
    all_pass = scorer(sessions.make("code2", [edit], [("tests_passed", 1, None), ("edits_kept", 0, 0)]))
    assert all_pass.turn_rewards == pytest.approx([1.0 - 0.5])
    # the text guards need the generations: no source, no scorer
    with pytest.raises(SpecError, match="generations source"):
        Scorer(load_spec("coding-agent"))


def test_support_agent_scores_resolution_escalation_and_thumbs() -> None:
    sessions = Sessions()
    scorer = Scorer(load_spec("support-agent"), generations=sessions)
    lookup = Said(answer="", user="Where is my order 4411? It was due on Monday and has not arrived yet.",
                  tools=["order_status", "escalate"], calls=[("order_status", {"order": "4411"})])
    answer = Said(answer="Order 4411 left the depot this morning and arrives tomorrow before noon.",
                  user=lookup.user, tools=lookup.tools, after="tool")
    resolved = scorer(sessions.make("ok", [lookup, answer], [("thumbs", 1, 1), ("resolved", 1, None)]))
    # resolved +1 at the last turn, discounted (0.5) to the first; thumbs up +0.5 on the answer
    assert resolved.turn_rewards == pytest.approx([0.5, 1.0 + 0.5])
    assert resolved.total == pytest.approx(2.0)
    escalated = scorer(sessions.make("bad", [lookup, answer], [("thumbs", -1, 1), ("resolved", 0, None),
                                                                 ("escalated", None, None), ("rating", 2, 1)]))
    # not resolved -0.5 and escalated -0.5 (a session outcome of -1, 0.5 of it to turn 0);
    # thumbs down -0.5 and rating 2 -> 0.5 * -0.5 on the answer
    assert escalated.turn_rewards == pytest.approx([-0.5, -1.0 - 0.5 - 0.25])
    assert escalated.components["resolved"] == -0.5 and escalated.components["escalated"] == -0.5


# --- the metrics builder ---------------------------------------------------------------------------


def test_metric_values() -> None:
    flag = BooleanMetric(type="boolean", when_true=1.0, when_false=-0.5)
    assert [metric_value(flag, v) for v in (1, None, 0.3, 0, -1)] == [1.0, 1.0, 1.0, -0.5, -0.5]
    share = FloatMetric(type="float", low=0.0, high=2.0, at_low=-1.0, at_high=1.0)
    assert [metric_value(share, v) for v in (0, 1, 2, 5, -3, None)] == [-1.0, 0.0, 1.0, 1.0, -1.0, None]
    latency = FloatMetric(type="float", direction="min", low=0, high=10, at_low=0.5, at_high=-0.5)
    assert metric_value(latency, 2.5) == 0.25


def test_metrics_builder_levels_and_anchors() -> None:
    p = MetricsParams(signals={
        "helpful": BooleanMetric(type="boolean", level="generation", when_true=1.0, when_false=-1.0),
        "solved": FloatMetric(type="float", level="session", low=0, high=1, at_low=0, at_high=2.0),
    })
    traj = Sessions().make("m", [Said(), Said(), Said()], [
        ("helpful", 1, 0), ("helpful", 0, None), ("solved", 0.5, None), ("solved", 1, 1), ("solved", None, 0),
        ("other", 1, 0), ("helpful", 1, 9),
    ])
    out = metrics(traj, p)
    # helpful: +1 on turn 0, -1 on the last turn (names none); the one naming a turn not in the session: nothing
    assert out.turn_rewards == [1.0, 0.0, -1.0]
    # solved: a session outcome: 1.0 at the last turn, 2.0 where it names turn 1; none without a value
    assert out.outcome == [0.0, 2.0, 1.0]
    assert out.components == {"helpful": 0.0, "solved": 3.0} and out.total == 3.0


def test_metric_declarations_fail_loudly(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'version = "x"\n[[builders]]\nkind = "metrics"\n'
        '[builders.params.signals.a]\ntype = "boolean"\nwhen_true = 1.0\nwhen_false = 0.0\nlow = 0.0\n'
        '[builders.params.signals.b]\ntype = "float"\nlow = 1.0\nhigh = 0.0\nat_low = 0.0\nat_high = 1.0\n'
        '[builders.params.signals.c]\ntype = "boolean"\ndirection = "min"\nwhen_true = 1.0\nwhen_false = 0.0\n'
        '[builders.params.signals.d]\ntype = "float"\nlow = 0.0\nhigh = 1.0\nat_low = 1.0\nat_high = 0.0\n'
        '[builders.params.signals.e]\ntype = "counter"\n'
        '[builders.params.signals.f]\ntype = "boolean"\nwhen_true = 1.0\n'
    )
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = str(err.value)
    for where in ("signals.a.boolean.low", "signals.b.float", "high must be above low", "signals.c.boolean",
                  "signals.d.float", "the worse value is rewarded more", "signals.e", "signals.f.boolean.when_false"):
        assert where in text, where
    # a metric that another enabled builder already reads would count twice
    path.write_text('version = "x"\n[[builders]]\nkind = "outcome"\n[[builders]]\nkind = "metrics"\n'
                    '[builders.params.signals.tests_passed]\ntype = "float"\nlow = 0\nhigh = 1\nat_low = 0\nat_high = 1\n')
    with pytest.raises(SpecError, match="'tests_passed' is read by both the outcome and the metrics builder"):
        load_spec(path)
    path.write_text('version = "x"\n[[builders]]\nkind = "metrics"\nparams = { signals = {} }\n')
    with pytest.raises(SpecError, match="signals"):
        load_spec(path)
