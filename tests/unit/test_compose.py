"""docker-compose.yml is kept correct by reading it (no Docker engine needed): the Compose
specification's JSON schema, every FLYWHEEL_* variable against the settings model, and the wiring
between services (addresses and ports, volumes, required variables, health checks, vLLM's mode).

Compose interpolates ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}`` from the host before it
validates the file; :func:`interpolate` does the same with :data:`SAMPLE_ENV` (or less), so the
checks see what a real ``docker compose up`` would.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from flywheel.health import ROLES as BEATING_ROLES
from flywheel.settings import Settings, load_settings
from launch.cli import ROLES, build_parser

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SCHEMA = json.loads((REPO / "tests" / "fixtures" / "compose" / "compose_spec.json").read_text())

#: Every host variable the file reads, with a sample value (the README's deployment section lists them).
SAMPLE_ENV = {"POSTGRES_PASSWORD": "Sample0Password", "MODEL_PATH": "/models/support-bot", "MODEL_LINE": "support-bot"}
#: The ones without a default: compose refuses to start without them.
REQUIRED = {"POSTGRES_PASSWORD"}

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


class MissingVariable(Exception):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with compose's variable substitution applied to every string in it."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"], m["arg"]
        value = env.get(name)
        if op is None:
            return value or ""
        present = bool(value) if op.startswith(":") else value is not None  # ":" also refuses ""
        if present:
            return value
        if op.endswith("?"):
            raise MissingVariable(f"{name}: {arg}")
        return arg

    return _VAR.sub(sub, value)


def variables(value: Any) -> set[str]:
    return {m["name"] or m["bare"] for m in _VAR.finditer(json.dumps(value)) if not m["escaped"]}


COMPOSE = interpolate(RAW, SAMPLE_ENV)
#: Only the required variables set: every default in play.
DEFAULTS = interpolate(RAW, {k: SAMPLE_ENV[k] for k in REQUIRED})
SERVICES = COMPOSE["services"]
FLYWHEEL = sorted(name for name, svc in SERVICES.items() if svc.get("image") == "flywheel:latest")
#: Services that run once to completion (others wait for them with service_completed_successfully).
ONE_SHOT = {dep for svc in SERVICES.values() for dep, cond in (svc.get("depends_on") or {}).items()
            if cond["condition"] == "service_completed_successfully"}


def settings_of(name: str, monkeypatch: pytest.MonkeyPatch, compose: dict[str, Any] = COMPOSE) -> Settings:
    """The settings the service ``name`` runs with (its environment, nothing from this machine)."""
    import os

    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    with monkeypatch.context() as m:
        for key, value in compose["services"][name]["environment"].items():
            assert key.startswith("FLYWHEEL_"), f"{name}: {key} is not a flywheel setting"
            m.setenv(key, str(value))
        return load_settings()  # raises on any unknown or invalid key


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """A service's named-volume mounts: target path -> volume."""
    out = {}
    for entry in svc.get("volumes") or []:
        source, _, target = entry.partition(":")
        assert not source.startswith((".", "/")), f"bind mount {entry}: only named volumes here"
        out[target.split(":")[0]] = source
    return out


def volume_of(svc: dict[str, Any], path: str) -> str | None:
    """The named volume ``path`` lies on in ``svc`` (the deepest mount holding it), or None."""
    hits = [(t, v) for t, v in mounts(svc).items() if path == t or path.startswith(t.rstrip("/") + "/")]
    return max(hits)[1] if hits else None


def arg(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def listens(name: str) -> int | None:
    """The port service ``name`` accepts connections on inside the compose network, read from its
    own configuration."""
    svc = SERVICES[name]
    env = svc.get("environment") or {}
    command = svc.get("command") or []
    if name == "kafka":
        plaintext = [lst for lst in env["KAFKA_LISTENERS"].split(",") if lst.startswith("PLAINTEXT://")]
        return int(plaintext[0].rsplit(":", 1)[1])
    if name == "postgres":
        assert "PGPORT" not in env and "-p" not in command
        return 5432  # the image's default
    if name == "redis":
        return int(arg(command, "--port") or 6379)
    if name == "vllm":
        return int(arg(command, "--port") or 8000)
    for section in ("NODE", "GATEWAY"):
        if f"FLYWHEEL_{section}__PORT" in env and command == [section.lower()]:
            assert env[f"FLYWHEEL_{section}__HOST"] == "0.0.0.0", f"{name} listens on loopback only"
            return int(env[f"FLYWHEEL_{section}__PORT"])
    return None


# --- the Compose specification ---------------------------------------------------------------------


@pytest.mark.parametrize("doc", [RAW, COMPOSE, DEFAULTS], ids=["raw", "interpolated", "defaults"])
def test_the_file_follows_the_compose_specification(doc):
    validator = jsonschema.Draft201909Validator(SCHEMA)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)


