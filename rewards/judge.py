"""The LLM-judge builder: asks any OpenAI-compatible ``/v1/chat/completions`` to grade a session.

Off by default (the default spec lists it with ``enabled = false``). When on, the judge sends the
spec's ``rubric`` as the system message and the session's conversation as the user message, at
temperature 0, and parses ``Score: N`` (the last such line; a reply that is only a number also
counts). The score, clamped to ``min_score..max_score``, maps linearly to ``[-1, 1]`` and is a
session outcome anchored at the last turn (component ``judge``), so the credit rule spreads it.

The conversation comes from a ``transcripts`` callable (the worker reads the stored generations:
``rewards.store.DbTranscripts``): the last generation's request messages plus its answer, i.e. the
whole conversation as the user saw it. Transport errors, 429 and 5xx are retried ``attempts`` times
with backoff; then, or on an unparseable reply, ``on_error`` decides: ``raise`` (:class:`JudgeError`)
or ``zero`` (no judge reward; a ``judge_failed`` component of 0 records it).

This is the one builder that does IO; it is deterministic only as far as the judge model is.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from flywheel.events import TrajectoryEvent
from rewards.builders import Ledger, RewardOutput
from rewards.spec import JudgeParams

log = logging.getLogger("flywheel.rewards.judge")

Transcripts = Callable[[TrajectoryEvent], list[dict[str, Any]]]
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*$")


class JudgeError(RuntimeError):
    """The judge could not grade a session."""


def parse_score(text: str) -> float | None:
    """The last ``Score: N`` in ``text`` (or ``text`` itself when it is just a number), else ``None``."""
    found = _SCORE.findall(text)
    if found:
        return float(found[-1])
    bare = _NUMBER.match(text)
    return float(bare.group(1)) if bare else None


def scale_score(score: float, p: JudgeParams) -> float:
    """``min_score..max_score`` -> ``[-1, 1]``, clamped."""
    s = max(p.min_score, min(p.max_score, score))
    return 2.0 * (s - p.min_score) / (p.max_score - p.min_score) - 1.0


def transcript_of(generations: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation of a session from its generation payloads in served order: the last
    request's messages (or its ``prompt``) and the answer it got."""
    if not generations:
        return []
    last = generations[-1]
    request, response = last.get("request") or {}, last.get("response") or {}
    messages = [dict(m) for m in request.get("messages") or [] if isinstance(m, dict)]
    if not messages and request.get("prompt") is not None:
        messages = [{"role": "user", "content": request["prompt"]}]
    choice = (response.get("choices") or [{}])[0]
    answer = choice.get("message") or {"role": "assistant", "content": choice.get("text", "")}
    return messages + [answer]


def render(messages: Sequence[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else "" if content is None else str(content)
        if m.get("tool_calls"):
            text = (text + "\n" if text else "") + f"[tool calls] {m['tool_calls']}"
        lines.append(f"{str(m.get('role', 'user')).upper()}: {text}")
    return "\n\n".join(lines)


class Judge:
    """A builder ``(trajectory, params) -> RewardOutput`` bound to an endpoint and a transcript source."""

    def __init__(self, params: JudgeParams, transcripts: Transcripts, api_key: str = "",
                 client: httpx.Client | None = None) -> None:
        self.params = params
        self.transcripts = transcripts
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=params.timeout_s, headers=headers)
        self.url = params.base_url.rstrip("/") + "/v1/chat/completions"

    def __call__(self, traj: TrajectoryEvent, params: JudgeParams) -> RewardOutput:
        ledger = Ledger(traj)
        if ledger.n == 0:
            return ledger.output()
        try:
            score = self.grade(self.transcripts(traj), params)
        except JudgeError as exc:
            if params.on_error == "raise":
                raise
            log.warning("judge gave no grade for %s: %s", traj.trajectory_id, exc)
            ledger.turn("judge_failed", ledger.n - 1, 0.0)
            return ledger.output()
        # A session outcome: split over the last step, as every session-level signal is
        # (rewards.builders), so a grade never favours one of a final group's choices.
        for i, part in ledger.last_parts():
            ledger.session("judge", i, scale_score(score, params) * part)
        return ledger.output()

    def grade(self, messages: list[dict[str, Any]], params: JudgeParams) -> float:
        """The judge's raw score for a conversation."""
        body = {
            "model": params.model,
            "messages": [{"role": "system", "content": params.rubric}, {"role": "user", "content": render(messages)}],
            "temperature": 0,
            "max_tokens": params.max_tokens,
        }
        problem = ""
        for attempt in range(params.attempts):
            if attempt:
                time.sleep(min(0.25 * 2**attempt, 5.0))
            try:
                r = self.client.post(self.url, json=body)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                problem = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code != 200:
                raise JudgeError(f"judge at {self.url} answered HTTP {r.status_code}: {r.text[:200]}")
            try:
                text = r.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise JudgeError(f"judge at {self.url} sent no chat completion: {exc}") from exc
            score = parse_score(text)
            if score is None:
                raise JudgeError(f"no score in the judge's reply {text[:200]!r}")
            return score
        raise JudgeError(f"judge at {self.url} unreachable after {params.attempts} attempt(s): {problem}")

    def close(self) -> None:
        self.client.close()
