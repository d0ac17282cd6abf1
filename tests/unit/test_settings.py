"""flywheel.settings: defaults, TOML file, FLYWHEEL_ environment, overrides, and loud failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel.settings import Settings, SettingsError, TrainerSettings, load_settings

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No FLYWHEEL_* variables from the outer environment, and a scratch working directory."""
    for name in list(os.environ):
        if name.startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flywheel.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_embedded_stack():
    s = load_settings()
    assert isinstance(s, Settings)
    assert s.bus.kind == "local"
    assert s.live.kind == "memory"
    assert s.store.kind == "folder"
    assert s.db.url == ""
    assert s.database_url == f"sqlite:///{Path('.flywheel') / 'flywheel.db'}"
    assert s.store_path == Path(".flywheel") / "weights"
    assert s.bus_log_path == Path(".flywheel") / "bus"
    assert s.topic("generations") == "flywheel.generations"
    assert s.topic("scored") == "flywheel.scored"
    assert s.gateway.port == 8000 and s.node.port == 8100


def test_derived_locations_follow_data_dir_and_explicit_values():
    s = load_settings(data_dir="/srv/fw", store={"path": "/mnt/weights"}, db={"url": "postgresql://u@h/db"})
    assert s.database_url == "postgresql://u@h/db"
    assert s.store_path == Path("/mnt/weights")
    assert s.bus_log_path == Path("/srv/fw/bus")


def test_environment_overrides_with_prefix_and_nesting(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_BUS__KIND", "kafka")
    monkeypatch.setenv("FLYWHEEL_BUS__PARTITIONS", "12")
    monkeypatch.setenv("FLYWHEEL_TRAINER__LR", "0.001")
    monkeypatch.setenv("FLYWHEEL_DATA_DIR", "/var/lib/flywheel")
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "DEBUG")
    s = load_settings()
    assert s.bus.kind == "kafka"
    assert s.bus.partitions == 12
    assert s.trainer.lr == pytest.approx(0.001)
    assert s.data_dir == "/var/lib/flywheel"
    assert s.log_level == "DEBUG"
    assert s.bus.topic_prefix == "flywheel."  # untouched siblings keep their defaults


def test_toml_file(tmp_path):
    path = _write(
        tmp_path,
        """
data_dir = "/data"
[bus]
kind = "kafka"
bootstrap_servers = "kafka:9092"
[trainer]
batch_size = 64
[rewards]
spec_path = "/specs/rewards-v2.toml"
""",
    )
    s = load_settings(path)
    assert s.data_dir == "/data"
    assert (s.bus.kind, s.bus.bootstrap_servers) == ("kafka", "kafka:9092")
    assert s.trainer.batch_size == 64
    assert s.rewards.spec_path == "/specs/rewards-v2.toml"
    assert s.trainer.lr == TrainerSettings().lr  # untouched sections keep their defaults


def test_config_file_from_environment_and_precedence(tmp_path, monkeypatch):
    path = _write(tmp_path, "[bus]\npartitions = 8\ntopic_prefix = \"file.\"\n")
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(path))
    assert load_settings().bus.partitions == 8
    # Environment beats the file; explicit overrides beat both.
    monkeypatch.setenv("FLYWHEEL_BUS__PARTITIONS", "16")
    s = load_settings()
    assert (s.bus.partitions, s.bus.topic_prefix) == (16, "file.")


def test_overrides_beat_environment_and_file(tmp_path, monkeypatch):
    path = _write(tmp_path, "[bus]\npartitions = 8\n")
    monkeypatch.setenv("FLYWHEEL_BUS__PARTITIONS", "16")
    assert load_settings(path, bus={"partitions": 32}).bus.partitions == 32


@pytest.mark.parametrize(
    "text, where",
    [
        ("[bus]\nkindd = \"kafka\"\n", "bus.kindd"),
        ("dataa_dir = \"/x\"\n", "dataa_dir"),
        ("[busses]\nkind = \"kafka\"\n", "busses"),
    ],
)
def test_unknown_key_in_file_fails(tmp_path, text, where):
    with pytest.raises(SettingsError) as info:
        load_settings(_write(tmp_path, text))
    assert where in str(info.value)


def test_unknown_top_level_key_in_environment_fails(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_BOGUS", "1")
    monkeypatch.setenv("FLYWHEEL_TRAINER__LR", "-1")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "FLYWHEEL_BOGUS" in str(info.value) and "trainer.lr" in str(info.value)


def test_unknown_nested_key_in_environment_fails(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_BUS__KINDD", "kafka")
    with pytest.raises(SettingsError, match=r"bus\.kindd"):
        load_settings()


def test_unknown_override_fails():
    with pytest.raises(SettingsError, match=r"trainer\.learning_rate"):
        load_settings(trainer={"learning_rate": 1.0})


def test_every_error_is_reported_together(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        """
log_level = "LOUD"
[bus]
partitions = 0
[gateway]
port = 70000
[trainer]
renamed_key = 1
""",
    )
    monkeypatch.setenv("FLYWHEEL_LIVE__KIND", "memcached")
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    message = str(info.value)
    assert message.startswith("5 invalid setting(s)")
    for where in ("log_level", "bus.partitions", "gateway.port", "trainer.renamed_key", "live.kind"):
        assert f"  {where}:" in message


def test_cross_field_check():
    with pytest.raises(SettingsError, match="heartbeat_interval_ms"):
        load_settings(bus={"session_timeout_ms": 3_000, "heartbeat_interval_ms": 1_500})
    s = load_settings(bus={"session_timeout_ms": 3_000, "heartbeat_interval_ms": 1_000})
    assert s.bus.heartbeat_interval_ms == 1_000


def test_unreadable_or_malformed_file(tmp_path):
    with pytest.raises(SettingsError, match="cannot read settings file"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match="cannot read settings file"):
        load_settings(_write(tmp_path, "[bus\nkind = 1\n"))


def test_wrong_types_are_rejected_not_coerced_silently():
    with pytest.raises(SettingsError, match=r"bus\.partitions"):
        load_settings(bus={"partitions": "many"})
    with pytest.raises(SettingsError, match=r"bus\.kind"):
        load_settings(bus={"kind": "rabbitmq"})


def test_an_empty_model_path_is_refused_by_name_where_a_stage_loads_the_model(tmp_path):
    assert load_settings(model={"path": str(tmp_path)}).model.local_dir() == tmp_path
    with pytest.raises(SettingsError, match=r"model\.path is empty"):
        load_settings().model.local_dir()  # the command line fills it; a stage never guesses one
