"""The reward spec: a versioned TOML file saying what a trajectory is worth, parsed into one validated model.

A spec names its ``version`` (every score it produces carries it), the builders to combine with
their weights and parameters, the credit rule, the guards (clipping, held-out slice, anomaly
detection) and the normalisation. ``rewards.spec_path`` selects the file; empty selects the
built-in default, ``rewards/specs/default.toml``, which states every value explicitly. The other
files of ``rewards/specs/`` are templates, selected by their name (``"coding-agent"``: see
:func:`builtin_specs`), in ``spec_path`` or in ``extends``.

Invariants:
- Unknown keys anywhere are errors, and every problem of a file is reported at once (:class:`SpecError`).
- ``extends = "default"`` (or a template's name, or a path relative to the extending file) starts from another spec:
  tables merge key by key, arrays (``builders``) are replaced whole. The result is validated as a whole.
- :attr:`RewardSpec.sha256` fingerprints the resolved spec; one ``version`` must always name one
  fingerprint (``rewards.store.register_spec`` refuses a changed spec under an old version).
- The model defaults are the default spec's values (a unit test keeps the file and the defaults equal);
  the builder kinds the default spec does not list (``metrics`` and the text guards ``tool_calls``,
  ``clarify``, ``echo``) have their defaults stated in the templates that use them.
- A ``metrics`` builder may not name a signal that another enabled builder already reads (it would
  count twice), and a metric's rewards must agree with its declared ``direction``.
- Loaded for a deployment (:func:`load_spec` with its metrics, as the worker and ``flywheel rewards
  rescore`` load it), every metric an enabled ``metrics`` builder reads is one the deployment knows
  (built-in or ``[metrics.declared]``) and is read as it is declared: the same ``type``, ``level``
  and ``direction``. Otherwise the spec would score feedback the gateway refuses (it never comes) or
  reward a metric the other way round from the one the promotion gates and the console measure.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flywheel.metrics import BUILTIN, Metric, Metrics

DEFAULT_SPEC = "default.toml"


class SpecError(Exception):
    """A reward spec could not be loaded; the message lists every problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- builder parameters --------------------------------------------------------------------------


class ExplicitParams(_Strict):
    """Thumbs (value > 0 up, < 0 down) and ratings (``rating_min..rating_max`` mapped to ``[-rating, rating]``)."""

    thumbs_up: float = 1.0
    thumbs_down: float = -1.0
    rating: float = 1.0
    rating_min: float = 1.0
    rating_max: float = 5.0

    @model_validator(mode="after")
    def _range(self) -> ExplicitParams:
        if self.rating_max <= self.rating_min:
            raise ValueError("rating_max must be above rating_min")
        return self


class ImplicitParams(_Strict):
    """Edits, text kept (times the kept fraction ``value`` in [0, 1], missing = 1), retries, abandonment."""

    edit_accepted: float = 0.5
    edit_rejected: float = -0.5
    text_kept: float = 0.5
    retry: float = -0.5
    abandon: float = -0.5


class OutcomeParams(_Strict):
    """``task_solved`` / ``tests_passed``: value 1 (or missing) -> ``success``, 0 -> ``failure``, linear between."""

    success: float = 1.0
    failure: float = 0.0


class LengthParams(_Strict):
    """``-per_token`` for each completion token of a turn beyond ``free_tokens``, at most ``max_penalty`` a turn."""

    free_tokens: int = Field(256, ge=0)
    per_token: float = Field(0.002, ge=0)
    max_penalty: float = Field(1.0, ge=0)


#: A product metric's name, as feedback events carry it in ``signal`` (``flywheel.events.FeedbackEvent``).
SignalName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]


class _Metric(_Strict):
    level: Literal["generation", "session"] = "generation"
    direction: Literal["max", "min"] = "max"

    def _check_direction(self, best: float, worst: float) -> None:
        """``best``/``worst``: the rewards of the values ``direction = "max"`` calls best and worst."""
        if self.direction == "min":
            best, worst = worst, best
        if best < worst:
            raise ValueError(f"direction = {self.direction!r}, but the worse value is rewarded more")


class BooleanMetric(_Metric):
    """A ``boolean`` metric: a value > 0, or none (the event itself is the fact), is true ->
    ``when_true``; 0 or below -> ``when_false``."""

    type: Literal["boolean"]
    when_true: float
    when_false: float

    @model_validator(mode="after")
    def _direction(self) -> BooleanMetric:
        self._check_direction(self.when_true, self.when_false)
        return self


class FloatMetric(_Metric):
    """A ``float`` metric: the value, clamped to ``[low, high]``, maps linearly to ``[at_low, at_high]``;
    an event without a value scores nothing."""

    type: Literal["float"]
    low: float
    high: float
    at_low: float
    at_high: float

    @model_validator(mode="after")
    def _range(self) -> FloatMetric:
        if self.high <= self.low:
            raise ValueError("high must be above low")
        self._check_direction(self.at_high, self.at_low)
        return self


