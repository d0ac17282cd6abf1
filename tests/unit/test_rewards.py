"""Reward builders, credit rules, clipping and the composed scorer against hand-computed rewards."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from flywheel.events import FeedbackEvent, Segment, TrajectoryEvent, Turn
from rewards import credit
from rewards.builders import Ledger, RewardOutput, explicit, implicit, length_penalty, outcome, scale_rating
from rewards.scorer import ENTRY_POINT_GROUP, BuilderError, Scorer
from rewards.spec import (
    CreditSpec,
    ExplicitParams,
    ImplicitParams,
    LengthParams,
    OutcomeParams,
    SpecError,
    load_spec,
    parse_spec,
)

pytestmark = pytest.mark.unit

KINDS = {"thumbs": "explicit", "rating": "explicit", "comment": "explicit", "retry": "implicit", "abandon": "implicit",
         "edit_accepted": "implicit", "edit_rejected": "implicit", "text_kept": "implicit",
         "task_solved": "outcome", "tests_passed": "outcome"}


def traj(n_turns: int, feedback: list[FeedbackEvent], *, split: bool = False, tokens_per_turn: int = 1) -> TrajectoryEvent:
    """``n_turns`` turns ``g0..g{n-1}`` of ``tokens_per_turn`` tokens; ``split`` puts the last turn in its own segment."""
    def segment(ids: list[int]) -> Segment:
        tokens: list[int] = []
        mask: list[int] = []
        turns = []
        for i in ids:
            tokens += [100]
            mask += [0]
            start = len(tokens)
            tokens += [i] * tokens_per_turn
            mask += [1] * tokens_per_turn
            turns.append(Turn(generation_id=f"g{i}", start=start, end=len(tokens), behaviour_version=0))
        return Segment(tokens=tokens, mask=mask, logprobs=[0.0 if m == 0 else -1.0 for m in mask], turns=turns)

    ids = list(range(n_turns))
    segments = [segment(ids[:-1]), segment(ids[-1:])] if split and n_turns > 1 else [segment(ids)]
    return TrajectoryEvent(
        tenant="t", session_id="s", trajectory_id="tr", model_line="m", segments=segments,
        generation_ids=[f"g{i}" for i in ids], feedback=feedback, closed_reason="outcome",
    )


def fb(signal: str, value: float | None = None, gid: str | None = None, kind: str | None = None) -> FeedbackEvent:
    return FeedbackEvent(tenant="t", session_id="s", feedback_id=f"{signal}-{gid}-{value}-{random.random()}",
                         generation_id=gid, kind=kind or KINDS[signal], signal=signal, value=value)


def spec_with(**sections: str) -> object:
    """The default spec with TOML ``sections`` replaced (``builders`` replaces the builder list)."""
    import tomllib

    from rewards.spec import default_spec_text

    data = tomllib.loads(default_spec_text())
    for key, text in sections.items():
        data[key] = tomllib.loads(text)[key]
    return parse_spec(data)


# --- builders --------------------------------------------------------------------------------------


def test_explicit_thumbs_and_ratings() -> None:
    p = ExplicitParams(thumbs_up=1.0, thumbs_down=-2.0, rating=0.5, rating_min=1, rating_max=5)
    feedback = [fb("thumbs", 1, "g0"), fb("thumbs", -1), fb("thumbs", 0, "g0"), fb("rating", 5, "g1"), fb("rating", 2),
                fb("comment", None, "g0"), fb("thumbs", 1, "elsewhere")]
    out = explicit(traj(2, feedback), p)
    # g0: +1 (thumbs up; the 0 thumbs and the comment score nothing); g1 (last, gets session-level):
    # thumbs down -2, rating 5 -> 0.5 * 1, rating 2 -> 0.5 * -0.5
    assert out.turn_rewards == [1.0, -2.0 + 0.5 - 0.25]
    assert out.outcome == [0.0, 0.0]
    assert out.components == {"thumbs": -1.0, "rating": 0.25}
    assert out.total == -0.75
    assert [scale_rating(v, p) for v in (1, 2, 3, 4, 5, 0, 9)] == [-1.0, -0.5, 0.0, 0.5, 1.0, -1.0, 1.0]
    ten = ExplicitParams(rating_min=0, rating_max=10)
    assert scale_rating(7.5, ten) == 0.5


def test_implicit_signals() -> None:
    p = ImplicitParams(edit_accepted=0.4, edit_rejected=-0.6, text_kept=0.8, retry=-0.5, abandon=-1.0)
    feedback = [fb("edit_accepted", None, "g0"), fb("text_kept", 0.25, "g0"), fb("edit_rejected", None, "g1"),
                fb("retry", None, "g1"), fb("abandon", None, "g0"), fb("text_kept", None), fb("text_kept", 7, "g1")]
    out = implicit(traj(3, feedback), p)
    # g0: 0.4 + 0.8 * 0.25; g1: -0.6 - 0.5 + 0.8 * 1 (value clamped to 1); g2 (last): abandon -1 + text_kept 0.8
    assert out.turn_rewards == pytest.approx([0.6, -0.3, -0.2])
    assert out.components == pytest.approx({"edit_accepted": 0.4, "text_kept": 1.8, "edit_rejected": -0.6,
                                            "retry": -0.5, "abandon": -1.0})


def test_outcome_is_a_session_outcome_at_its_anchor() -> None:
    p = OutcomeParams(success=2.0, failure=-1.0)
    out = outcome(traj(3, [fb("tests_passed", 0.5), fb("task_solved", 1, "g0"), fb("task_solved", 0, "nope")]), p)
    # tests_passed 0.5 -> -1 + 0.5 * 3 = 0.5 at the last turn; task_solved names g0 -> 2.0 there
    assert out.turn_rewards == [0.0, 0.0, 0.0]
    assert out.outcome == [2.0, 0.0, 0.5]
    assert out.components == {"outcome": 2.5} and out.total == 2.5


def test_length_penalty() -> None:
    p = LengthParams(free_tokens=3, per_token=0.1, max_penalty=0.25)
    out = length_penalty(traj(2, [], tokens_per_turn=5), p)
    assert out.turn_rewards == pytest.approx([-0.2, -0.2])  # 2 tokens over: -0.2 each
    capped = length_penalty(traj(1, [], tokens_per_turn=10), p)
    assert capped.turn_rewards == [-0.25]  # 7 over -> -0.7, capped at 0.25
    assert length_penalty(traj(2, [], tokens_per_turn=3), p).components == {}


def test_no_turns_and_no_feedback() -> None:
    empty = TrajectoryEvent(tenant="t", session_id="s", trajectory_id="tr", model_line="m", segments=[],
                            generation_ids=[], feedback=[fb("thumbs", 1)], closed_reason="inactivity")
    for builder, p in ((explicit, ExplicitParams()), (implicit, ImplicitParams()), (outcome, OutcomeParams())):
        assert builder(empty, p) == RewardOutput(0.0, [], {}, [])
    assert Scorer(load_spec())(traj(2, [])) == RewardOutput(0.0, [0.0, 0.0], {})


# --- credit rules ----------------------------------------------------------------------------------


def test_credit_rule_shares() -> None:
    assert credit.shares("discounted", 2, 4, 0.5) == [0.25, 0.5, 1.0, 0.0]
    assert credit.shares("discounted", 2, 3, 1.0) == [1.0, 1.0, 1.0]
    assert credit.shares("discounted", 2, 3, 0.0) == [0.0, 0.0, 1.0]
    assert credit.shares("last_turn", 1, 3) == [0.0, 1.0, 0.0]
    assert credit.shares("uniform", 3, 4) == [0.25] * 4
    with pytest.raises(ValueError):
        credit.shares("uniform", 3, 3)


def test_credit_docstring_worked_example() -> None:
    """rewards/credit.py's worked example, through the whole default scorer with each rule."""
    feedback = [fb("thumbs", -1, "g0"), fb("retry", None, "g0"), fb("retry", None, "g1"), fb("thumbs", 1, "g2"),
                fb("task_solved", 1)]
    t = traj(3, feedback)
    expected = {
        "discounted": ([-1.25, 0.0, 2.0], 0.75, {"thumbs": 0.0, "retry": -1.0, "outcome": 1.0, "credit": 0.75}),
        "last_turn": ([-1.5, -0.5, 2.0], 0.0, {"thumbs": 0.0, "retry": -1.0, "outcome": 1.0}),
        "uniform": ([-1.5 + 1 / 3, -0.5 + 1 / 3, 1.0 + 1 / 3], 0.0, {"thumbs": 0.0, "retry": -1.0, "outcome": 1.0}),
    }
    for rule, (turns, total, components) in expected.items():
        out = Scorer(spec_with(credit=f'[credit]\nrule = "{rule}"\ndiscount = 0.5\n'))(t)
        assert out.turn_rewards == pytest.approx(turns), rule
        assert out.total == pytest.approx(total, abs=1e-12), rule
        assert out.components == pytest.approx(components), rule
        assert out.outcome == []