def test_the_schema_check_has_teeth():
    validator = jsonschema.Draft201909Validator(SCHEMA)
    bad = interpolate(RAW, SAMPLE_ENV)
    bad["services"]["ingest"]["healthcheck"]["intervall"] = "30s"
    bad["services"]["kafka"]["restart"] = ["always"]
    bad["volumse"] = {}
    found = {e.absolute_path[-1] if e.absolute_path else e.message for e in validator.iter_errors(bad)}
    assert len(found) == 3, found


# --- required variables ----------------------------------------------------------------------------


def test_secrets_have_no_default_and_every_variable_is_known():
    assert variables(RAW) == set(SAMPLE_ENV), "a new host variable: add it to SAMPLE_ENV and the README"
    for name in REQUIRED:
        for env in ({k: v for k, v in SAMPLE_ENV.items() if k != name}, {**SAMPLE_ENV, name: ""}):
            with pytest.raises(MissingVariable, match=name):
                interpolate(RAW, env)
    text = (REPO / "docker-compose.yml").read_text()
    assert "flywheel:flywheel@" not in text
    assert SERVICES["postgres"]["environment"]["POSTGRES_PASSWORD"] == SAMPLE_ENV["POSTGRES_PASSWORD"]
    readme = (REPO / "README.md").read_text()
    for name in SAMPLE_ENV:
        assert f"`{name}`" in readme, f"README does not document {name}"


@pytest.mark.parametrize("name", FLYWHEEL)
@pytest.mark.parametrize("compose", [COMPOSE, DEFAULTS], ids=["sample", "defaults"])
def test_flywheel_environment_is_valid_settings(name, compose, monkeypatch):
    settings = settings_of(name, monkeypatch, compose)
    assert settings.bus.kind == "kafka" and settings.live.kind == "redis"
    url = urlsplit(settings.database_url)
    assert url.scheme.startswith("postgresql") and url.password == SAMPLE_ENV["POSTGRES_PASSWORD"]
    if compose is COMPOSE:
        assert settings.model.line == SAMPLE_ENV["MODEL_LINE"]


# --- services, addresses, volumes -------------------------------------------------------------------


def test_production_parts_are_present():
    for name in ("kafka", "postgres", "redis", "vllm", "migrate", "node-vllm", *ROLES):
        assert name in SERVICES, f"docker-compose.yml lacks service {name}"


def test_kafka_runs_in_kraft_mode():
    env = SERVICES["kafka"]["environment"]
    assert "controller" in env["KAFKA_PROCESS_ROLES"] and "broker" in env["KAFKA_PROCESS_ROLES"]
    assert "zookeeper" not in yaml.safe_dump(COMPOSE).lower()
    assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://kafka:{listens('kafka')}"


def test_flywheel_commands_are_real_roles():
    for name in FLYWHEEL:
        command = SERVICES[name]["command"]
        assert command[0] in ROLES or command == ["db", "upgrade"], f"{name}: unknown command {command}"


@pytest.mark.parametrize("name", FLYWHEEL)
def test_every_address_a_role_is_given_is_a_service_listening_there(name, monkeypatch):
    settings = settings_of(name, monkeypatch)
    addresses = [f"kafka://{server}" for server in settings.bus.bootstrap_servers.split(",")]
    addresses += [settings.database_url, settings.live.redis_url]
    if settings.gateway.upstream and SERVICES[name]["command"] == ["gateway"]:
        addresses.append(settings.gateway.upstream)
    if SERVICES[name]["command"] == ["node"]:
        addresses.append(settings.node.url)  # what its heartbeats send the gateways
        assert urlsplit(settings.node.url).hostname == name, f"{name}'s heartbeat names another service"
        if settings.node.engine == "vllm":
            addresses.append(settings.node.vllm_url)
    for address in addresses:
        url = urlsplit(address)
        assert url.hostname in SERVICES, f"{name} is pointed at {address}: no such service"
        port = listens(url.hostname)
        assert url.port == port, f"{name} is pointed at {address}: {url.hostname} listens on {port}"
        target = SERVICES[url.hostname]
        assert set(target.get("profiles", [])) <= set(SERVICES[name].get("profiles", [])), (
            f"{name} needs {url.hostname}, which runs only with profile(s) {target['profiles']}")


def test_node_ids_and_heartbeat_urls_are_distinct(monkeypatch):
    nodes = [name for name in FLYWHEEL if SERVICES[name]["command"] == ["node"]]
    assert len(nodes) >= 2
    found = [settings_of(name, monkeypatch).node for name in nodes]
    assert len({n.node_id for n in found}) == len({n.url for n in found}) == len(nodes)


