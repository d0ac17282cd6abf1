"""Product metrics: their declarations (type, level, direction, bounds) and the check of feedback against them (pure).

A metric is what feedback reports. Two sorts share one namespace:

- **Built-in metrics** are the signals flywheel always knew (``flywheel.events.FEEDBACK_SIGNALS``):
  ``thumbs``, ``rating``, ``comment`` (kind ``explicit``); ``edit_accepted``, ``edit_rejected``,
  ``text_kept``, ``retry``, ``abandon`` (``implicit``); ``task_solved``, ``tests_passed``
  (``outcome``). :data:`BUILTIN` describes each (its type, level and direction as the reward
  builders read it); their checks are exactly those before metrics were declared (the name fits
  the kind; any finite number or none as the value; any target), so feedback that was accepted
  then is accepted now and recorded the same.
- **Declared metrics** are a deployment's own, in settings (``[metrics.declared.<name>]``, see
  :class:`MetricDeclaration`), and are checked in full: a ``boolean`` takes ``true``/``false`` or
  ``1``/``0`` (none: ``true``, it happened) and is recorded as 1.0 or 0.0; a ``float`` takes a
  finite number within its bounds; a ``comment`` takes text in ``comment`` and no value. A
  ``generation``-level metric names the generation it is about (``generation_id``); a
  ``session``-level one names a session or a generation of it.

On the wire (``FeedbackEvent``, unchanged) a built-in keeps its kind, a declared metric is kind
``custom``, and the signal is always the metric's name. Feedback names its metric in ``metric``
(the kind follows) or, as before, in ``kind`` + ``signal``; both give the same event.

Invariants:
- A name is a built-in or declared, never both; a declared name is a lower-case identifier
  (``[a-z][a-z0-9_]*``, at most 64 characters: a TOML bare key, an environment variable's part,
  a Prometheus label value), as the built-ins' are.
- A custom signal that names no declared metric is refused (:class:`MetricProblem` naming the
  field) unless the deployment chose ``undeclared_custom = "accept"``: then it passes unchecked as
  before metrics existed, and is no metric (readers find no declaration for it).
- :meth:`Metrics.check` never changes what it accepts except a declared boolean's value, which it
  records as 1.0 or 0.0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, TypeAdapter, model_validator

from flywheel.events import FEEDBACK_SIGNALS

MetricType = Literal["boolean", "float", "comment"]
Level = Literal["generation", "session"]
Direction = Literal["max", "min"]
UndeclaredCustom = Literal["reject", "accept"]


class MetricDeclaration(BaseModel):
    """What one metric measures: ``[metrics.declared.<name>]`` in settings.

    ``type``: ``boolean``, ``float`` or ``comment``; ``level``: ``generation`` (about one answer)
    or ``session`` (about the whole session); ``direction``: ``max`` or ``min``, which way is
    better (booleans: ``max`` means true is good; comments have none); ``min`` / ``max``: the
    inclusive bounds of a float, either or both (none: any finite number).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    type: MetricType
    level: Level
    direction: Direction | None = None
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MetricDeclaration:
        if self.type == "comment" and self.direction is not None:
            raise ValueError("a comment metric has no direction: leave direction out")
        if self.type != "comment" and self.direction is None:
            raise ValueError(f"a {self.type} metric needs a direction: 'max' (higher is better) or 'min'")
        if self.type != "float" and (self.min is not None or self.max is not None):
            raise ValueError(f"only a float metric has bounds; a {self.type} metric takes no min or max")
        if self.min is not None and self.max is not None and not self.min < self.max:
            raise ValueError(f"min ({self.min:g}) must be below max ({self.max:g})")
        return self

    def bounds(self) -> str:
        """The float's range as a person reads it (``[0, 5]``, ``>= 0``, ``any number``)."""
        if self.min is not None and self.max is not None:
            return f"[{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f">= {self.min:g}"
        if self.max is not None:
            return f"<= {self.max:g}"
        return "any number"