def test_default_spec_reproduces_the_previous_builder() -> None:
    """The scores the walking loop trained on (explicit_outcome_reward with its defaults)."""
    scorer = Scorer(load_spec())
    out = scorer(traj(3, [fb("task_solved", 1), fb("thumbs", -1, "g0")]))
    assert out.turn_rewards == [-0.75, 0.5, 1.0] and out.total == 0.75
    assert out.components == {"outcome": 1.0, "credit": 0.75, "thumbs": -1.0}
    anchored = scorer(traj(3, [fb("task_solved", 1, "g1")], split=True))
    assert anchored.turn_rewards == [0.5, 1.0, 0.0]
    # the pipeline's sessions: solved (thumbs up + solved), failed (thumbs down, retry, then abandon)
    assert scorer(traj(1, [fb("thumbs", 1, "g0"), fb("task_solved", 1)])).total == 2.0
    failed = scorer(traj(2, [fb("thumbs", -1, "g0"), fb("retry", None, "g0"), fb("abandon", None, "g1")]))
    assert failed.turn_rewards == [-1.5, -0.5] and failed.total == -2.0


# --- clipping and composition ----------------------------------------------------------------------


def test_clipping_per_turn_then_total() -> None:
    from rewards.guards import clip

    assert clip([3.0, -0.5, 1.0], 2.0, 0.0) == [2.0, -0.5, 1.0]
    assert clip([2.0, 2.0, 2.0], 0.0, 3.0) == [1.0, 1.0, 1.0]
    assert clip([4.0, 4.0, -1.0], 2.0, 2.0) == pytest.approx([4 / 3, 4 / 3, -2 / 3])  # 2+2-1 = 3 -> x2/3
    assert clip([1.0, -1.0], 0.0, 0.0) == [1.0, -1.0]
    scorer = Scorer(spec_with(guards="[guards]\nclip_turn = 1.5\nclip_total = 2.0\n"))
    out = scorer(traj(2, [fb("thumbs", 1, "g0"), fb("thumbs", 1, "g1"), fb("rating", 5, "g1"), fb("task_solved", 1)]))
    # before: g0 = 1 + 0.5 (discounted outcome) = 1.5, g1 = 1 + 1 + 1 = 3 -> per turn [1.5, 1.5] -> total 3 -> x2/3
    assert out.turn_rewards == pytest.approx([1.0, 1.0])
    assert out.components == pytest.approx({"thumbs": 2.0, "rating": 1.0, "outcome": 1.0, "credit": 0.5, "clip": -2.5})


