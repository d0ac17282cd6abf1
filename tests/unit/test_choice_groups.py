"""Sampled groups (the ``n > 1`` choices of one request) from assembly to advantages, against hand values.

A session ``g0`` then one request for three choices ``c0..c2`` (group ``req``): turns ``[g0, c0, c1,
c2]``, steps ``[0, 1, 1, 1]``.
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest

from flywheel.events import FeedbackEvent, GenerationEvent, SamplingParams, TrajectoryEvent
from ingest.assemble import assemble
from rewards import credit
from rewards.builders import Ledger, explicit, implicit, outcome
from rewards.normalise import Normaliser, sibling_baselines
from rewards.scorer import Scorer
from rewards.spec import CreditSpec, ExplicitParams, ImplicitParams, NormaliseSpec, OutcomeParams, load_spec

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
KINDS = {"thumbs": "explicit", "rating": "explicit", "retry": "implicit", "abandon": "implicit",
         "text_kept": "implicit", "task_solved": "outcome"}


def gen(gid: str, prompt: list[int], completion: list[int], *, at: int, group: str | None = None,
        index: int = 0) -> GenerationEvent:
    return GenerationEvent(
        ts=T0 + timedelta(seconds=at), tenant="acme", session_id="s1", generation_id=gid, model_line="m",
        model_version=2, node_id="node-0", request={"messages": [{"role": "user", "content": "q"}]}, response={},
        prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=[-0.5] * len(completion),
        sampling=SamplingParams(n=3 if group else 1), latency_ms=1.0, group_id=group, choice_index=index,
    )


def fb(signal: str, value: float | None = None, gid: str | None = None) -> FeedbackEvent:
    return FeedbackEvent(tenant="acme", session_id="s1", feedback_id=f"{signal}-{gid}-{value}-{random.random()}",
                         generation_id=gid, kind=KINDS[signal], signal=signal, value=value)


def session(feedback: list[FeedbackEvent]) -> TrajectoryEvent:
    """``g0``, then the three choices of request ``req`` (handed over out of order)."""
    prompt = [1, 2, 3, 4]
    choices = [gen(f"c{i}", prompt, [5 + i], at=5, group="req", index=i) for i in range(3)]
    g0 = gen("g0", [1, 2], [3], at=0)
    return assemble("acme", "s1", [choices[2], choices[0], g0, choices[1]], feedback, closed_reason="outcome")


# --- assembly ----------------------------------------------------------------------------------------


def test_choices_are_served_in_index_order_each_with_its_group() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]  # the first turn (1 2 3 -> 4 5) and a new user message (6 7)
    choices = [gen("c0", prompt, [8], at=5, group="req", index=0),
               gen("c1", prompt, [9, 9], at=5, group="req", index=1),
               gen("c2", prompt, [10], at=5, group="req", index=2)]
    first = gen("g1", [1, 2, 3], [4, 5], at=0)
    after = gen("g3", [*prompt, 10, 11], [12], at=9)  # the user went on with choice 2
    traj = assemble("acme", "s1", [choices[2], after, choices[0], first, choices[1]], [], closed_reason="outcome")

    assert traj.generation_ids == ["g1", "c0", "c1", "c2", "g3"]
    # c0 extends g1's segment; c1 and c2 each start their own P + C; g3 extends the newest (c2's)
    assert [s.tokens for s in traj.segments] == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9, 9],
                                                 [1, 2, 3, 4, 5, 6, 7, 10, 11, 12]]
    assert [s.mask for s in traj.segments] == [[0, 0, 0, 1, 1, 0, 0, 1], [0] * 7 + [1, 1], [0] * 7 + [1, 0, 1]]
    turns = [t for s in traj.segments for t in s.turns]
    assert [(t.generation_id, t.start, t.end, t.group_id, t.choice_index) for t in turns] == [
        ("g1", 3, 5, None, 0), ("c0", 7, 8, "req", 0), ("c1", 7, 9, "req", 1), ("c2", 7, 8, "req", 2),
        ("g3", 9, 10, None, 0)]
    assert credit.turn_groups(traj) == [None, "req", "req", "req", None]
    # the order does not depend on the order events were handed over in
    again = assemble("acme", "s1", [first, choices[1], after, choices[0], choices[2]], [], closed_reason="outcome")
    assert again == traj


# --- steps and credit ----------------------------------------------------------------------------------


def test_steps_of_groups() -> None:
    assert credit.steps_of([None, "a", "a", "a", None]) == [0, 1, 1, 1, 2]
    assert credit.steps_of([None, None]) == [0, 1]
    # a group's step is where its first turn is, even if another turn came between its choices
    assert credit.steps_of(["a", None, "a", "b"]) == [0, 1, 0, 2]
    assert credit.steps_of([]) == []


def test_credit_over_steps_reaches_earlier_steps_and_never_the_anchors_siblings() -> None:
    """rewards/credit.py's worked example with a group."""
    rewards, steps, third = [0.0, 0.0, 1.0, -1.0], [0, 1, 1, 1], 1 / 3
    split = [0.0, third, third, third]  # task_solved naming no generation: a third at each choice
    expected = {"discounted": [0.5, third, 1 + third, -1 + third], "last_turn": [0.0, third, 1 + third, -1 + third],
                "uniform": [0.5, 1 / 6, 7 / 6, -5 / 6]}
    for rule, turns in expected.items():
        spec = CreditSpec(rule=rule, discount=0.5)
        assert credit.assign(rewards, split, spec, steps) == pytest.approx(turns), rule
    # an outcome naming one choice is that choice's alone; earlier steps get their share
    assert credit.assign(rewards, [0.0, 0.0, 1.0, 0.0], CreditSpec(), steps) == [0.5, 0.0, 2.0, -1.0]
    # an outcome at an earlier step never reaches a later one
    assert credit.assign(rewards, [2.0, 0.0, 0.0, 0.0], CreditSpec(), steps) == [2.0, 0.0, 1.0, -1.0]
    # an outcome after a group reaches every choice of it (which one the user went on from is unknown)
    assert credit.assign([0.0] * 5, [0.0, 0.0, 0.0, 0.0, 1.0], CreditSpec(), [0, 1, 1, 1, 2]) == [
        0.25, 0.5, 0.5, 0.5, 1.0]
    # the leave-one-out baselines of the siblings cancel the shared outcome: only the thumbs remain
    std = pytest.approx(math.sqrt(2 / 3))
    means = [m for m, _ in sibling_baselines(expected["discounted"][1:], ["req"] * 3)]
    assert means == pytest.approx([1 / 3, -1 / 6, 5 / 6])
    assert [r - m for r, m in zip(expected["discounted"][1:], means)] == pytest.approx([0.0, 1.5, -1.5])
    assert [sd for _, sd in sibling_baselines(expected["discounted"][1:], ["req"] * 3)] == [std] * 3
    for bad in ([0, 1, 1], [0, 2, 2, 2], [1, 1, 1, 1]):
        with pytest.raises(ValueError):
            credit.assign(rewards, [], CreditSpec(), bad)