#: One product metric, declared as the ``[metrics]`` settings declare it (``type``, ``level``,
#: ``direction``), with what its values are worth. ``level = "generation"``: a reward on the turn
#: the event names (the last step when it names none), as thumbs are; ``"session"``: a session
#: outcome anchored there, spread by ``[credit]``. ``direction``: ``max`` (more, or true, is
#: better) or ``min``; the rewards must not say otherwise.
MetricSignal = Annotated[BooleanMetric | FloatMetric, Field(discriminator="type")]


class MetricsParams(_Strict):
    """Product metrics by signal name (any feedback kind): ``signals.NAME = { type = ..., ... }``."""

    signals: dict[SignalName, MetricSignal] = Field(min_length=1)


class ToolCallParams(_Strict):
    """``-penalty`` on a turn that ends in a broken tool call: arguments that are not a JSON object,
    a name the request's ``tools`` did not offer (``check_names``), ``finish_reason = "tool_calls"``
    with no call, or tool-call syntax left unparsed in the text (any of ``markers``)."""

    penalty: float = Field(1.0, ge=0)
    check_names: bool = True
    markers: list[Annotated[str, Field(min_length=2)]] = ["<tool_call>", "<|tool_call", "<function=", "[TOOL_CALLS]"]


class ClarifyParams(_Strict):
    """``-penalty`` on a turn that asks instead of acting on a task that was specified: it answers
    the user's message directly (not a tool result), the request offered tools (``require_tools``),
    the user's message has ``min_task_words`` words or more, the turn calls no tool, and it is a
    question: a sentence ending in ``?`` (or holding one of ``phrases``) with at most
    ``max_other_words`` words outside such sentences."""

    penalty: float = Field(0.5, ge=0)
    require_tools: bool = True
    min_task_words: int = Field(8, ge=0)
    max_other_words: int = Field(15, ge=0)
    phrases: list[Annotated[str, Field(min_length=3)]] = [
        "could you clarify", "can you clarify", "could you confirm", "can you confirm", "please confirm",
        "do you want me to", "would you like me to", "before i start", "before i proceed", "before i begin",
    ]


class EchoParams(_Strict):
    """``-penalty * (overlap - free_overlap) / (1 - free_overlap)`` on a turn whose text's word
    ``n``-grams are more than ``free_overlap`` found in the user's messages; turns with fewer than
    ``min_ngrams`` n-grams are not judged."""

    n: int = Field(4, ge=1)
    free_overlap: float = Field(0.3, ge=0, lt=1)
    penalty: float = Field(1.0, ge=0)
    min_ngrams: int = Field(3, ge=1)


class JudgeParams(_Strict):
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint asked to grade the session with ``rubric``.

    The reply's score (``min_score..max_score``) maps linearly to ``[-1, 1]`` and is a session outcome.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str = "judge"
    rubric: str = (
        "You grade an assistant's conversation with a user. Reply with one line 'Score: N' where N is "
        "an integer from 1 (useless or wrong) to 10 (correct and helpful)."
    )
    min_score: float = 1.0
    max_score: float = 10.0
    max_tokens: int = Field(64, ge=1)
    timeout_s: float = Field(30.0, gt=0)
    #: Attempts per trajectory on transport errors and 5xx answers.
    attempts: int = Field(3, ge=1)
    #: ``raise``: a judge that cannot answer stops the worker (it retries the batch on restart);
    #: ``zero``: the session gets no judge reward (counted in the ``judge_failed`` component as 0).
    on_error: Literal["raise", "zero"] = "raise"

    @model_validator(mode="after")
    def _range(self) -> JudgeParams:
        if self.max_score <= self.min_score:
            raise ValueError("max_score must be above min_score")
        return self


# --- builders ------------------------------------------------------------------------------------


class _Builder(_Strict):
    #: A label for logs; defaults to the kind.
    name: str = ""
    enabled: bool = True
    #: Multiplies everything the builder returns (turn rewards, outcomes, components).
    weight: float = 1.0


class ExplicitBuilder(_Builder):
    kind: Literal["explicit"]
    params: ExplicitParams = ExplicitParams()


class ImplicitBuilder(_Builder):
    kind: Literal["implicit"]
    params: ImplicitParams = ImplicitParams()


class OutcomeBuilder(_Builder):
    kind: Literal["outcome"]
    params: OutcomeParams = OutcomeParams()


class LengthBuilder(_Builder):
    kind: Literal["length"]
    params: LengthParams = LengthParams()


class JudgeBuilder(_Builder):
    kind: Literal["judge"]
    params: JudgeParams = JudgeParams()


