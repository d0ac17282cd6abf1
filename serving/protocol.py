"""OpenAI-compatible request models shared by the gateway and the built-in node.

Invariants:
- Types are strict (``"0.5"`` is not a temperature, ``1`` is not a boolean): a client bug surfaces
  as a 400 naming the field instead of being silently coerced.
- Unknown top-level fields are kept (``extra="allow"``) so the gateway forwards vendor extensions
  to an upstream such as vLLM untouched; unknown fields inside a message are kept as well.
- ``messages`` is never empty and every role is one the chat template knows.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "developer", "user", "assistant", "tool"]

#: Token ids, logprobs and prompt ids the upstream attaches; the gateway strips them unless asked.
MODEL_VERSION_HEADER = "X-Flywheel-Model-Version"
NODE_HEADER = "X-Flywheel-Node"
SESSION_HEADER = "X-Flywheel-Session"
GENERATION_HEADER = "X-Flywheel-Generation"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined); the tiny engine is text-only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat completion request flywheel understands, plus vLLM's
    ``return_token_ids``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int | None = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool | None = False
    user: str | None = None
    return_token_ids: bool | None = False

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class FeedbackItem(BaseModel):
    """One feedback submission; ``feedback_id`` is the client's idempotency key."""

    model_config = ConfigDict(extra="forbid", strict=True)

    feedback_id: str = Field(min_length=1, max_length=128)
    session_id: str | None = Field(None, min_length=1, max_length=256)
    generation_id: str | None = Field(None, min_length=1, max_length=128)
    kind: Literal["explicit", "implicit", "outcome", "custom"]
    signal: str = Field(min_length=1, max_length=64)
    value: float | None = None
    comment: str | None = Field(None, max_length=10_000)
    data: dict[str, Any] | None = None


class FeedbackBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    feedback: list[FeedbackItem] = Field(min_length=1, max_length=1000)