def test_credit_without_steps_is_exactly_the_per_turn_rule() -> None:
    def per_turn(turn_rewards: list[float], outcome: list[float], spec: CreditSpec) -> list[float]:
        """The rule before steps existed, verbatim."""
        out = [float(r) for r in turn_rewards]
        for anchor, amount in enumerate(outcome):
            if amount:
                for i, share in enumerate(credit.shares(spec.rule, anchor, len(turn_rewards), spec.discount)):
                    out[i] += amount * share
        return out

    rng = random.Random()
    for _ in range(200):
        n = rng.randint(1, 6)
        rewards = [rng.uniform(-2, 2) for _ in range(n)]
        slots = [rng.choice([0.0, rng.uniform(-1, 1)]) for _ in range(n)]
        spec = CreditSpec(rule=rng.choice(["discounted", "last_turn", "uniform"]), discount=rng.random())
        expected = per_turn(rewards, slots, spec)
        assert credit.assign(rewards, slots, spec) == expected
        assert credit.assign(rewards, slots, spec, credit.steps_of([None] * n)) == expected


# --- where signals land ---------------------------------------------------------------------------------


def test_session_level_feedback_is_split_over_the_choices_of_a_final_group() -> None:
    traj = session([fb("thumbs", -1), fb("rating", 5, "c1"), fb("retry", None, "c0"), fb("abandon", None, "g0"),
                    fb("text_kept", 0.5), fb("task_solved", 1), fb("task_solved", 0, "c1"), fb("thumbs", 1, "nope")])
    ledger = Ledger(traj)
    assert (ledger.steps, ledger.last_step, ledger.last) == ([0, 1, 1, 1], [1, 2, 3], 3)
    third = 1 / 3

    # thumbs down (no generation): a third on each choice; the rating names c1 only; the stray thumbs is ignored
    ex = explicit(traj, ExplicitParams())
    assert ex.turn_rewards == pytest.approx([0.0, -third, 1 - third, -third])
    assert ex.components == pytest.approx({"thumbs": -1.0, "rating": 1.0})
    # retry on c0; abandon (naming g0) -0.5 and text_kept 0.5 * 0.5 split over the choices
    im = implicit(traj, ImplicitParams(retry=-0.5, abandon=-0.5, text_kept=0.5))
    assert im.turn_rewards == pytest.approx([0.0, -0.5 - 0.25 * third, -0.25 * third, -0.25 * third])
    assert im.components == pytest.approx({"retry": -0.5, "abandon": -0.5, "text_kept": 0.25})
    # the session's outcome: a third at each choice; the named failure (-1) at c1 alone
    out = outcome(traj, OutcomeParams(success=1.0, failure=-1.0))
    assert out.outcome == pytest.approx([0.0, third, third - 1.0, third]) and out.turn_rewards == [0.0] * 4
    for built in (ex, im, out):
        assert math.isclose(built.total, sum(built.turn_rewards) + sum(built.outcome), abs_tol=1e-12)
        assert math.isclose(built.total, sum(built.components.values()), abs_tol=1e-12)