class MetricsBuilder(_Builder):
    kind: Literal["metrics"]
    params: MetricsParams


class ToolCallBuilder(_Builder):
    kind: Literal["tool_calls"]
    params: ToolCallParams = ToolCallParams()


class ClarifyBuilder(_Builder):
    kind: Literal["clarify"]
    params: ClarifyParams = ClarifyParams()


class EchoBuilder(_Builder):
    kind: Literal["echo"]
    params: EchoParams = EchoParams()


class CustomBuilder(_Builder):
    """A Python builder ``(trajectory, params) -> RewardOutput``: an entry point in the
    ``flywheel.reward_builders`` group (``entry_point = "name"``) or ``target = "module:function"``."""

    kind: Literal["custom"]
    entry_point: str = ""
    target: str = ""
    #: Passed to the builder as a plain dict.
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_reference(self) -> CustomBuilder:
        if bool(self.entry_point) == bool(self.target):
            raise ValueError("a custom builder names exactly one of entry_point or target")
        if self.target and ":" not in self.target:
            raise ValueError(f"target {self.target!r} must be 'module:function'")
        return self


BuilderSpec = Annotated[
    ExplicitBuilder | ImplicitBuilder | OutcomeBuilder | LengthBuilder | JudgeBuilder | MetricsBuilder
    | ToolCallBuilder | ClarifyBuilder | EchoBuilder | CustomBuilder,
    Field(discriminator="kind"),
]

#: The signals each built-in feedback builder reads: a ``metrics`` builder may not read them too.
READS = {"explicit": {"thumbs", "rating"}, "outcome": {"task_solved", "tests_passed"},
         "implicit": {"edit_accepted", "edit_rejected", "text_kept", "retry", "abandon"}}


# --- credit, guards, normalisation ---------------------------------------------------------------


class CreditSpec(_Strict):
    """How a session outcome is spread over turns (``rewards.credit``)."""

    rule: Literal["discounted", "last_turn", "uniform"] = "discounted"
    #: ``discounted`` only: a step k steps before the outcome's anchor gets ``discount**k`` of it (a
    #: step is a turn, or the choices of one sampled group: ``rewards.credit``).
    discount: float = Field(0.5, ge=0, le=1)


class AnomalySpec(_Strict):
    """Flag a version whose training reward rate rose by ``train_jump`` or more over the previous
    version's while its held-out rate rose by less than ``held_out_ratio`` times as much."""

    min_train: int = Field(50, ge=1)
    min_held_out: int = Field(20, ge=1)
    train_jump: float = Field(0.25, gt=0)
    held_out_ratio: float = Field(0.5, ge=0, le=1)


class GuardSpec(_Strict):
    #: |reward| of one turn is clipped to this (0: no clip).
    clip_turn: float = Field(2.0, ge=0)
    #: |total| above this scales every turn down so the total equals it (0: no clip).
    clip_total: float = Field(5.0, ge=0)
    #: Share of sessions (by a hash of tenant and session id) scored and stored, never trained on.
    held_out_fraction: float = Field(0.05, ge=0, lt=1)
    anomaly: AnomalySpec = AnomalySpec()


class NormaliseSpec(_Strict):
    """Per-turn advantages (``rewards.normalise``)."""

    #: A sample is compared with earlier samples of its prompt once there are this many...
    group_min: int = Field(2, ge=1)
    #: ...keeping the newest this many per prompt.
    group_window: int = Field(16, ge=1)
    #: Otherwise with exponentially weighted statistics per (tenant, model line) of this decay.
    decay: float = Field(0.99, gt=0, lt=1)
    #: Until they hold this many turn rewards, running statistics scale by 1 (centre only).
    warmup: int = Field(10, ge=2)
    #: ``std``: (reward - mean) / max(std, std_floor); ``none``: reward - mean.
    scale: Literal["std", "none"] = "std"
    std_floor: float = Field(0.1, gt=0)
    #: |advantage| is clipped to this (0: no clip).
    clip: float = Field(5.0, ge=0)


