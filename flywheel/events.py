"""Wire contracts, version 1: the only shapes that cross the bus.

Every event carries ``event_id`` (the idempotency key: a replayed or retried event has the same
id), ``schema_version``, a UTC ``ts``, a ``tenant`` and a ``session_id`` (also the bus key, so one
session's events stay in order on one partition). Events are immutable; consumers must accept an
event they have already seen and do nothing.

Token sequences are flat lists of ints exactly as the serving engine produced them; nothing
downstream re-tokenises text.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeInt, StringConstraints, model_validator

from flywheel import jsonpolicy
from flywheel.identity import HASH_PATTERN

SCHEMA_VERSION = 1

#: Identifiers (ids, tenants, signals) are printable: no control characters, NUL included, which
#: PostgreSQL would refuse long after the gateway had accepted the event.
Ident = Annotated[str, StringConstraints(min_length=1, pattern=r"^[^\x00-\x1f\x7f]+$")]
TokenIds = list[NonNegativeInt]
#: Every model rejects NaN and infinities: JSON would silently carry them as null.
_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def new_id() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = _STRICT
    topic: ClassVar[str]

    event_id: Ident = Field(default_factory=new_id, max_length=128)
    schema_version: int = SCHEMA_VERSION
    ts: AwareDatetime = Field(default_factory=utcnow)
    tenant: Ident = Field(max_length=128)
    session_id: Ident = Field(max_length=256)

    #: Fields added within version 1: left out on the wire while they hold their default, so
    #: consumers that predate them still read those events (upgrade consumers before producers).
    wire_optional: ClassVar[tuple[str, ...]] = ()

    def to_bytes(self) -> bytes:
        fields = type(self).model_fields
        omit = {name for name in self.wire_optional if getattr(self, name) == fields[name].default}
        return self.model_dump_json(exclude=omit or None).encode()

    @classmethod
    def from_bytes(cls, raw: bytes):
        """Decode under the system's JSON policy (``flywheel.jsonpolicy``: what the gateway
        accepts, every consumer reads) and validate; raises ``ValueError`` on bad input
        (``JSONPolicyError`` naming the field, or ``pydantic.ValidationError``): the caller
        dead-letters the record."""
        return cls.model_validate(jsonpolicy.loads(raw))


#: What an event may be used for (``flywheel.consent``; data of use ``none`` is never an event).
TrainUse = Literal["train", "store_only"]

#: Logit bias: token id (as a JSON object key) -> bias in [-100, 100].
LogitBias = dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100, le=100)]]


class SamplingParams(BaseModel):
    """The sampling parameters the engine applied (the client's, else the model's defaults), as
    ``flywheel.sampling.applied`` computes them; a generation recorded before a knob existed has
    its neutral value."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: LogitBias | None = None
    max_tokens: int | None = None
    seed: int | None = None
    n: int = 1
    #: Request fields that reshaped the distribution beyond these knobs (structured output, banned
    #: tokens...): the generation shapes rewards but is never trained on.
    unsupported: list[str] = Field(default_factory=list)


class GenerationEvent(_Event):
    """One served completion, with everything needed to train on it."""

    topic: ClassVar[str] = "generations"
    wire_optional: ClassVar[tuple[str, ...]] = ("user_hash", "data_use")

    generation_id: Ident = Field(max_length=128)
    model_line: Ident
    model_version: int = Field(ge=0)
    node_id: Ident
    request: dict[str, Any]
    response: dict[str, Any]
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    #: Log-probability of each sampled completion token, as the engine sampled it.
    completion_logprobs: list[float]
    sampling: SamplingParams
    finish_reason: str | None = None
    latency_ms: float = Field(ge=0)
    #: A request for ``n > 1`` choices is one group of samples of one prompt: each choice is its
    #: own event, the group's events share ``group_id`` (the request's id) and the prompt, and
    #: ``choice_index`` is the choice's ``index`` in the response. ``None`` and 0 for ``n = 1``.
    group_id: Ident | None = Field(None, max_length=128)
    choice_index: int = Field(0, ge=0)
    #: The end user the request named (OpenAI's ``user`` or the ``X-Flywheel-User`` header) as its
    #: keyed hash (``flywheel.identity.user_hash``); the raw id is in no event. None: no user named.
    #: (Added within version 1: an event without an end user leaves it out on the wire, so consumers
    #: that predate it still read those; upgrade consumers before gateways that send it.)
    user_hash: str | None = Field(None, pattern=HASH_PATTERN)
    #: What the tenant and the request let flywheel do with it (``flywheel.consent``): ``store_only``
    #: is stored and scored, never trained on (``none`` is never captured at all). Added within
    #: version 1, left out on the wire at its default, like ``user_hash``.
    data_use: TrainUse = "train"

    @model_validator(mode="after")
    def _aligned(self) -> GenerationEvent:
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError("completion_logprobs must have one entry per completion token")
        return self


