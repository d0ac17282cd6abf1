"""The reward spec: a versioned TOML file saying what a trajectory is worth, parsed into one validated model.

A spec names its ``version`` (every score it produces carries it), the builders to combine with
their weights and parameters, the credit rule, the guards (clipping, held-out slice, anomaly
detection) and the normalisation. ``rewards.spec_path`` selects the file; empty selects the
built-in default, ``rewards/specs/default.toml``, which states every value explicitly.

Invariants:
- Unknown keys anywhere are errors, and every problem of a file is reported at once (:class:`SpecError`).
- ``extends = "default"`` (or a path, relative to the extending file) starts from another spec:
  tables merge key by key, arrays (``builders``) are replaced whole. The result is validated as a whole.
- :attr:`RewardSpec.sha256` fingerprints the resolved spec; one ``version`` must always name one
  fingerprint (``rewards.store.register_spec`` refuses a changed spec under an old version).
- The model defaults are the default spec's values (a unit test keeps the file and the defaults equal).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    ExplicitBuilder | ImplicitBuilder | OutcomeBuilder | LengthBuilder | JudgeBuilder | CustomBuilder,
    Field(discriminator="kind"),
]


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

    @property
    def sha256(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


# --- loading -------------------------------------------------------------------------------------


def default_spec_text() -> str:
    return resources.files("rewards").joinpath("specs", DEFAULT_SPEC).read_text()


def _read(path: str | Path | None, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    name = "default" if path in (None, "", "default") else str(Path(path).resolve())
    if name in seen:
        raise SpecError(f"reward spec extends itself: {' -> '.join(seen + (name,))}")
    try:
        text = default_spec_text() if name == "default" else Path(name).read_text()
        data = tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read reward spec {name}: {exc}") from exc
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(f"reward spec {name}: extends must be a string")
    if parent != "default" and name != "default":
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


def load_spec(path: str | Path | None = None) -> RewardSpec:
    """The spec at ``path`` (empty or ``None``: the built-in default), resolved and validated."""
    return parse_spec(_read(path), str(path or "default"))