@dataclass(frozen=True)
class Metric:
    """A metric by name: its wire kind (``custom`` for a declared one) and its declaration."""

    name: str
    kind: str
    declaration: MetricDeclaration

    @property
    def builtin(self) -> bool:
        return self.kind != "custom"


def _builtin(name: str, kind: str, type: MetricType, level: Level, direction: Direction | None = None,
             **bounds: float) -> Metric:
    return Metric(name, kind, MetricDeclaration(type=type, level=level, direction=direction, **bounds))


#: The built-in metrics, as the reward builders (rewards/builders.py) read them: thumbs +1/-1,
#: rating on the spec's scale, events (edits, retry, abandon) counted whatever their value,
#: text_kept and the outcomes a fraction in [0, 1] (none: 1). Described, not enforced (module docstring).
BUILTIN: Mapping[str, Metric] = {m.name: m for m in (
    _builtin("thumbs", "explicit", "float", "generation", "max", min=-1, max=1),
    _builtin("rating", "explicit", "float", "generation", "max"),
    _builtin("comment", "explicit", "comment", "generation"),
    _builtin("edit_accepted", "implicit", "boolean", "generation", "max"),
    _builtin("edit_rejected", "implicit", "boolean", "generation", "min"),
    _builtin("text_kept", "implicit", "float", "generation", "max", min=0, max=1),
    _builtin("retry", "implicit", "boolean", "generation", "min"),
    _builtin("abandon", "implicit", "boolean", "session", "min"),
    _builtin("task_solved", "outcome", "float", "session", "max", min=0, max=1),
    _builtin("tests_passed", "outcome", "float", "session", "max", min=0, max=1),
)}


def _not_builtin(name: str) -> str:
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in metric ({BUILTIN[name].kind}); declare yours under another name")
    return name


NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
#: A declared metric's name: lower-case, at most 64 characters, no built-in's.
MetricName = Annotated[str, StringConstraints(pattern=NAME_PATTERN), AfterValidator(_not_builtin)]
#: What settings declare (``metrics.declared``): name -> declaration.
Declarations = dict[MetricName, MetricDeclaration]
_DECLARATIONS: TypeAdapter[Declarations] = TypeAdapter(Declarations)


