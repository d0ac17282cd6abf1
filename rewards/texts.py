"""What each turn said, read from its stored generation: the user's words, the answer, its tool calls.

The text guards (``rewards.text_guards``) judge a turn by what it said, which a trajectory does not
carry (it holds token ids only, and nothing downstream re-tokenises). A *generations source*
(:data:`Generations`; the workers use ``rewards.store.DbGenerations``) gives the stored
``GenerationEvent`` payloads of a trajectory by generation id, and :func:`turn_text` reads one:

- ``user``: the last user message of the request (a text completion's ``prompt``); ``users``:
  every user message, joined; ``last_role``: the role of the request's last message (``user``,
  ``tool``...; a text completion's is ``user``);
- ``answer``: the assistant's text (content parts joined); ``tool_calls``: the calls as the response
  carried them; ``tools``: the names of the functions the request offered; ``finish_reason``.

Reading never fails: a payload of an unexpected shape gives empty fields. A turn whose generation
is not stored has no text (``None``) and the guards leave it alone. Pure, except for the source
:class:`TurnTexts` calls (once per trajectory, however many guards read it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flywheel.events import TrajectoryEvent
from rewards.builders import Builder, RewardOutput

#: ``trajectory -> {generation_id: GenerationEvent payload}`` for the generations that are stored.
Generations = Callable[[TrajectoryEvent], Mapping[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class TurnText:
    user: str = ""
    users: str = ""
    last_role: str = ""
    answer: str = ""
    tool_calls: list[Any] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    finish_reason: str | None = None


def content_text(content: Any) -> str:
    """A message's ``content``: a string, or the text of its parts (``{"type": "text", "text": ...}``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _tool_names(tools: Any) -> list[str]:
    names = []
    for tool in tools if isinstance(tools, list) else []:
        spec = _dict(_dict(tool).get("function") or _dict(tool).get("custom") or tool)
        if isinstance(spec.get("name"), str):
            names.append(spec["name"])
    return names


def turn_text(payload: Mapping[str, Any]) -> TurnText:
    """What one generation's request and response said (module docstring)."""
    request, response = _dict(payload.get("request")), _dict(payload.get("response"))
    messages = [m for m in request.get("messages") or [] if isinstance(m, Mapping)]
    prompt = request.get("prompt")
    if not messages and prompt is not None:
        parts = prompt if isinstance(prompt, list) else [prompt]
        messages = [{"role": "user", "content": "\n".join(p for p in parts if isinstance(p, str))}]
    said = [content_text(m.get("content")) for m in messages if m.get("role") == "user"]
    choices = response.get("choices")
    choice = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    message = _dict(choice.get("message"))
    answer = content_text(message.get("content")) if message else str(choice.get("text") or "")
    calls = message.get("tool_calls")
    finish = choice.get("finish_reason")
    return TurnText(
        user=said[-1] if said else "",
        users="\n".join(said),
        last_role=str(messages[-1].get("role", "")) if messages else "",
        answer=answer,
        tool_calls=list(calls) if isinstance(calls, list) else [],
        tools=_tool_names(request.get("tools")) + _tool_names(request.get("functions")),
        finish_reason=finish if isinstance(finish, str) else None,
    )


def turn_texts(traj: TrajectoryEvent, found: Mapping[str, Mapping[str, Any]]) -> list[TurnText | None]:
    """Each turn's text, in turn order across segments (``None``: its generation is not in ``found``)."""
    return [turn_text(found[turn.generation_id]) if turn.generation_id in found else None
            for segment in traj.segments for turn in segment.turns]


#: A text guard: ``(trajectory, each turn's text, params) -> RewardOutput``.
TextBuilder = Callable[[TrajectoryEvent, list[TurnText | None], Any], RewardOutput]


class TurnTexts:
    """The turns' texts of a trajectory from a generations source, read once however many guards ask."""

    def __init__(self, generations: Generations) -> None:
        self.generations = generations
        self._last: tuple[TrajectoryEvent, list[TurnText | None]] | None = None

    def __call__(self, traj: TrajectoryEvent) -> list[TurnText | None]:
        if self._last is None or self._last[0] is not traj:
            self._last = (traj, turn_texts(traj, self.generations(traj)))
        return self._last[1]

    def bind(self, guard: TextBuilder) -> Builder:
        """``guard(trajectory, texts, params)`` as a builder ``(trajectory, params)``."""
        return lambda traj, params: guard(traj, self(traj), params)