def test_weights_scale_builders_and_disabled_builders_are_skipped() -> None:
    builders = """
[[builders]]
kind = "explicit"
weight = 2.0
[[builders]]
kind = "outcome"
weight = 0.5
params = { success = 1.0, failure = -1.0 }
[[builders]]
kind = "implicit"
enabled = false
"""
    out = Scorer(spec_with(builders=builders))(traj(2, [fb("thumbs", 1, "g0"), fb("task_solved", 0), fb("retry", None, "g0")]))
    # thumbs 2 x 1 on g0; outcome 0.5 x -1 at g1, discounted 0.5 to g0; the retry is not scored
    assert out.turn_rewards == [2.0 - 0.25, -0.5]
    assert out.components == {"thumbs": 2.0, "outcome": -0.5, "credit": -0.25}


def test_random_sessions_keep_the_sum_invariants() -> None:
    rng = random.Random()
    scorers = [Scorer(spec_with(credit=f'[credit]\nrule = "{r}"\n')) for r in ("discounted", "last_turn", "uniform")]
    for _ in range(100):
        n = rng.randint(1, 5)
        feedback = []
        for _ in range(rng.randint(0, 8)):
            signal = rng.choice(sorted(KINDS))
            value = {"thumbs": rng.choice([-1, 1]), "rating": rng.randint(1, 5)}.get(signal, rng.choice([0, 1, 0.3, None]))
            feedback.append(fb(signal, value, rng.choice([None] + [f"g{i}" for i in range(n)])))
        t = traj(n, feedback, split=rng.random() < 0.5, tokens_per_turn=rng.randint(1, 300))
        for scorer in scorers:
            out = scorer(t)
            assert len(out.turn_rewards) == n and out.outcome == []
            assert math.isclose(out.total, sum(out.turn_rewards), abs_tol=1e-9)
            assert math.isclose(out.total, sum(out.components.values()), abs_tol=1e-9)
            assert all(abs(r) <= 2.0 + 1e-12 for r in out.turn_rewards) and abs(out.total) <= 5.0 + 1e-12
        for builder, p in ((explicit, ExplicitParams()), (implicit, ImplicitParams()), (outcome, OutcomeParams())):
            raw = builder(t, p)
            assert math.isclose(raw.total, sum(raw.turn_rewards) + sum(raw.outcome), abs_tol=1e-9)
            assert math.isclose(raw.total, sum(raw.components.values()), abs_tol=1e-9)