def test_a_session_without_groups_lands_where_it_always_did() -> None:
    plain = assemble("acme", "s1", [gen("g0", [1], [2], at=0), gen("g1", [1, 2, 3], [4], at=1)],
                     [fb("thumbs", -1), fb("abandon", None, "g0"), fb("task_solved", 1)], closed_reason="outcome")
    ledger = Ledger(plain)
    assert (ledger.steps, ledger.last_step, ledger.last) == ([0, 1], [1], 1)
    assert explicit(plain, ExplicitParams()).turn_rewards == [0.0, -1.0]
    assert implicit(plain, ImplicitParams()).turn_rewards == [0.0, -0.5]
    assert outcome(plain, OutcomeParams()).outcome == [0.0, 1.0]


# --- advantages ------------------------------------------------------------------------------------------


def test_siblings_are_their_own_baseline_leave_one_out() -> None:
    spec = NormaliseSpec(scale="std", std_floor=0.1, clip=0.0, warmup=2)
    std = math.sqrt(2 / 3)
    assert sibling_baselines([1.0, 0.0, -1.0], ["g"] * 3) == [
        (-0.5, pytest.approx(std)), (0.0, pytest.approx(std)), (0.5, pytest.approx(std))]
    adv = Normaliser(spec).advantages("t", "m", "p", [1.0, 0.0, -1.0], ["g", "g", "g"])
    assert adv == pytest.approx([1.5 / std, 0.0, -1.5 / std])
    centred = Normaliser(NormaliseSpec(scale="none", clip=0.0))
    assert centred.advantages("t", "m", None, [1.0, 0.0, -1.0], ["g", "g", "g"]) == [1.5, 0.0, -1.5]
    clipped = Normaliser(NormaliseSpec(scale="none", clip=1.0))
    assert clipped.advantages("t", "m", None, [1.0, 0.0, -1.0], ["g", "g", "g"]) == [1.0, 0.0, -1.0]
    # equal siblings: nothing tells them apart (the std floor keeps the division finite)
    assert Normaliser(spec).advantages("t", "m", None, [0.7, 0.7], ["g", "g"]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="group ids"):
        Normaliser(spec).advantages("t", "m", None, [1.0, 0.0], ["g"])


def test_a_lone_turn_beside_a_group_keeps_the_samples_baseline() -> None:
    spec = NormaliseSpec(decay=0.9, warmup=2, scale="std", std_floor=0.1, clip=0.0)
    norm = Normaliser(spec)
    rewards = [2.0, 1.0, 0.0, -1.0]
    adv = norm.advantages("t", "m", None, rewards, [None, "g", "g", "g"])
    # the lone turn: running statistics over all four rewards (a plain mean so far): mean 0 before,
    # then mean 0.5 and variance (1.5² + 0.5² + 0.5² + 1.5²) / 4 = 1.25
    sib = math.sqrt(2 / 3)  # pstdev of [1, 0, -1]; leave-one-out means [-0.5, 0, 0.5]
    assert adv == pytest.approx([2.0 / math.sqrt(1.25), 1.5 / sib, 0.0, -1.5 / sib])
    # every turn was observed, siblings included
    assert norm.baseline("t", "m", None, [])[:2] == (pytest.approx(0.5), pytest.approx(math.sqrt(1.25)))
    # a group with one member in the sample is no group: the sample's baseline
    lone = Normaliser(spec).advantages("t", "m", None, [2.0, 1.0], [None, "g"])
    assert lone == Normaliser(spec).advantages("t", "m", None, [2.0, 1.0])
    # with a prompt-key group known, the lone turn's baseline is that group's (never the siblings')
    keyed = Normaliser(NormaliseSpec(group_min=1, scale="none", clip=0.0))
    keyed.observe("t", "m", "p", [3.0])
    assert keyed.advantages("t", "m", "p", [1.0, 4.0, 0.0], [None, "g", "g"]) == [-2.0, 4.0, -4.0]