FeedbackKind = Literal["explicit", "implicit", "outcome", "custom"]
FEEDBACK_SIGNALS: dict[str, tuple[str, ...]] = {
    "explicit": ("thumbs", "rating", "comment"),
    "implicit": ("edit_accepted", "edit_rejected", "text_kept", "retry", "abandon"),
    "outcome": ("task_solved", "tests_passed"),
    "custom": (),
}


class FeedbackEvent(_Event):
    """A user's signal about one generation or a whole session.

    ``event_id`` is derived from the client-supplied ``feedback_id`` (see :func:`feedback_event_id`)
    so a retried submission is the same event.
    """

    topic: ClassVar[str] = "feedback"

    feedback_id: Ident = Field(max_length=128)
    generation_id: Ident | None = Field(None, max_length=128)
    kind: FeedbackKind
    signal: Ident = Field(max_length=64)
    #: thumbs: +1/-1; rating: any scale, normalised by the reward spec; outcomes: 1 or 0.
    value: float | None = None
    comment: str | None = Field(None, max_length=10_000)
    #: Custom signals carry their own structured payload.
    data: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _signal_matches_kind(self) -> FeedbackEvent:
        allowed = FEEDBACK_SIGNALS[self.kind]
        if allowed and self.signal not in allowed:
            raise ValueError(f"signal {self.signal!r} is not a {self.kind} signal; use one of {list(allowed)}")
        return self


