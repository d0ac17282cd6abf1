"""Trajectory assembly: the served turns of one session (plus its feedback) -> one TrajectoryEvent.

Pure: no IO, no clock. The same inputs always give the same event, down to its ``event_id``, so
re-emitting a trajectory after a crash is a no-op for every idempotent consumer.

Segment rule (token ids exactly as served, never re-tokenised). Generations are taken in served
order: by ``ts``, then ``choice_index``, then input order, so the choices of one ``n > 1`` request
(one group: the same ``ts``) come in index order whatever order they arrived in. With ``T`` the
tokens of the current (newest) segment, a generation with prompt ids ``P`` and completion ids ``C``:

- extends the segment when ``T`` is non-empty and ``P`` starts with ``T``: the new context
  ``P[len(T):]`` is appended with mask 0 and logprob 0.0, then ``C`` with mask 1 and the served
  logprobs;
- otherwise starts a new segment ``P + C`` (prompt: mask 0, logprob 0.0; completion: mask 1).

Sibling choices share ``P``: choice 0 extends or starts a segment as any turn does, and each later
sibling starts its own segment ``P + C`` (its ``P`` cannot start with its elder sibling's ``P + C``;
when that completion was empty it extends instead, which gives the same tokens). The turn after a
group extends only the newest segment, the last sibling's: a user who went on with another choice
sends a prompt that starts a new segment of its own.

Each turn records ``tokens[start:end] == C`` in its segment, with the version that served it and
its generation's ``group_id`` and ``choice_index``.

Consent (``flywheel.consent``): a trajectory is ``data_use = "store_only"`` when any of its
generations is, so a session that was not wholly for training is scored but never trained on.

Invariants: mask is 1 exactly on completion tokens; ``logprobs`` is 0.0 wherever mask is 0; turns
appear across segments in served order, so ``[t for s in segments for t in s.turns]`` lines up with
``generation_ids``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from flywheel.events import FeedbackEvent, GenerationEvent, Segment, TrajectoryEvent, Turn, trajectory_id_for

ClosedReason = Literal["outcome", "inactivity", "late_feedback"]


def trajectory_event_id(trajectory_id: str, revision: int) -> str:
    """The idempotency key of one revision of a trajectory."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel-trajectory-event:{trajectory_id}:{revision}").hex


def prompt_key_of(request: dict[str, Any]) -> str | None:
    """The content of the first user message of a chat request (the task the session is about)."""
    for message in request.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if content is None:
                return None
            return content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return None


class _OpenSegment:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []

    def add(self, tokens: Sequence[int], trainable: bool, logprobs: Sequence[float] | None = None) -> None:
        self.tokens.extend(tokens)
        self.mask.extend([1 if trainable else 0] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))

    def freeze(self) -> Segment:
        return Segment(tokens=self.tokens, mask=self.mask, logprobs=self.logprobs, turns=self.turns)


def build_segments(generations: Sequence[GenerationEvent]) -> list[Segment]:
    """Segments of generations already in served order (see the module docstring for the rule)."""
    segments: list[_OpenSegment] = []
    for gen in generations:
        prompt, completion = list(gen.prompt_token_ids), list(gen.completion_token_ids)
        current = segments[-1] if segments else None
        if current is not None and current.tokens and prompt[: len(current.tokens)] == current.tokens:
            current.add(prompt[len(current.tokens) :], trainable=False)
        else:
            current = _OpenSegment()
            segments.append(current)
            current.add(prompt, trainable=False)
        start = len(current.tokens)
        current.add(completion, trainable=True, logprobs=[float(x) for x in gen.completion_logprobs])
        current.turns.append(turn_of(gen, start, len(current.tokens)))
    return [segment.freeze() for segment in segments]


def turn_of(gen: GenerationEvent, start: int, end: int) -> Turn:
    """The turn ``gen`` becomes, carrying the sampling distribution its logprobs belong to; raises
    ``ValueError`` (pydantic's) for sampling a trajectory cannot carry (a negative temperature,
    ``top_p`` outside (0, 1], a logit bias beyond +-100), so ingest can dead-letter such a generation
    instead of failing every later close of its session."""
    s = gen.sampling
    return Turn(
        generation_id=gen.generation_id, start=start, end=end, behaviour_version=gen.model_version,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, logit_bias=s.logit_bias,
        untrainable=f"unsupported:{','.join(s.unsupported)}"[:200] if s.unsupported else None,
        group_id=gen.group_id, choice_index=gen.choice_index,
    )


def assemble(
    tenant: str,
    session_id: str,
    generations: Sequence[GenerationEvent],
    feedback: Sequence[FeedbackEvent],
    *,
    closed_reason: ClosedReason,
    revision: int = 0,
) -> TrajectoryEvent:
    """One session's generations and feedback as a trajectory (revision ``revision``).

    ``ts`` is the newest event's timestamp (deterministic, unlike the wall clock). Raises
    ``ValueError`` for a session without generations: there is nothing to train on.
    """
    if not generations:
        raise ValueError(f"session {tenant}/{session_id} has no generations to assemble")
    ordered = [gen for _, gen in sorted(enumerate(generations),
                                        key=lambda pair: (pair[1].ts, pair[1].choice_index, pair[0]))]
    ordered_feedback = [fb for _, fb in sorted(enumerate(feedback), key=lambda pair: (pair[1].ts, pair[0]))]
    trajectory_id = trajectory_id_for(tenant, session_id)
    newest = max([gen.ts for gen in ordered] + [fb.ts for fb in ordered_feedback])
    return TrajectoryEvent(
        event_id=trajectory_event_id(trajectory_id, revision),
        ts=newest,
        tenant=tenant,
        session_id=session_id,
        trajectory_id=trajectory_id,
        revision=revision,
        model_line=ordered[0].model_line,
        segments=build_segments(ordered),
        generation_ids=[gen.generation_id for gen in ordered],
        feedback=ordered_feedback,
        closed_reason=closed_reason,
        prompt_key=prompt_key_of(ordered[0].request),
        data_use="train" if all(gen.data_use == "train" for gen in ordered) else "store_only",
    )