def test_turns_without_groups_get_the_advantages_they_always_did() -> None:
    rng = random.Random()
    spec = NormaliseSpec(group_min=2, group_window=4, decay=0.9, warmup=3, scale="std", std_floor=0.1, clip=2.0)
    before, after = Normaliser(spec), Normaliser(spec)
    for _ in range(200):
        rewards = [rng.uniform(-2, 2) for _ in range(rng.randint(1, 4))]
        key = rng.choice([None, "p", "q"])
        assert after.advantages("t", "m", key, rewards, [None] * len(rewards)) == before.advantages("t", "m", key, rewards)
    plain = assemble("acme", "s1", [gen("g0", [1], [2], at=0), gen("g1", [1, 2, 3], [4], at=1)],
                     [fb("thumbs", 1, "g0"), fb("task_solved", 1)], closed_reason="outcome")
    scored = Scorer(load_spec())(plain)
    assert scored.turn_rewards == [1.5, 1.0]
    assert (Normaliser(spec).advantages("t", "m", "q", scored.turn_rewards, credit.turn_groups(plain))
            == Normaliser(spec).advantages("t", "m", "q", scored.turn_rewards))


def test_scorer_and_normaliser_end_to_end_with_a_final_group() -> None:
    """c1 thumbs up, c2 thumbs down, then task_solved for the session, under the default spec."""
    traj = session([fb("thumbs", 1, "c1"), fb("thumbs", -1, "c2"), fb("task_solved", 1)])
    out = Scorer(load_spec())(traj)
    # per turn [0, 0, 1, -1]; the outcome +1 a third at each choice, discounted 0.5 back to g0
    third = 1 / 3
    assert out.turn_rewards == pytest.approx([0.5, third, 1 + third, -1 + third])
    assert out.total == pytest.approx(1.5) and out.outcome == []  # as a one-choice session's
    assert out.components == pytest.approx({"thumbs": 0.0, "outcome": 1.0, "credit": 0.5})
    assert math.isclose(out.total, sum(out.turn_rewards), abs_tol=1e-12)
    assert math.isclose(out.total, sum(out.components.values()), abs_tol=1e-12)

    spec = load_spec().normalise
    adv = Normaliser(spec).advantages("acme", "m", traj.prompt_key, out.turn_rewards, credit.turn_groups(traj))
    # g0 alone: running statistics, not warm yet (std 1), mean 0 -> 0.5; the choices: leave-one-out
    # means [1/3, -1/6, 5/6], std sqrt(2/3): the shared outcome cancels, the thumbs stay
    assert len(out.turn_rewards) < spec.warmup
    sib = math.sqrt(2 / 3)
    assert adv == pytest.approx([0.5, 0.0, 1.5 / sib, -1.5 / sib])


def test_the_judges_grade_is_split_over_a_final_group() -> None:
    """The judge's grade is a session outcome: a third at each of the final three choices (so it
    favours none of them), all of it at the last turn of a session without groups."""
    import httpx

    from rewards.judge import Judge
    from rewards.spec import JudgeParams

    def judge_endpoint(request: httpx.Request) -> httpx.Response:  # an OpenAI-compatible grader's answer
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Score: 10"}}]})

    params = JudgeParams()
    judge = Judge(params, lambda traj: [{"role": "user", "content": "q"}],
                  client=httpx.Client(transport=httpx.MockTransport(judge_endpoint)))
    grouped = judge(session([]), params)
    assert grouped.outcome == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3]) and grouped.total == pytest.approx(1.0)
    plain = assemble("acme", "s1", [gen("g0", [1], [2], at=0), gen("g1", [1, 2, 3], [4], at=1)], [],
                     closed_reason="outcome")
    assert judge(plain, params).outcome == [0.0, 1.0]
