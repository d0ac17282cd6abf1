"""The simulated product task: an assistant that puts letters in alphabetical order.

A user asks, in one of a few phrasings, to sort a handful of distinct lowercase letters
("sort these letters: q d m a"); the right answer is the letters in order, space separated
("a d m q"). After a wrong answer the user may say :data:`RETRY_MESSAGE` and the assistant tries
again in the same conversation.

The task is small enough for a few-layer transformer to learn in seconds, yet every answer is a
sequence of decisions, so an imperfect policy makes the same kind of slips people do: swapping two
neighbours, forgetting a letter, repeating one, or echoing the input unsorted. :func:`mistake`
produces those slips; the pretraining corpus mixes them with correct answers so the built model
is right only part of the time and reinforcement learning has something to fix.

Invariants (all functions here are pure and deterministic given their ``rng``):

- An instance is identified by its letter sequence. A fixed, seed-independent slice of all
  instances (those whose hash falls in :data:`HELDOUT_BUCKETS` of :data:`N_BUCKETS`) is the
  held-out pool: :func:`heldout_problems` draws only from it and :func:`traffic_problem` never
  does, whatever the seeds.
- :func:`is_correct` ignores surrounding whitespace and nothing else.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

#: The alphabet problems draw from (distinct letters per problem).
ALPHABET: tuple[str, ...] = tuple("abcdefghijklmnop")
MIN_LETTERS = 3
MAX_LETTERS = 6
#: What a user says after a wrong answer.
RETRY_MESSAGE = "that's wrong, try again"
#: The ways a user asks; ``{letters}`` is the space separated input.
PHRASINGS: tuple[str, ...] = (
    "sort these letters: {letters}",
    "please sort: {letters}",
    "put these in alphabetical order: {letters}",
    "can you sort {letters}",
)
N_BUCKETS = 10
HELDOUT_BUCKETS = frozenset({0})


@dataclass(frozen=True)
class Problem:
    """One request: the user's message and the exact expected answer."""

    prompt: str
    answer: str


def user_message(problem: Problem) -> str:
    """The text a user sends for ``problem`` (the prompt is already a full message)."""
    return problem.prompt


def letters_of(problem: Problem) -> tuple[str, ...]:
    """The input letters of ``problem``, in the order the user gave them."""
    return tuple(problem.prompt.split()[-len(problem.answer.split()) :])


def _bucket(letters: tuple[str, ...]) -> int:
    digest = hashlib.sha256(" ".join(letters).encode()).digest()
    return int.from_bytes(digest[:8], "big") % N_BUCKETS


def is_heldout_instance(letters: tuple[str, ...]) -> bool:
    """Whether this letter sequence belongs to the held-out pool (never served as traffic)."""
    return _bucket(letters) in HELDOUT_BUCKETS


def _random_letters(rng: random.Random) -> tuple[str, ...]:
    n = rng.randint(MIN_LETTERS, MAX_LETTERS)
    return tuple(rng.sample(ALPHABET, n))


def make_problem(letters: tuple[str, ...], phrasing: int = 0) -> Problem:
    """The problem asking to sort ``letters`` with the given phrasing index."""
    prompt = PHRASINGS[phrasing % len(PHRASINGS)].format(letters=" ".join(letters))
    return Problem(prompt=prompt, answer=" ".join(sorted(letters)))


def traffic_problem(rng: random.Random) -> Problem:
    """A random problem for live traffic or pretraining; never one from the held-out pool."""
    while True:
        letters = _random_letters(rng)
        phrasing = rng.randrange(len(PHRASINGS))
        if not is_heldout_instance(letters):
            return make_problem(letters, phrasing)


def heldout_problems(n: int = 200, seed: int = 1234) -> list[Problem]:
    """``n`` distinct problems from the held-out pool, deterministic in ``seed``."""
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    out: list[Problem] = []
    while len(out) < n:
        letters = _random_letters(rng)
        phrasing = rng.randrange(len(PHRASINGS))
        if is_heldout_instance(letters) and letters not in seen:
            seen.add(letters)
            out.append(make_problem(letters, phrasing))
    return out


def is_correct(problem: Problem, completion_text: str) -> bool:
    """True when the completion is exactly the answer, up to surrounding whitespace."""
    return completion_text.strip() == problem.answer


def mistake(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong answer: a neighbour swap, a dropped or repeated letter, or the input echoed.

    Always differs from ``problem.answer``.
    """
    right = problem.answer.split()
    given = list(letters_of(problem))
    n = len(right)
    while True:
        kind = rng.random()
        out = list(right)
        if kind < 0.55:  # swap two neighbours
            i = rng.randrange(n - 1)
            out[i], out[i + 1] = out[i + 1], out[i]
        elif kind < 0.75:  # forget one letter
            del out[rng.randrange(n)]
        elif kind < 0.87:  # write one letter twice
            i = rng.randrange(n)
            out.insert(i, out[i])
        else:  # give the input back unsorted
            out = given
        if out != right:
            return " ".join(out)


def noisy_answer(problem: Problem, rng: random.Random, p_correct: float) -> str:
    """The correct answer with probability ``p_correct``, otherwise a :func:`mistake`."""
    return problem.answer if rng.random() < p_correct else mistake(problem, rng)
