"""Guard builders that read what a turn said: broken tool calls, needless clarifying questions, echoes.

Each is a pure function ``(trajectory, texts, params) -> RewardOutput`` over the turns' texts
(``rewards.texts``; the scorer binds them to its generations source) and puts a penalty (a turn
reward, never positive) on the turns that show a known reward hack, so that the hack scores below
the honest behaviour it imitates (tests/unit/test_reward_hacks.py holds a set for each):

- ``tool_calls`` (component ``tool_call_invalid``): a turn that ends in a broken tool call
  (:func:`broken_call`). The hack: a call the harness cannot run ends the episode before the tests
  run, dodging their failure.
- ``clarify`` (component ``clarify``): a turn that asks instead of acting on a specified task
  (:func:`asks_instead_of_acting`). The hack: deferring the work dodges the risk of doing it badly.
- ``echo`` (component ``echo``): a turn whose text's word n-grams are mostly the user's own
  (:func:`echo_overlap`; tool-call arguments are not read: an edit tool's ``old`` text is a copy by
  design). The hack: the user's text handed back survives every "was it kept" signal (a paragraph
  "improved" into itself is kept whole; code copied from above the cursor is easy to accept). Where
  copying is the task (proofreading) it does not apply.

A turn without text (its generation not stored) is left alone. These are heuristics over text: the
params (``rewards.spec``) say where each one draws its line, and a spec may weight or disable it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from flywheel.events import TrajectoryEvent
from rewards.builders import Ledger, RewardOutput
from rewards.spec import ClarifyParams, EchoParams, ToolCallParams
from rewards.texts import TextBuilder, TurnText

_WORD = re.compile(r"\w+")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")


def broken_call(t: TurnText, p: ToolCallParams) -> str | None:
    """Why the turn ends in a broken tool call, or ``None``: a call without a function name, to a
    name the request did not offer (``check_names``; a call when none was offered is one), with
    arguments that are not a JSON object (custom tools take free text); or, with no parsed call,
    ``finish_reason = "tool_calls"`` or call syntax in the text (``markers``)."""
    for call in t.tool_calls:
        call = call if isinstance(call, Mapping) else {}
        custom = isinstance(call.get("custom"), Mapping)
        body = call.get("custom") if custom else call.get("function")
        name = body.get("name") if isinstance(body, Mapping) else None
        if not isinstance(name, str) or not name:
            return "a tool call without a name"
        if p.check_names and name not in t.tools:
            return f"a call to {name!r}, which the request did not offer"
        if custom:
            continue
        args = body.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            return f"arguments of {name!r} are not JSON"
        if not isinstance(parsed, dict):
            return f"arguments of {name!r} are not a JSON object"
    if not t.tool_calls:
        if t.finish_reason == "tool_calls":
            return "finish_reason is tool_calls but there is no call"
        marker = next((m for m in p.markers if m in t.answer), None)
        if marker is not None:
            return f"tool-call syntax {marker!r} left in the text"
    return None


def tool_calls(traj: TrajectoryEvent, texts: list[TurnText | None], p: ToolCallParams) -> RewardOutput:
    """``-penalty`` on each turn that ends in a broken tool call (:func:`broken_call`)."""
    ledger = Ledger(traj)
    for i, t in enumerate(texts):
        if t is not None and p.penalty and broken_call(t, p) is not None:
            ledger.turn("tool_call_invalid", i, -p.penalty)
    return ledger.output()


def asks_instead_of_acting(t: TurnText, p: ClarifyParams) -> bool:
    """The turn answers the user's message (not a tool result), could have acted (the request
    offered tools, when ``require_tools``), was given a task (``min_task_words`` words or more),
    calls no tool, and is a question: a sentence ending in ``?`` or holding one of ``phrases``, with
    at most ``max_other_words`` words in its other sentences."""
    if t.tool_calls or t.last_role != "user" or (p.require_tools and not t.tools):
        return False
    if len(_WORD.findall(t.user)) < p.min_task_words:
        return False
    asked, other = False, 0
    for sentence in _SENTENCE.split(t.answer.strip()):
        lowered = sentence.strip().lower()
        if lowered.endswith("?") or any(phrase.lower() in lowered for phrase in p.phrases):
            asked = True
        else:
            other += len(_WORD.findall(lowered))
    return asked and other <= p.max_other_words


def clarify(traj: TrajectoryEvent, texts: list[TurnText | None], p: ClarifyParams) -> RewardOutput:
    """``-penalty`` on each turn that asks instead of acting (:func:`asks_instead_of_acting`)."""
    ledger = Ledger(traj)
    for i, t in enumerate(texts):
        if t is not None and p.penalty and asks_instead_of_acting(t, p):
            ledger.turn("clarify", i, -p.penalty)
    return ledger.output()


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def echo_overlap(answer: str, user: str, n: int) -> tuple[float, int]:
    """The share of ``answer``'s word ``n``-grams (lower-cased) found in ``user``, and how many there are."""
    grams = ngrams(answer, n)
    if not grams:
        return 0.0, 0
    theirs = set(ngrams(user, n))
    return sum(g in theirs for g in grams) / len(grams), len(grams)


def echo(traj: TrajectoryEvent, texts: list[TurnText | None], p: EchoParams) -> RewardOutput:
    """``-penalty * (overlap - free_overlap) / (1 - free_overlap)`` on each turn of at least
    ``min_ngrams`` n-grams whose overlap with the user's messages (:func:`echo_overlap`) is above
    ``free_overlap``: a full echo costs ``penalty``."""
    ledger = Ledger(traj)
    for i, t in enumerate(texts):
        if t is None or not p.penalty:
            continue
        overlap, count = echo_overlap(t.answer, t.users, p.n)
        if count >= p.min_ngrams and overlap > p.free_overlap:
            ledger.turn("echo", i, -p.penalty * (overlap - p.free_overlap) / (1 - p.free_overlap))
    return ledger.output()


TEXT_BUILTIN: Mapping[str, TextBuilder] = {
    "tool_calls": tool_calls,
    "clarify": clarify,
    "echo": echo,
}