def feedback_event_id(tenant: str, feedback_id: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel-feedback:{tenant}:{feedback_id}").hex


def trajectory_id_for(tenant: str, session_id: str) -> str:
    """The trajectory id of a session: one per (tenant, session), stable across revisions."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel-trajectory:{tenant}:{session_id}").hex


class Turn(BaseModel):
    """One assistant turn inside a trajectory, as offsets into the flat token sequence."""

    model_config = _STRICT
    generation_id: Ident
    #: Completion tokens of this turn occupy ``tokens[start:end]``.
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    behaviour_version: int = Field(ge=0)
    #: The sampling distribution the behaviour logprobs belong to (the trainer recomputes it for
    #: its ratio: ``flywheel.sampling.processed_logprobs``); neutral values in older payloads.
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    #: Why the trainer must not train on this turn even though its distribution is known, e.g.
    #: ``unsupported:response_format``; None: trainable (greedy turns are recognised by temperature).
    untrainable: str | None = Field(None, max_length=200)
    #: The sampled group this turn is one choice of (``GenerationEvent.group_id``): its siblings
    #: answered the same prompt, and the rewards stage uses them as its baseline. None: n = 1.
    group_id: Ident | None = Field(None, max_length=128)
    choice_index: int = Field(0, ge=0)


class Segment(BaseModel):
    """A flat token sequence; turns whose prompt extends the previous turn share one segment."""

    model_config = _STRICT
    tokens: TokenIds
    #: 1 where the token was produced by the assistant (trainable), 0 elsewhere.
    mask: list[int]
    #: Behaviour log-probabilities aligned with ``tokens`` (0.0 where mask is 0).
    logprobs: list[float]
    turns: list[Turn]

    @model_validator(mode="after")
    def _aligned(self) -> Segment:
        if not (len(self.tokens) == len(self.mask) == len(self.logprobs)):
            raise ValueError("tokens, mask and logprobs must have the same length")
        if not set(self.mask) <= {0, 1}:
            raise ValueError("mask must hold only 0 and 1")
        for turn in self.turns:
            if not turn.start <= turn.end <= len(self.tokens):
                raise ValueError(f"turn {turn.generation_id!r} spans tokens [{turn.start}, {turn.end}), outside "
                                 f"its segment of {len(self.tokens)}")
        return self


class TrajectoryEvent(_Event):
    """A closed multi-turn session, ready for scoring."""

    topic: ClassVar[str] = "trajectories"
    wire_optional: ClassVar[tuple[str, ...]] = ("data_use",)

    trajectory_id: str
    #: Increases each time late feedback re-opens and re-emits the trajectory.
    revision: int = Field(0, ge=0)
    model_line: str
    segments: list[Segment]
    #: The generations of the session in served order.
    generation_ids: list[str]
    feedback: list[FeedbackEvent]
    closed_reason: Literal["outcome", "inactivity", "late_feedback"]
    #: The task prompt (first user message) shared by sessions that may be grouped for advantages.
    prompt_key: str | None = None
    #: ``store_only`` when any generation of the session was (``GenerationEvent.data_use``): scored,
    #: never trained on. Left out on the wire at its default.
    data_use: TrainUse = "train"


class ScoredTrajectory(_Event):
    """A trajectory with rewards: what the trainer consumes."""

    topic: ClassVar[str] = "scored"
    wire_optional: ClassVar[tuple[str, ...]] = ("data_use",)

    trajectory_id: str
    revision: int = Field(0, ge=0)
    model_line: str
    segments: list[Segment]
    #: One reward per turn, in the order of the turns across segments.
    turn_rewards: list[float]
    total_reward: float
    reward_components: dict[str, float] = Field(default_factory=dict)
    reward_spec_version: str
    prompt_key: str | None = None
    #: Normalised advantage of each turn, as the rewards stage computed it (group-relative or
    #: against running statistics); ``None`` in payloads from before the stage provided them, and
    #: on held-out samples. The trainer uses them when present.
    turn_advantages: list[float] | None = None
    #: In the held-out slice: scored and stored as the promotion gate's evaluation set, never trained on.
    held_out: bool = False
    #: The trajectory's ``data_use``: ``store_only`` is scored and stored for metrics and gates, never
    #: trained on (the rewards stage does not produce it; a trainer drops it). Left out at its default.
    data_use: TrainUse = "train"

    @model_validator(mode="after")
    def _advantages_aligned(self) -> ScoredTrajectory:
        if self.turn_advantages is not None and len(self.turn_advantages) != len(self.turn_rewards):
            raise ValueError("turn_advantages must have one entry per turn reward")
        turns = sum(len(s.turns) for s in self.segments)
        if len(self.turn_rewards) != turns:
            raise ValueError(f"{len(self.turn_rewards)} turn rewards for {turns} turns: one per turn")
        return self


class VersionEvent(_Event):
    """A model version was published or changed status. ``session_id`` is the model line."""

    topic: ClassVar[str] = "versions"

    model_line: str
    version: int = Field(ge=0)
    kind: Literal["full", "delta"]
    parent: int | None = None
    sha256: str = Field(min_length=64, max_length=64)
    status: Literal["candidate", "canary", "stable", "rolled_back", "retired"]
    bytes: int = Field(ge=0)
    full_bytes: int = Field(ge=0)


ALL_EVENTS: tuple[type[_Event], ...] = (
    GenerationEvent,
    FeedbackEvent,
    TrajectoryEvent,
    ScoredTrajectory,
    VersionEvent,
)


def json_schemas() -> dict[str, Any]:
    """JSON Schema of every wire contract, keyed by class name (``flywheel schema``)."""
    return {cls.__name__: cls.model_json_schema() for cls in ALL_EVENTS}


def schemas_json() -> str:
    return json.dumps({"schema_version": SCHEMA_VERSION, "events": json_schemas()}, indent=2)