# --- custom builders -------------------------------------------------------------------------------


def streak(trajectory: TrajectoryEvent, params: dict) -> RewardOutput:
    """A custom builder: ``per_turn`` on every turn, ``bonus`` as a session outcome."""
    ledger = Ledger(trajectory)
    for i in range(ledger.n):
        ledger.turn("streak", i, params["per_turn"])
    if ledger.n:
        ledger.session("streak_bonus", ledger.n - 1, params.get("bonus", 0.0))
    return ledger.output()


def test_custom_builder_by_module_function() -> None:
    builders = f"""
[[builders]]
kind = "custom"
target = "{__name__}:streak"
params = {{ per_turn = 0.25, bonus = 1.0 }}
"""
    out = Scorer(spec_with(builders=builders, credit='[credit]\nrule = "uniform"\n'))(traj(4, []))
    assert out.turn_rewards == [0.5, 0.5, 0.5, 0.5]
    assert out.components == {"streak": 1.0, "streak_bonus": 1.0}


def test_custom_builder_by_installed_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real distribution on sys.path registers a builder in the ``flywheel.reward_builders`` group."""
    (tmp_path / "acme_rewards.py").write_text(
        "from rewards.builders import Ledger\n"
        "def politeness(trajectory, params):\n"
        "    ledger = Ledger(trajectory)\n"
        "    for fb in trajectory.feedback:\n"
        "        if fb.kind == 'custom' and fb.signal == 'polite' and (i := ledger.target(fb)) is not None:\n"
        "            ledger.turn('polite', i, params['amount'] * (fb.data or {}).get('level', 1))\n"
        "    return ledger.output()\n"
    )
    dist = tmp_path / "acme_rewards-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\npoliteness = acme_rewards:politeness\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    builders = '[[builders]]\nkind = "custom"\nentry_point = "politeness"\nparams = { amount = 0.5 }\n'
    scorer = Scorer(spec_with(builders=builders))
    polite = FeedbackEvent(tenant="t", session_id="s", feedback_id="p1", generation_id="g0", kind="custom",
                           signal="polite", data={"level": 3})
    out = scorer(traj(2, [polite]))
    assert out.turn_rewards == [1.5, 0.0] and out.components == {"polite": 1.5}
    assert sys.modules["acme_rewards"].__file__ == str(tmp_path / "acme_rewards.py")

    with pytest.raises(SpecError, match="no reward builder 'missing'.*politeness"):
        Scorer(spec_with(builders=builders.replace("politeness", "missing")))


def test_a_builder_breaking_the_contract_is_an_error() -> None:
    builders = f'[[builders]]\nkind = "custom"\ntarget = "{__name__}:one_reward"\n'
    with pytest.raises(BuilderError, match="1 turn rewards .* for 3 turns"):
        Scorer(spec_with(builders=builders))(traj(3, []))
    with pytest.raises(SpecError, match="No module named"):
        Scorer(spec_with(builders='[[builders]]\nkind = "custom"\ntarget = "no_such_module_x:f"\n'))


def one_reward(trajectory: TrajectoryEvent, params: dict) -> RewardOutput:
    return RewardOutput(1.0, [1.0], {"x": 1.0})


# --- the spec --------------------------------------------------------------------------------------


def test_default_spec_file_states_the_model_defaults() -> None:
    from rewards.spec import GuardSpec, JudgeBuilder, NormaliseSpec

    spec = load_spec()
    assert spec.version == "default-v1"
    assert (spec.credit, spec.guards, spec.normalise) == (CreditSpec(), GuardSpec(), NormaliseSpec())
    kinds = {b.kind: b for b in spec.builders}
    assert set(kinds) == {"explicit", "implicit", "outcome", "length", "judge"}
    assert kinds["judge"].enabled is False  # the LLM judge is off by default
    for b in spec.builders:
        assert b.params == type(b.params)(), b.kind
        assert (b.weight, b.name) == (1.0, "")
    assert isinstance(kinds["judge"], JudgeBuilder)
    assert load_spec("") == load_spec(None) == spec and len(spec.sha256) == 64


def test_unknown_keys_and_bad_values_fail_loudly_all_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'version = "x"\nbonus = 1\n'
        '[[builders]]\nkind = "explicit"\nparams = { thumbs_upp = 2.0 }\n'
        '[[builders]]\nkind = "magic"\n'
        '[credit]\nrule = "backwards"\n'
        '[guards]\nheld_out_fraction = 1.5\n'
    )
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = str(err.value)
    for where in ("bonus", "builders.0.explicit.params.thumbs_upp", "builders.1", "credit.rule", "guards.held_out_fraction"):
        assert where in text, where
    assert "5 problem(s)" in text
    with pytest.raises(SpecError, match="cannot read reward spec"):
        load_spec(tmp_path / "missing.toml")
    path.write_text('version = "x"\n[[builders]]\nkind = "custom"\n')
    with pytest.raises(SpecError, match="exactly one of entry_point or target"):
        load_spec(path)
    path.write_text('version = "x"\n[[builders]]\nkind = "outcome"\nenabled = false\n')
    with pytest.raises(SpecError, match="no builder is enabled"):
        load_spec(path)


def test_extends_merges_tables_and_replaces_builders(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text('extends = "default"\nversion = "base"\n[credit]\nrule = "uniform"\n')
    (tmp_path / "child.toml").write_text(
        'extends = "base.toml"\nversion = "child-2"\n[guards]\nheld_out_fraction = 0.0\n'
        '[[builders]]\nkind = "outcome"\n'
    )
    child = load_spec(tmp_path / "child.toml")
    assert child.version == "child-2"
    assert child.credit == CreditSpec(rule="uniform", discount=0.5)
    assert child.guards.held_out_fraction == 0.0 and child.guards.clip_turn == 2.0
    assert [b.kind for b in child.builders] == ["outcome"]
    assert child.sha256 != load_spec().sha256
    (tmp_path / "loop.toml").write_text('extends = "loop.toml"\nversion = "l"\n')
    with pytest.raises(SpecError, match="extends itself"):
        load_spec(tmp_path / "loop.toml")
