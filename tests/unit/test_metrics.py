"""flywheel.metrics: declarations (types, levels, directions, bounds, names), the built-ins, and the
check of one feedback item against the metric it names; the ``[metrics]`` settings section."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from flywheel.events import FEEDBACK_SIGNALS
from flywheel.metrics import BUILTIN, Checked, MetricDeclaration, MetricProblem, Metrics
from flywheel.settings import SettingsError, load_settings

pytestmark = pytest.mark.unit

DECLARED = {
    "helpfulness": MetricDeclaration(type="float", level="generation", direction="max", min=0, max=5),
    "latency_ms": MetricDeclaration(type="float", level="generation", direction="min", min=0),
    "resolved": MetricDeclaration(type="boolean", level="session", direction="max"),
    "escalated": MetricDeclaration(type="boolean", level="generation", direction="min"),
    "notes": MetricDeclaration(type="comment", level="session"),
}
METRICS = Metrics(DECLARED)


def problem(**item) -> MetricProblem:
    with pytest.raises(MetricProblem) as caught:
        METRICS.check(**item)
    return caught.value


# --- built-ins ------------------------------------------------------------------------------------


def test_the_builtins_are_the_signals_the_wire_knows():
    assert {m.name: m.kind for m in BUILTIN.values()} == {
        signal: kind for kind, signals in FEEDBACK_SIGNALS.items() for signal in signals}
    assert all(m.builtin for m in BUILTIN.values())
    assert (BUILTIN["thumbs"].declaration.type, BUILTIN["comment"].declaration.type) == ("float", "comment")
    assert BUILTIN["abandon"].declaration.level == "session" and BUILTIN["retry"].declaration.direction == "min"
    assert [m.name for m in METRICS][:len(BUILTIN)] == list(BUILTIN)  # built-ins first, then the declared


@pytest.mark.parametrize(("kind", "signal", "value"), [
    ("explicit", "thumbs", 1.0), ("explicit", "thumbs", -1.0), ("explicit", "thumbs", 5.0),
    ("explicit", "thumbs", None), ("explicit", "rating", 4.5), ("explicit", "rating", -100.0),
    ("explicit", "comment", None), ("explicit", "comment", 3.0), ("implicit", "retry", None),
    ("implicit", "edit_accepted", 7.0), ("implicit", "text_kept", 1.5), ("implicit", "abandon", None),
    ("outcome", "task_solved", None), ("outcome", "tests_passed", 0.25), ("outcome", "task_solved", 2.0),
])
def test_builtins_accept_what_they_accepted_before_and_record_it_unchanged(kind, signal, value):
    """No bounds, no level, any number or none: the built-ins keep their old checks exactly (a
    thumbs of 5 or a session-level thumbs stays accepted), and the event is what it always was."""
    assert METRICS.check(kind=kind, signal=signal, value=value) == Checked(kind, signal, value, BUILTIN[signal])
    assert METRICS.check(metric=signal, value=value) == Checked(kind, signal, value, BUILTIN[signal])
    assert METRICS.check(kind=kind, metric=signal, signal=signal, value=value).kind == kind


def test_a_builtin_signal_of_another_kind_names_the_signal_and_the_allowed_ones():
    p = problem(kind="outcome", signal="thumbs", value=1)
    assert (p.field, p.code) == ("signal", "invalid_value")
    assert p.message == "signal 'thumbs' is not one of the outcome signals; allowed: task_solved, tests_passed"
    p = problem(kind="implicit", metric="thumbs", value=1)
    assert p.field == "kind" and "retry" in p.message
    p = problem(kind="explicit", signal="resolved")  # a declared metric is kind custom
    assert p.field == "signal" and "leave kind out" in p.message


def test_a_builtin_takes_numbers_not_booleans():
    p = problem(kind="explicit", signal="thumbs", value=True)
    assert p.field == "value" and "true" in p.message


def test_a_builtin_name_is_not_a_custom_signal():
    p = problem(kind="custom", signal="thumbs", value=1)
    assert p.field == "kind" and "'explicit'" in p.message


# --- naming ---------------------------------------------------------------------------------------


def test_an_item_names_one_metric():
    p = problem(value=1)
    assert (p.field, p.code) == ("metric", "missing_required_parameter")
    p = problem(metric="resolved", signal="notes")
    assert p.field == "signal" and "disagree" in p.message
    assert METRICS.check(metric="resolved", signal="resolved") == METRICS.check(metric="resolved")
    assert METRICS.check(kind="custom", signal="resolved") == METRICS.check(metric="resolved")


@pytest.mark.parametrize(("item", "field"), [
    ({"metric": "helpfulnes", "value": 1}, "metric"),
    ({"kind": "custom", "signal": "latency_complaint"}, "signal"),
    ({"signal": "nope"}, "signal"),
    ({"kind": "explicit", "signal": "nope"}, "signal"),
])
def test_unknown_names_are_refused_naming_the_field(item, field):
    p = problem(**item)
    assert p.field == field
    if item.get("kind") != "explicit":
        assert p.code == "unknown_metric" and "helpfulness" in p.message and "thumbs" in p.message


def test_undeclared_custom_signals_pass_unchecked_when_the_deployment_accepts_them():
    lenient = Metrics(DECLARED, undeclared_custom="accept")
    assert lenient.check(kind="custom", signal="latency_complaint", value=900) == Checked(
        "custom", "latency_complaint", 900, None)
    assert lenient.check(metric="anything", value=None) == Checked("custom", "anything", None, None)
    # As before metrics: a custom signal may carry a built-in's name and is no built-in then.
    assert lenient.check(kind="custom", signal="thumbs", value=3) == Checked("custom", "thumbs", 3, None)
    with pytest.raises(MetricProblem) as caught:
        lenient.check(kind="custom", signal="latency_complaint", value=True)
    assert caught.value.field == "value"
    # Declared metrics are checked all the same, and built-ins keep their kinds.
    with pytest.raises(MetricProblem):
        lenient.check(metric="helpfulness", value=9, generation_id="g")
    with pytest.raises(MetricProblem):
        lenient.check(kind="outcome", signal="nope")


# --- declared metrics: types, bounds, levels ------------------------------------------------------


@pytest.mark.parametrize(("value", "recorded"), [(True, 1.0), (False, 0.0), (1, 1.0), (0, 0.0), (1.0, 1.0),
                                                  (None, 1.0)])
def test_a_boolean_is_recorded_as_one_or_zero(value, recorded):
    assert METRICS.check(metric="resolved", value=value) == Checked("custom", "resolved", recorded,
                                                                    METRICS.get("resolved"))


@pytest.mark.parametrize("value", [0.5, 2, -1, 1e-9])
def test_a_boolean_refuses_other_numbers(value):
    p = problem(metric="resolved", value=value)
    assert (p.field, p.code) == ("value", "invalid_value") and "boolean" in p.message


def test_a_float_takes_a_number_within_its_inclusive_bounds():
    for value in (0, 0.0, 2.5, 5):
        assert METRICS.check(metric="helpfulness", value=value, generation_id="g").value == value
    for value in (-0.001, 5.0001, 1e300, -1e300):
        p = problem(metric="helpfulness", value=value, generation_id="g")
        assert p.field == "value" and "[0, 5]" in p.message
    p = problem(metric="helpfulness", generation_id="g")
    assert (p.field, p.code) == ("value", "missing_required_parameter")
    p = problem(metric="helpfulness", value=True, generation_id="g")
    assert p.field == "value" and "true" in p.message
    assert METRICS.check(metric="latency_ms", value=1e12, generation_id="g").value == 1e12  # one-sided
    assert problem(metric="latency_ms", value=-1, generation_id="g").message.endswith(">= 0; -1 is outside")


@given(low=st.floats(-1e6, 1e6), width=st.floats(1e-3, 1e6), value=st.floats(-3e6, 3e6))
def test_a_float_is_accepted_exactly_when_it_lies_within_its_bounds(low, width, value):
    high = low + width
    metrics = Metrics({"m": MetricDeclaration(type="float", level="session", direction="max", min=low, max=high)})
    if low <= value <= high:
        assert metrics.check(metric="m", value=value).value == value
    else:
        with pytest.raises(MetricProblem):
            metrics.check(metric="m", value=value)


def test_a_comment_takes_text_and_no_value():
    assert METRICS.check(metric="notes", comment="too slow") == Checked("custom", "notes", None, METRICS.get("notes"))
    p = problem(metric="notes")
    assert (p.field, p.code) == ("comment", "missing_required_parameter")
    p = problem(metric="notes", comment="x", value=1)
    assert p.field == "value"


def test_a_generation_level_metric_names_its_generation_and_a_session_level_one_either():
    p = problem(metric="escalated", value=True)
    assert (p.field, p.code) == ("generation_id", "missing_required_parameter")
    assert METRICS.check(metric="escalated", value=True, generation_id="g").value == 1.0
    assert METRICS.check(metric="resolved", value=True, generation_id="g").value == 1.0
    assert METRICS.check(metric="resolved", value=True).value == 1.0


# --- declarations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "words"), [
    ({"type": "float", "level": "session"}, "needs a direction"),
    ({"type": "boolean", "level": "session"}, "needs a direction"),
    ({"type": "comment", "level": "session", "direction": "max"}, "no direction"),
    ({"type": "boolean", "level": "session", "direction": "max", "min": 0}, "only a float"),
    ({"type": "float", "level": "session", "direction": "max", "min": 1, "max": 1}, "below max"),
    ({"type": "float", "level": "session", "direction": "max", "max": math.inf}, "finite"),
    ({"type": "integer", "level": "session", "direction": "max"}, "boolean"),
    ({"type": "float", "level": "turn", "direction": "max"}, "generation"),
    ({"type": "float", "level": "session", "direction": "up"}, "max"),
    ({"type": "float", "level": "session", "direction": "max", "weight": 2}, "Extra"),
])
def test_a_declaration_must_make_sense(fields, words):
    with pytest.raises(ValidationError) as caught:
        MetricDeclaration(**fields)
    assert words in str(caught.value)


def test_declared_names_are_lower_case_and_never_a_builtins():
    ok = MetricDeclaration(type="boolean", level="session", direction="max")
    for bad in ("Resolved", "has space", "a.b", "a-b", "1st", "_x", "", "x" * 65, "thumbs", "task_solved"):
        with pytest.raises(ValueError):
            Metrics({bad: ok})
    assert Metrics({"a_b_c9": ok}).get("a_b_c9") is not None and Metrics({"x" * 64: ok}).get("x" * 64)


# --- settings -------------------------------------------------------------------------------------


def test_the_metrics_section_of_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "flywheel.toml"
    path.write_text("""
