"""docker-compose.yml is kept correct by reading: structure, health checks, and settings cross-checks."""

from pathlib import Path

import pytest
import yaml

from flywheel.cli import ROLES
from flywheel.settings import load_settings

pytestmark = pytest.mark.unit

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
FLYWHEEL_ROLES = {name: svc for name, svc in SERVICES.items() if svc.get("image") == "flywheel:latest"}


def test_production_parts_are_present():
    for name in ("kafka", "postgres", "redis", "vllm", "migrate", *ROLES):
        assert name in SERVICES, f"docker-compose.yml lacks service {name}"


def test_kafka_runs_in_kraft_mode():
    env = SERVICES["kafka"]["environment"]
    assert "controller" in env["KAFKA_PROCESS_ROLES"] and "broker" in env["KAFKA_PROCESS_ROLES"]
    assert "zookeeper" not in yaml.safe_dump(COMPOSE).lower()


def test_every_dependency_exists_and_long_running_services_have_health_checks():
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy but it has no healthcheck"
    for name in ("kafka", "postgres", "redis", "vllm", "node", "gateway"):
        assert SERVICES[name]["healthcheck"]["test"], name


def test_flywheel_commands_are_real_roles():
    for name, svc in FLYWHEEL_ROLES.items():
        command = svc["command"]
        assert command[0] in ROLES or command == ["db", "upgrade"], f"{name}: unknown command {command}"


@pytest.mark.parametrize("name", sorted(FLYWHEEL_ROLES))
def test_flywheel_environment_is_valid_settings(name, monkeypatch):
    env = SERVICES[name]["environment"]
    assert any(k.startswith("FLYWHEEL_") for k in env)
    for key, value in env.items():
        assert key.startswith("FLYWHEEL_"), f"{name}: {key} is not a flywheel setting"
        monkeypatch.setenv(key, str(value))
    settings = load_settings()  # raises on any unknown or invalid key
    assert settings.bus.kind == "kafka" and settings.live.kind == "redis"
    assert settings.database_url.startswith("postgresql")


def test_gateway_fronts_the_node_and_is_published():
    gw = SERVICES["gateway"]
    node_port = SERVICES["node"]["environment"]["FLYWHEEL_NODE__PORT"]
    assert gw["environment"]["FLYWHEEL_GATEWAY__UPSTREAM"] == f"http://node:{node_port}"
    assert any(str(p).endswith(":8000") for p in gw["ports"])
