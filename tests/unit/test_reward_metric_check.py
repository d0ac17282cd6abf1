"""A reward spec against the deployment's product metrics: the rewards worker and ``flywheel rewards
rescore`` refuse a ``metrics`` builder that reads a metric the settings do not know, or read
otherwise than declared (type, level, direction), naming the spec file, the metric and what to
declare; the shipped templates fit the declarations their comments state.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from flywheel.settings import load_settings
from rewards import rescore
from rewards.spec import SpecError, builtin_spec_text, builtin_specs, load_spec, metric_problems
from rewards.worker import run as rewards_run

pytestmark = pytest.mark.unit

DECLARED = {"resolved": {"type": "boolean", "level": "session", "direction": "max"},
            "stars": {"type": "float", "level": "generation", "direction": "max", "min": 0, "max": 5},
            "note": {"type": "comment", "level": "generation"}}


def spec_file(tmp_path: Path, signals: str, name: str = "spec.toml") -> Path:
    """A spec extending the default with one ``metrics`` builder reading ``signals`` (TOML tables)."""
    path = tmp_path / name
    path.write_text(f'extends = "default"\nversion = "check-v1"\n\n[[builders]]\nkind = "metrics"\nname = "product"\n'
                    f"{signals}")
    return path


RESOLVED = ('[builders.params.signals.resolved]\ntype = "boolean"\nlevel = "session"\ndirection = "max"\n'
            "when_true = 1.0\nwhen_false = -0.5\n")
STARS = ('[builders.params.signals.stars]\ntype = "float"\nlevel = "generation"\ndirection = "max"\n'
         "low = 0.0\nhigh = 5.0\nat_low = -1.0\nat_high = 1.0\n")


def settings_for(tmp_path: Path, spec: Path | str, declared: dict | None = None):
    return load_settings(data_dir=str(tmp_path / "data"), metrics={"declared": DECLARED if declared is None else declared},
                         rewards={"spec_path": str(spec)}, bus={"kind": "local"})


def test_a_spec_reading_declared_metrics_as_declared_loads(tmp_path: Path) -> None:
    path = spec_file(tmp_path, RESOLVED + STARS)
    spec = load_spec(path, settings_for(tmp_path, path).product_metrics())
    assert spec.version == "check-v1"
    assert load_spec(path).version == "check-v1"  # without a deployment's metrics: not checked


def test_an_undeclared_metric_names_the_file_the_metric_and_what_to_declare(tmp_path: Path) -> None:
    path = spec_file(tmp_path, RESOLVED + STARS.replace("stars", "happiness"))
    with pytest.raises(SpecError) as caught:
        load_spec(path, settings_for(tmp_path, path).product_metrics())
    message = str(caught.value)
    assert str(path.resolve()) in message and "1 problem(s)" in message
    assert "builder 'product' reads metric 'happiness', which the settings do not declare" in message
    assert '[metrics.declared.happiness] type = "float", level = "generation", direction = "max"' in message
    assert "resolved" not in message


@pytest.mark.parametrize(("change", "said", "declared"), [
    (('type = "boolean"', 'type = "float"'), "type float", "type boolean"),
    (('level = "session"', 'level = "generation"'), "level generation", "level session"),
    (('direction = "max"\nwhen_true = 1.0\nwhen_false = -0.5', 'direction = "min"\nwhen_true = -0.5\nwhen_false = 1.0'),
     "direction min", "direction max"),
])
def test_a_metric_read_otherwise_than_declared_is_refused(tmp_path: Path, change, said, declared) -> None:
    signals = RESOLVED.replace(*change)
    if "float" in change[1]:
        signals = signals.replace("when_true = 1.0\nwhen_false = -0.5\n", "low = 0.0\nhigh = 1.0\nat_low = 0.0\nat_high = 1.0\n")
    path = spec_file(tmp_path, signals)
    with pytest.raises(SpecError) as caught:
        load_spec(path, settings_for(tmp_path, path).product_metrics())
    message = str(caught.value)
    assert str(path.resolve()) in message and "metric 'resolved'" in message
    assert said in message.split("but the settings declare it")[0] and declared in message.split("declare it")[1]
    assert "make the spec's signals.resolved and [metrics.declared.resolved] agree" in message


def test_built_in_and_comment_metrics_are_checked_too(tmp_path: Path) -> None:
    thumbs = ('[builders.params.signals.thumbs]\ntype = "boolean"\nlevel = "generation"\ndirection = "max"\n'
              "when_true = 1.0\nwhen_false = -1.0\n")
    note = RESOLVED.replace("resolved", "note").replace('"session"', '"generation"')
    path = spec_file(tmp_path, thumbs + note)
    spec = load_spec(path)
    problems = metric_problems(spec, settings_for(tmp_path, path).product_metrics())
    assert len(problems) == 2, problems
    assert "metric 'thumbs' as type boolean" in problems[0] and "the built-in metric is type float" in problems[0]
    assert "(a built-in metric is fixed)" in problems[0]
    assert "metric 'note'" in problems[1] and "type comment" in problems[1]
    enabled = path.read_text().replace('name = "product"', 'name = "product"\nenabled = false')
    path.write_text(enabled + '\n[[builders]]\nkind = "length"\n')
    assert metric_problems(load_spec(path), settings_for(tmp_path, path).product_metrics()) == []  # disabled: unread


def test_the_worker_and_rescore_refuse_to_start_on_a_spec_that_does_not_fit(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = spec_file(tmp_path, RESOLVED)
    settings = settings_for(tmp_path, path, declared={})
    with pytest.raises(SpecError, match=r"reads metric 'resolved', which the settings do not declare"):
        rewards_run(settings)  # before it opens the database or the bus
    assert rescore.main(argparse.Namespace(action="rescore", spec=str(path)), settings) == 2
    err = capsys.readouterr().err
    assert str(path.resolve()) in err and '[metrics.declared.resolved] type = "boolean", level = "session"' in err
    assert not (tmp_path / "data" / "flywheel.db").exists()


def declarations_in_comments(text: str) -> dict[str, dict[str, str]]:
    """The ``#   [metrics.declared.NAME]  type = "...", ...`` lines a template's header states."""
    found = {}
    for name, fields in re.findall(r"^#\s+\[metrics\.declared\.(\w+)\]\s+(.*)$", text, re.M):
        found[name] = {k: v.strip('"') for k, v in re.findall(r'(\w+) = ("[^"]*"|[\d.]+)', fields)}
    return found


@pytest.mark.parametrize("name", builtin_specs())
def test_each_shipped_template_fits_the_declarations_it_states(tmp_path: Path, name: str) -> None:
    declared = declarations_in_comments(builtin_spec_text(name))
    settings = settings_for(tmp_path, name, declared=declared)
    assert load_spec(name, settings.product_metrics()).version
    if declared:
        with pytest.raises(SpecError, match=rf"{name} \(rewards/specs/{name}\.toml\)"):
            load_spec(name, settings_for(tmp_path, name, declared={}).product_metrics())
