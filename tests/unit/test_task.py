"""The simulated task: held-out/traffic separation, the correctness check, mistakes, determinism."""

from __future__ import annotations

import random

import pytest

from demo.tinymodel import task
from demo.tinymodel.task import Problem

pytestmark = pytest.mark.unit


def test_heldout_never_served_as_traffic() -> None:
    heldout = task.heldout_problems(200)
    heldout_letters = {task.letters_of(p) for p in heldout}
    rng = random.Random(random.randrange(2**32))
    for _ in range(20_000):
        p = task.traffic_problem(rng)
        assert task.letters_of(p) not in heldout_letters
        assert not task.is_heldout_instance(task.letters_of(p))
    # a different held-out draw is still disjoint from traffic: the pool is fixed, not the seed
    assert all(task.is_heldout_instance(task.letters_of(p)) for p in task.heldout_problems(300, seed=99))


def test_heldout_is_deterministic_distinct_and_sized() -> None:
    a, b = task.heldout_problems(150, seed=7), task.heldout_problems(150, seed=7)
    assert a == b
    assert len({task.letters_of(p) for p in a}) == 150
    assert task.heldout_problems(150, seed=8) != a
    assert task.heldout_problems() == task.heldout_problems(200, seed=1234)


def test_traffic_is_deterministic_in_rng() -> None:
    seed = random.randrange(2**32)
    r1, r2 = random.Random(seed), random.Random(seed)
    assert [task.traffic_problem(r1) for _ in range(50)] == [task.traffic_problem(r2) for _ in range(50)]


def test_problem_shape() -> None:
    rng = random.Random(random.randrange(2**32))
    for _ in range(500):
        p = task.traffic_problem(rng)
        letters = task.letters_of(p)
        assert task.MIN_LETTERS <= len(letters) <= task.MAX_LETTERS
        assert len(set(letters)) == len(letters)
        assert p.answer == " ".join(sorted(letters))
        assert task.user_message(p) == p.prompt
        assert p.prompt.endswith(" ".join(letters))


def test_is_correct_tolerates_only_surrounding_whitespace() -> None:
    p = task.make_problem(("d", "a", "c", "b"))
    assert p == Problem(prompt="sort these letters: d a c b", answer="a b c d")
    assert task.is_correct(p, "a b c d")
    assert task.is_correct(p, "  a b c d\n")
    assert not task.is_correct(p, "a b d c")
    assert not task.is_correct(p, "a  b c d")
    assert not task.is_correct(p, "abcd")
    assert not task.is_correct(p, "A B C D")
    assert not task.is_correct(p, "a b c")
    assert not task.is_correct(p, "a b c d e")
    assert not task.is_correct(p, "")


def test_mistakes_are_wrong_and_plausible() -> None:
    rng = random.Random(random.randrange(2**32))
    for _ in range(2_000):
        p = task.traffic_problem(rng)
        wrong = task.mistake(p, rng)
        assert not task.is_correct(p, wrong)
        # a slip keeps to the input's letters and is at most one letter longer or shorter
        assert set(wrong.split()) <= set(task.letters_of(p))
        assert abs(len(wrong.split()) - len(p.answer.split())) <= 1


def test_noisy_answer_rate() -> None:
    rng = random.Random(random.randrange(2**32))
    problems = [task.traffic_problem(rng) for _ in range(4_000)]
    right = sum(task.is_correct(p, task.noisy_answer(p, rng, 0.4)) for p in problems) / len(problems)
    assert 0.36 < right < 0.44
    assert all(task.is_correct(p, task.noisy_answer(p, rng, 1.0)) for p in problems[:200])


def test_retry_message_is_plain_text() -> None:
    assert task.RETRY_MESSAGE.strip() == task.RETRY_MESSAGE and task.RETRY_MESSAGE