class RewardSpec(_Strict):
    version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:+-]+$")
    builders: list[BuilderSpec] = Field(min_length=1)
    credit: CreditSpec = CreditSpec()
    guards: GuardSpec = GuardSpec()
    normalise: NormaliseSpec = NormaliseSpec()

    @model_validator(mode="after")
    def _some_builder_enabled(self) -> RewardSpec:
        if not any(b.enabled for b in self.builders):
            raise ValueError("no builder is enabled")
        return self

    @model_validator(mode="after")
    def _signals_counted_once(self) -> RewardSpec:
        readers: dict[str, str] = {}
        for b in self.builders:
            if not b.enabled:
                continue
            names = set(b.params.signals) if isinstance(b, MetricsBuilder) else READS.get(b.kind, set())
            for signal in sorted(names):
                if signal in readers:
                    raise ValueError(f"signal {signal!r} is read by both the {readers[signal]} and the {b.kind} "
                                     f"builder: it would count twice")
                readers[signal] = b.kind
        return self

    @property
    def sha256(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


# --- loading -------------------------------------------------------------------------------------


def default_spec_text() -> str:
    return builtin_spec_text("default")


def builtin_specs() -> list[str]:
    """The names of the specs shipped in ``rewards/specs/`` (``default`` and the templates)."""
    folder = resources.files("rewards").joinpath("specs")
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def builtin_spec_text(name: str) -> str:
    return resources.files("rewards").joinpath("specs", f"{name}.toml").read_text()


def _name(path: str | Path | None) -> str:
    """A shipped spec's name (a string naming one: ``""`` and ``None`` name ``default``), else the resolved path."""
    if path is None or path == "":
        return "default"
    if isinstance(path, str) and path in builtin_specs():
        return path
    return str(Path(path).resolve())


def _read(path: str | Path | None, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    name = _name(path)
    builtin = name in builtin_specs()
    if name in seen:
        raise SpecError(f"reward spec extends itself: {' -> '.join(seen + (name,))}")
    try:
        text = builtin_spec_text(name) if builtin else Path(name).read_text()
        data = tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read reward spec {name}: {exc}") from exc
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(f"reward spec {name}: extends must be a string")
    if parent not in builtin_specs():
        if builtin:
            raise SpecError(f"reward spec {name}: a shipped spec extends only shipped specs, not {parent!r}")
        parent = str(Path(name).parent / parent)
    return _merge(_read(parent, seen + (name,)), data)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_spec(data: dict[str, Any], name: str = "<spec>") -> RewardSpec:
    try:
        return RewardSpec.model_validate(data)
    except ValidationError as exc:
        problems = [f"  {'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()]
        raise SpecError(f"reward spec {name}: {len(problems)} problem(s):\n" + "\n".join(problems)) from None


def load_spec(path: str | Path | None = None, metrics: Metrics | None = None) -> RewardSpec:
    """The spec at ``path`` (empty or ``None``: the built-in default; a shipped spec's name: that
    spec, :func:`builtin_specs`), resolved and validated; with ``metrics`` (the deployment's,
    ``Settings.product_metrics()``), also checked against them (:func:`check_metrics`)."""
    spec = parse_spec(_read(path), str(path or "default"))
    if metrics is not None:
        check_metrics(spec, metrics, _file(path))
    return spec


def _file(path: str | Path | None) -> str:
    """The file a spec was read from, as a person finds it."""
    name = _name(path)
    return f"{name} (rewards/specs/{name}.toml)" if name in builtin_specs() else name


def _declaration(name: str, m: BooleanMetric | FloatMetric) -> str:
    """The settings' lines that would declare ``m`` as the spec reads it."""
    return f'[metrics.declared.{name}] type = "{m.type}", level = "{m.level}", direction = "{m.direction}"'


def metric_problems(spec: RewardSpec, metrics: Metrics) -> list[str]:
    """What the spec's enabled ``metrics`` builders read that ``metrics`` does not know, or knows
    otherwise (type, level, direction): one line each, saying what to change."""
    problems = []
    for b in spec.builders:
        if not (b.enabled and isinstance(b, MetricsBuilder)):
            continue
        for name, m in b.params.signals.items():
            known = metrics.get(name)
            where = f"builder {b.name or b.kind!r} reads metric {name!r}"
            if known is None:
                problems.append(f"  {where}, which the settings do not declare: declare it as "
                                f"{_declaration(name, m)} (built-in metrics: {', '.join(BUILTIN)})")
            elif (said := _as_read(m)) != (actual := _as_read(known)):
                fix = (f"change the spec's signals.{name} to agree (a built-in metric is fixed)" if known.builtin
                       else f"make the spec's signals.{name} and [metrics.declared.{name}] agree")
                owner = "the built-in metric is" if known.builtin else "the settings declare it"
                problems.append(f"  {where} as {said}, but {owner} {actual}: {fix}")
    return problems


def _as_read(m: BooleanMetric | FloatMetric | Metric) -> str:
    d = m.declaration if isinstance(m, Metric) else m
    return f"type {d.type}, level {d.level}, direction {d.direction}"


def check_metrics(spec: RewardSpec, metrics: Metrics, name: str) -> None:
    """:class:`SpecError` naming the spec file ``name`` and every metric its ``metrics`` builders
    read that the deployment does not know, or declares otherwise (module docstring)."""
    problems = metric_problems(spec, metrics)
    if problems:
        raise SpecError(f"reward spec {name} does not fit this deployment's product metrics: {len(problems)} "
                        "problem(s):\n" + "\n".join(problems))