class MetricProblem(ValueError):
    """A feedback item does not fit its metric: ``field`` names the item's field at fault (the
    gateway's ``param``), ``code`` the OpenAI-style error code."""

    def __init__(self, field: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Checked:
    """What an accepted feedback item records: its wire kind, its signal (the metric's name) and value."""

    kind: str
    signal: str
    value: float | None
    #: The metric it names; None for an undeclared custom signal let through by ``accept``.
    metric: Metric | None


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else f"{value:g}"
    return text if len(text) <= 60 else text[:57] + "..."


class Metrics:
    """The metrics a deployment knows, built-in and declared, and the check of one feedback item."""

    def __init__(self, declared: Mapping[str, MetricDeclaration] | None = None, *,
                 undeclared_custom: UndeclaredCustom = "reject") -> None:
        checked = _DECLARATIONS.validate_python(dict(declared or {}))  # names as settings check them
        self.declared: Mapping[str, Metric] = {name: Metric(name, "custom", d) for name, d in checked.items()}
        self.undeclared_custom = undeclared_custom

    def get(self, name: str) -> Metric | None:
        return BUILTIN.get(name) or self.declared.get(name)

    def __iter__(self) -> Iterator[Metric]:
        yield from BUILTIN.values()
        yield from self.declared.values()

    def check(self, *, metric: str | None = None, kind: str | None = None, signal: str | None = None,
              value: float | bool | None = None, comment: str | None = None,
              generation_id: str | None = None) -> Checked:
        """The feedback item's record if it fits the metric it names, else :class:`MetricProblem`."""
        found, name = self._named(metric, kind, signal)
        if found is None:  # an undeclared custom signal, let through (undeclared_custom = "accept")
            if isinstance(value, bool):
                raise MetricProblem("value", f"{name!r} is not a declared metric: its value is a number, not "
                                    f"{_shown(value)} (declare it as a boolean metric to send true/false)")
            return Checked("custom", name, value, None)
        if found.builtin:
            if isinstance(value, bool):
                raise MetricProblem("value", f"metric {name!r} takes a number, not {_shown(value)}")
            return Checked(found.kind, name, value, found)
        return Checked("custom", name, self._value(found, value, comment, generation_id), found)

    def _named(self, metric: str | None, kind: str | None, signal: str | None) -> tuple[Metric | None, str]:
        """The metric an item names (None: an undeclared custom signal this deployment accepts) and its name."""
        if metric is None and signal is None:
            raise MetricProblem("metric", "name the metric this feedback reports: set metric (or kind and signal)",
                                "missing_required_parameter")
        if metric is not None and signal is not None and signal != metric:
            raise MetricProblem("signal", f"signal {_shown(signal)} and metric {_shown(metric)} disagree: "
                                "send the metric alone")
        name = metric if metric is not None else signal
        assert name is not None
        field = "metric" if metric is not None else "signal"
        found = self.get(name)
        if kind is not None and kind != "custom" and (found is None or found.kind != kind):
            allowed = ", ".join(FEEDBACK_SIGNALS.get(kind, ()))
            hint = "" if found is None or found.builtin else " (a declared metric is kind custom: leave kind out)"
            raise MetricProblem("kind" if metric is not None else "signal",
                                f"{field} {_shown(name)} is not one of the {kind} signals; allowed: {allowed}{hint}")
        if kind == "custom" and found is not None and found.builtin:
            if self.undeclared_custom == "accept":
                return None, name
            raise MetricProblem("kind", f"{name!r} is the built-in {found.kind} metric, not a custom one: send kind "
                                f"{found.kind!r} (or leave kind out)")
        if found is None:
            if self.undeclared_custom == "accept" and kind in (None, "custom"):
                return None, name
            known = ", ".join(sorted(self.declared)) or "none"
            raise MetricProblem(field, f"unknown metric {_shown(name)}: declared metrics are {known}; built-in "
                                f"ones {', '.join(BUILTIN)}. Declare a metric in the settings "
                                f"([metrics.declared.<name>]) before sending feedback about it", "unknown_metric")
        return found, name

    @staticmethod
    def _value(metric: Metric, value: float | bool | None, comment: str | None, generation_id: str | None) -> float | None:
        """A declared metric's recorded value, or :class:`MetricProblem`."""
        d, name = metric.declaration, metric.name
        if d.level == "generation" and generation_id is None:
            raise MetricProblem("generation_id", f"metric {name!r} is about one generation: name it in generation_id",
                                "missing_required_parameter")
        if d.type == "comment":
            if value is not None:
                raise MetricProblem("value", f"metric {name!r} is a comment: send its text in comment, and no value")
            if not comment:
                raise MetricProblem("comment", f"metric {name!r} is a comment: send its text in comment",
                                    "missing_required_parameter")
            return None
        if d.type == "boolean":
            if value is None:
                return 1.0
            if isinstance(value, bool) or value in (0, 1):
                return 1.0 if value else 0.0
            raise MetricProblem("value", f"metric {name!r} is a boolean: send true or false (or 1 or 0), not "
                                f"{_shown(value)}")
        if value is None:
            raise MetricProblem("value", f"metric {name!r} is a number: send it in value ({d.bounds()})",
                                "missing_required_parameter")
        if isinstance(value, bool):
            raise MetricProblem("value", f"metric {name!r} is a number ({d.bounds()}), not {_shown(value)}")
        if (d.min is not None and value < d.min) or (d.max is not None and value > d.max):
            raise MetricProblem("value", f"metric {name!r} lies in {d.bounds()}; {_shown(value)} is outside")
        return value