def test_volumes_are_declared_and_state_lives_on_them(monkeypatch):
    used = {volume for svc in SERVICES.values() for volume in mounts(svc).values()}
    assert used == set(COMPOSE["volumes"]), "declared and mounted volumes differ"
    for name in set(FLYWHEEL) - ONE_SHOT:
        settings = settings_of(name, monkeypatch)
        svc = SERVICES[name]
        assert volume_of(svc, settings.data_dir) == "data", name
        assert volume_of(svc, str(settings.store_path)) == "weights", name
    gateway = settings_of("gateway", monkeypatch).gateway
    assert volume_of(SERVICES["gateway"], gateway.spool_dir) == "spool", "the gateway's spool must outlive its container"
    kafka = SERVICES["kafka"]
    assert volume_of(kafka, kafka["environment"]["KAFKA_LOG_DIRS"]) == "kafka"
    assert volume_of(SERVICES["postgres"], "/var/lib/postgresql/data") == "pgdata"


def test_dependencies_exist_and_long_running_services_restart_and_have_health_checks():
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy but it has no healthcheck"
        if name in ONE_SHOT:
            assert "restart" not in svc and "healthcheck" not in svc, f"{name} runs once"
            continue
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), f"{name} has no restart policy"
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name} has no health check"
    assert ONE_SHOT == {"migrate"}


@pytest.mark.parametrize("role", BEATING_ROLES)
def test_stages_without_http_are_checked_by_their_heartbeat(role):
    test = SERVICES[role]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "flywheel", "health", role] and test[4] == "--max-age-s", test
    args = build_parser().parse_args(test[2:])  # the check is a real `flywheel health` command line
    assert args.command == "health" and args.role == role
    # Longer than any pause a healthy loop makes between beats (see the comments in the file).
    assert args.max_age_s >= {"ingest": 60, "rewards": 120, "trainer": 600, "rollout": 30, "janitor": 60}[role]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flywheel"] == "launch.cli:main"


def test_gateway_is_published_with_auth_and_falls_back_to_the_node(monkeypatch):
    gw = SERVICES["gateway"]
    settings = settings_of("gateway", monkeypatch)
    assert settings.gateway.auth == "on"
    assert settings.gateway.upstream == f"http://node:{listens('node')}"
    assert any(str(p).endswith(f":{settings.gateway.port}") for p in gw["ports"])
    published = {name for name, svc in SERVICES.items() if svc.get("ports")}
    assert published == {"gateway"}, "only the gateway faces clients (vLLM's dev endpoints have no auth)"


# --- vLLM -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compose", [COMPOSE, DEFAULTS], ids=["sample", "defaults"])
def test_the_vllm_node_and_vllm_agree_on_mode_model_and_files(compose, monkeypatch):
    services = compose["services"]
    vllm, node = services["vllm"], services["node-vllm"]
    settings = settings_of("node-vllm", monkeypatch, compose).node
    full = settings_of("node-vllm", monkeypatch, compose)
    assert settings.engine == "vllm" and urlsplit(settings.vllm_url).hostname == "vllm"
    assert vllm["profiles"] == node["profiles"] == ["gpu"]
    assert node["depends_on"]["vllm"]["condition"] == "service_healthy"
    command, env = vllm["command"], vllm["environment"]
    assert arg(command, "--served-model-name") == full.model.line
    assert arg(command, "--model") == full.model.path and volume_of(vllm, full.model.path) == "models"
    assert volume_of(node, full.model.path) == "models"  # the node reads the weights vLLM started from
    # Versions are written where vLLM reads them: the same volume at the same path.
    assert volume_of(node, settings.vllm_work_dir) == volume_of(vllm, settings.vllm_work_dir) == "vllm-work"
    if settings.vllm_mode == "full":
        assert env.get("VLLM_SERVER_DEV_MODE") == "1"
    else:
        assert "--enable-lora" in command and env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") in ("1", "True", "true")
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_vllm_returns_the_logprobs_of_the_distribution_it_sampled_from():
    """vLLM's default ``--logprobs-mode raw_logprobs`` returns logprobs before temperature, top-k and
    the rest (vllm/v1/sample/sampler.py, ``Sampler.forward``); the trainer needs the processed ones.
    The flag and its value are spelt as vLLM 0.18's ``EngineArgs`` reads them
    (vllm/engine/arg_utils.py: ``--logprobs-mode``; vllm/config/model.py: ``LogprobsMode``)."""
    command = SERVICES["vllm"]["command"]
    assert arg(command, "--logprobs-mode") == "processed_logprobs"
    # "auto" (vLLM's default) applies the model folder's generation_config.json; the node reads the
    # same folder to record what was applied, so it must see MODEL_PATH where vLLM does.
    assert arg(command, "--generation-config") in (None, "auto")
    model_path = arg(command, "--model")
    assert volume_of(SERVICES["node-vllm"], model_path) == volume_of(SERVICES["vllm"], model_path) == "models"
    docs = (REPO / "docs" / "vllm.md").read_text()
    assert docs.count("--logprobs-mode processed_logprobs") >= 2, "docs/vllm.md's vllm serve lines lack the flag"