[metrics]
undeclared_custom = "reject"

[metrics.declared.helpfulness]
type = "float"
level = "generation"
direction = "max"
min = 0
max = 5

[metrics.declared.resolved]
type = "boolean"
level = "session"
direction = "max"
""")
    settings = load_settings(path)
    assert settings.metrics.declared == {"helpfulness": DECLARED["helpfulness"], "resolved": DECLARED["resolved"]}
    assert load_settings().metrics.declared == {} and load_settings().metrics.undeclared_custom == "reject"
    monkeypatch.setenv("FLYWHEEL_METRICS__UNDECLARED_CUSTOM", "accept")
    assert load_settings(path).metrics.undeclared_custom == "accept"


def test_bad_metric_settings_are_reported_together():
    with pytest.raises(SettingsError) as caught:
        load_settings(metrics={"declared": {
            "thumbs": {"type": "float", "level": "session", "direction": "max"},
            "Bad": {"type": "boolean", "level": "session", "direction": "max"},
            "c": {"type": "comment", "level": "session", "direction": "max"},
        }, "undeclared_custom": "maybe"})
    text = str(caught.value)
    assert text.startswith("4 invalid setting(s)")
    for where in ("metrics.declared.thumbs", "metrics.declared.Bad", "metrics.declared.c", "metrics.undeclared_custom"):
        assert where in text
