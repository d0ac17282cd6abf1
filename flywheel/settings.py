"""All of flywheel's settings, in one validated model.

Sources, lowest to highest precedence: the defaults below (the embedded stack: local log bus,
SQLite, in-process live state, a local weight folder, the built-in engine with the tiny model),
an optional TOML (or JSON) file (``FLYWHEEL_CONFIG`` or ``--config``), then environment variables
``FLYWHEEL_<SECTION>__<KEY>`` (for example ``FLYWHEEL_BUS__KIND=kafka``).

Invariants: unknown keys are errors (a renamed key fails loudly), every validation error is
reported at once, and nothing else in the code reads ``os.environ`` for flywheel settings.
Secrets (passwords in ``db.url`` and ``live.redis_url``, ``rewards.judge_api_key``) never appear in
what is shown of the settings: :func:`redact_url` and :func:`redacted` mask them, validation errors
never repeat a value, and a URL whose password holds a raw ``@`` is refused (drivers would print
part of it as the host name).
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from flywheel.consent import TenantPolicy, check_tenants
from flywheel.metrics import Declarations, Metrics, UndeclaredCustom
from flywheel.promotion import MustNotLose, MustWin, check_gates
from flywheel.release_windows import parse_windows, time_zone
from flywheel.retention import RetentionSettings

# Secrets ---------------------------------------------------------------------------------------

#: Query parameters of a URL whose values are secrets (libpq takes ``?password=``, for example).
_SECRET_PARAM = re.compile(r"(?i)([?&;](?:[a-z0-9_]*(?:password|passwd|pwd|secret|token|api_?key|access_?key)"
                           r"[a-z0-9_]*)=)([^&;#]*)")
REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` fit for logs and error messages: the password of its user info and the values of
    secret-looking query parameters replaced by ``***``. Never raises, whatever the text; an
    unparsable URL loses everything up to its last ``@`` (a password with a raw ``@`` in it
    included) rather than show any of it."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        if colon or "@" in user:  # a password, or user info that cannot be told apart from one
            user = f"{user.split('@')[0]}:{REDACTED}"
        rest = f"{user}@{rest[at + 1:]}"
    rest = _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, rest)
    return f"{scheme}{sep}{rest}"


def url_secrets(url: str) -> list[str]:
    """The secret parts of ``url`` (its password, secret query values), to scrub them from text a
    driver wrote (:func:`scrub`)."""
    text = str(url)
    rest = text.partition("://")[2] or text
    found = []
    at = rest.rfind("@")
    if at >= 0 and ":" in rest[:at]:
        userinfo = rest[:at]
        password = userinfo.partition(":")[2]
        found += [userinfo, password, *password.split("@")]
    found += [m.group(2) for m in _SECRET_PARAM.finditer(rest)]
    found += [unquote(s) for s in found]
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def scrub(message: str, secrets: list[str]) -> str:
    """``message`` with every occurrence of each secret replaced by ``***``."""
    for secret in secrets:
        message = message.replace(secret, REDACTED)
    return message


def check_url(url: str, name: str) -> str:
    """Refuse a URL whose user info holds a raw ``@`` (it must be percent-encoded as ``%40``):
    drivers would read part of the password as the host name and print it in their errors."""
    scheme, _, rest = url.partition("://")
    if scheme.startswith("sqlite"):  # a file path, no user info
        return url
    if rest.split("?", 1)[0].count("@") > 1:
        raise ValueError(f"{name} has more than one '@' before its host: percent-encode '@' in the user name "
                         "or password as %40 (the URL itself is not shown: it holds a secret)")
    return url


#: Settings whose whole value is a secret, and settings that are URLs that may carry one.
_SECRET_FIELDS = {("rewards", "judge_api_key"), ("node", "vllm_api_key"), ("gateway", "user_id_secret")}
_URL_FIELDS = {("db", "url"), ("live", "redis_url"), ("store", "endpoint_url"), ("gateway", "upstream"),
               ("node", "vllm_url"), ("node", "url")}


def redacted(settings: Settings) -> dict[str, Any]:
    """The settings as JSON-ready data with every secret shown as ``***`` (``flywheel settings``)."""
    data = settings.model_dump(mode="json")
    for section, key in _SECRET_FIELDS:
        if data.get(section, {}).get(key):
            data[section][key] = REDACTED
    for section, key in _URL_FIELDS:
        if data.get(section, {}).get(key):
            data[section][key] = redact_url(data[section][key])
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BusSettings(_Section):
    kind: Literal["local", "kafka"] = "local"
    bootstrap_servers: str = "127.0.0.1:9092"
    partitions: int = Field(4, ge=1, le=256)
    #: Topic names are ``{topic_prefix}generations`` and so on; tests use a unique prefix.
    topic_prefix: str = "flywheel."
    #: Kafka consumer liveness; the defaults suit a real cluster, tests shorten them.
    session_timeout_ms: int = Field(10_000, ge=1_000)
    heartbeat_interval_ms: int = Field(1_000, ge=100)
    max_poll_interval_ms: int = Field(300_000, ge=1_000)
    #: The longest a fetch waits at the broker for records. Kafka answers as soon as records
    #: arrive; a broker that holds the fetch to the end adds up to this much latency per stage.
    fetch_max_wait_ms: int = Field(100, ge=0, le=30_000)
    compression: Literal["none", "gzip", "zstd", "lz4", "snappy"] = "lz4"
    #: How long the bus keeps a record: Kafka topics' retention.ms; the local log's segments.
    retention_hours: float = Field(168.0, gt=0)


class DatabaseSettings(_Section):
    #: Empty means the embedded SQLite file ``{data_dir}/flywheel.db``. A password is a secret:
    #: logs, error messages and ``flywheel settings`` show it as ``***`` (:func:`redact_url`).
    url: str = ""
    #: Seconds to wait for the database at start-up before giving up.
    wait_s: float = Field(30.0, ge=0)

    @field_validator("url")
    @classmethod
    def _unambiguous_url(cls, url: str) -> str:
        return check_url(url, "db.url")


class LiveSettings(_Section):
    kind: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "flywheel:"

    @field_validator("redis_url")
    @classmethod
    def _unambiguous_redis_url(cls, url: str) -> str:
        return check_url(url, "live.redis_url")


class StoreSettings(_Section):
    kind: Literal["folder", "s3"] = "folder"
    #: Empty means ``{data_dir}/weights``.
    path: str = ""
    #: kind = "s3": the bucket, the key prefix inside it, an endpoint for S3-compatible servers
    #: (empty: AWS) and the region. Credentials come from boto3's chain (AWS_* variables, ...).
    bucket: str = ""
    prefix: str = "flywheel/"
    endpoint_url: str = ""
    region: str = ""
    #: A folder the nodes of one region share as their cache of the store (each object crosses
    #: into the region once); empty: every reader goes to the store itself.
    cache_path: str = ""


class ModelSettings(_Section):
    #: The model line every version belongs to.
    line: str = "tiny-sim"
    #: A local Hugging Face model directory. Empty: the command line (``flywheel node``, ``trainer``,
    #: ``up``) fills it with the demo's tiny model, built on first use, before it starts a stage; a
    #: stage started with it empty refuses to start (:meth:`local_dir`).
    path: str = ""

    def local_dir(self) -> Path:
        """``path``, for a stage about to load the model; an empty ``path`` is an error naming the setting."""
        if not self.path:
            raise SettingsError(
                "model.path is empty: set it to a local Hugging Face model directory (FLYWHEEL_MODEL__PATH), "
                "or start the role with `flywheel <role>`, which fills it with the demo's tiny model"
            )
        return Path(self.path)


class GatewaySettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    #: OpenAI-compatible upstream base URL (".../v1" not included); empty means the local node.
    upstream: str = ""
    #: ``off`` on embedded defaults; ``on`` requires a tenant API key on every request.
    auth: Literal["off", "on"] = "off"
    default_tenant: str = "local"
    max_body_bytes: int = Field(1_000_000, ge=1_024)
    #: The most choices (OpenAI's ``n``) one request may ask for; more is a 400 naming ``n``. Each
    #: choice is captured as its own generation, the request's choices as one group.
    max_n: int = Field(8, ge=1, le=128)
    #: Slow clients (slowloris, docs/security.md): a request's line and headers must arrive within
    #: ``header_read_timeout_s`` of its first byte (or of the connection opening) and within
    #: ``max_header_bytes``, else the connection gets a 408 or 431 and is closed; its body must
    #: arrive whole within ``body_read_timeout_s`` of the gateway starting to read it, else 408.
    header_read_timeout_s: float = Field(10.0, gt=0, le=3600)
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600)
    max_header_bytes: int = Field(65_536, ge=4_096, le=16 << 20)
    upstream_timeout_s: float = Field(120.0, gt=0)
    #: Names this gateway process: its spool folder and its metrics. Two gateways never share one.
    gateway_id: str = "gateway-0"
    # Capture (serving/gateway/spool.py, shipper.py) -----------------------------------------------
    #: The write-ahead spool every event passes through; empty means ``{data_dir}/spool/{gateway_id}``.
    spool_dir: str = ""
    #: Unshipped events the spool may hold before ``spool_full`` applies.
    spool_max_bytes: int = Field(1 << 30, ge=1 << 16)
    #: The spool is fsync'd in batches at most this far apart (writes survive a killed process at once).
    spool_fsync_interval_ms: float = Field(20.0, gt=0)
    #: ``drop``: keep serving and count every event that could not be spooled (loudly);
    #: ``reject``: answer new completion requests with 503 while the spool is full.
    spool_full: Literal["drop", "reject"] = "drop"
    #: When a response is released: once its event is ``written`` to the spool (survives a killed
    #: gateway), ``fsynced`` (survives a host crash), or acknowledged by the ``bus``.
    capture_ack: Literal["written", "fsynced", "bus"] = "written"
    #: Records per bus batch the shipper sends, and how long it waits for their acknowledgement
    #: before it treats the bus as down (events stay spooled and are replayed in order).
    ship_batch: int = Field(500, ge=1)
    ship_timeout_s: float = Field(5.0, gt=0)
    #: Events above this many bytes are compressed, then split into chunks of at most this size
    #: (Kafka's default message.max.bytes is 1 MiB); never truncated.
    max_record_bytes: int = Field(900_000, ge=1_024)
    #: SIGTERM: how long in-flight requests may finish, then as long again for the spool to drain
    #: to the bus (what is left stays spooled for the next start).
    drain_timeout_s: float = Field(30.0, ge=0)
    # Tenancy, auth and limits (serving/gateway/auth.py, state.py) -------------------------------
    #: Default per-key request limit per minute (0: unlimited); a key may carry its own.
    rate_limit_rpm: int = Field(0, ge=0)
    #: Requests a key may make at once above its steady rate (token-bucket capacity; 0: rpm / 6).
    rate_limit_burst: int = Field(0, ge=0)
    #: Validated keys are cached this long, so a revoked key stops working within this time.
    key_cache_s: float = Field(5.0, ge=0)
    #: How long the gateway remembers which tenant owns a generation or session (feedback may come
    #: this late; older ones are looked up in the database).
    ownership_ttl_s: float = Field(7 * 86_400.0, gt=0)
    #: A session keeps its model version (sticky) for this long after its last request.
    session_ttl_s: float = Field(86_400.0, gt=0)
    #: The key end users' ids (``user``, ``X-Flywheel-User``) are hashed with before anything stores
    #: them (``flywheel/identity.py``; a secret: never shown). At least 32 characters; empty means a
    #: secret made once in ``{data_dir}/user_id_secret``. Gateways on several machines share one.
    user_id_secret: str = Field("", repr=False, pattern=r"^(.{32,})?$")


class NodeSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    node_id: str = "node-0"
    region: str = "local"
    #: How often the updater looks for a newer stable version (database poll fallback).
    poll_s: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(16, ge=1, le=4096)
    #: The most choices (``n``) one request may ask this node for; more is a 400 naming ``n``.
    max_n: int = Field(8, ge=1, le=128)
    #: Versions a node keeps loaded, so sessions pinned to a recent version stay on it (sticky).
    keep_versions: int = Field(4, ge=1)
    #: The base URL the gateway reaches this node at (heartbeats carry it); empty: http://host:port.
    url: str = ""
    max_body_bytes: int = Field(1_000_000, ge=1_024)
    #: A request body must arrive whole within this long of the node starting to read it, else 408
    #: (headers: serving/server.py's defaults apply).
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600)
    seed: int = 0
    #: builtin: this process serves with the built-in engine. vllm: a vLLM server at ``vllm_url``
    #: generates and this process keeps it on the registry's versions (serving/node/vllm_adapter.py,
    #: docs/vllm.md), as ``vllm_mode`` says; in full mode this process also serves the front the
    #: gateway talks to, stamping each answer with its version (serving/node/vllm_front.py).
    engine: Literal["builtin", "vllm"] = "builtin"
    vllm_url: str = ""
    #: engine = "vllm": ``full``: versions are full weights, reloaded in place (vLLM started with
    #: ``VLLM_SERVER_DEV_MODE=1`` from ``model.path``, served model name = ``model.line``).
    #: ``lora``: versions are LoRA adapters (a line published with ``trainer.lora_publish =
    #: "adapter"``; ``trainer.lora_*`` describe them), loaded at runtime into a vLLM server that
    #: serves the base model ``model.path`` with ``--enable-lora`` and
    #: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; requests name ``<line>-v<version>``.
    vllm_mode: Literal["full", "lora"] = "full"
    #: Where versions are written for vLLM to read (it must see the same path); empty:
    #: ``{data_dir}/vllm``.
    vllm_work_dir: str = ""
    #: Where the engine's sampling defaults come from, for what a request leaves unset (vLLM's
    #: ``--generation-config``, which must say the same): ``auto``, the model directory's
    #: generation_config.json (vLLM's default), or ``vllm``, OpenAI's neutral defaults. The node's
    #: heartbeat carries them, so the gateway records the parameters the engine applied.
    generation_config: Literal["auto", "vllm"] = "auto"
    #: vLLM's ``--api-key`` (a secret: never shown): sent as ``Authorization: Bearer`` on every call
    #: to vLLM (vLLM guards its ``/v1`` routes with it; the dev routes have no authentication).
    vllm_api_key: str = Field("", repr=False)
    #: Extra seconds each built-in generation takes before it is returned (0: none). Benchmarks set
    #: it to stand in for a production model's serving time without spending CPU on it.
    simulated_latency_s: float = Field(0.0, ge=0, le=60)

    @model_validator(mode="after")
    def _vllm_needs_a_url(self) -> NodeSettings:
        if self.engine == "vllm" and not self.vllm_url:
            raise ValueError("node.engine = 'vllm' needs node.vllm_url")
        if self.vllm_mode == "lora" and self.engine != "vllm":
            raise ValueError("node.vllm_mode = 'lora' needs node.engine = 'vllm' "
                             "(the built-in engine serves full weights)")
        return self


class IngestSettings(_Section):
    #: A session with no new event for this long is closed and emitted as a trajectory (by the
    #: worker that owns its generations partition).
    inactivity_timeout_s: float = Field(30.0, gt=0)
    #: A session still open this long after its last event is closed by any worker (its partition
    #: has no live owner, or its topic has a partition count other than ``bus.partitions``);
    #: unset: 10 x ``inactivity_timeout_s``.
    orphan_timeout_s: float | None = Field(None, gt=0)
    #: Feedback this long after its trajectory's newest event (event time) is stored and counted
    #: as expired, not re-emitted; earlier late feedback re-opens the trajectory (revision + 1).
    late_horizon_s: float = Field(3600.0, ge=0)
    #: Generations this worker stored are kept decoded, up to this many tokens (prompt +
    #: completion, about 40 bytes each), so closing a session rarely reads its payloads back from
    #: the database; 0 turns the cache off.
    cache_tokens: int = Field(2_000_000, ge=0)

    @model_validator(mode="after")
    def _orphans_after_inactivity(self) -> IngestSettings:
        if self.orphan_timeout_s is not None and self.orphan_timeout_s < self.inactivity_timeout_s:
            raise ValueError("ingest.orphan_timeout_s must be at least ingest.inactivity_timeout_s")
        return self

    @property
    def orphan_after_s(self) -> float:
        return self.orphan_timeout_s if self.orphan_timeout_s is not None else 10 * self.inactivity_timeout_s


class MetricsSettings(_Section):
    """The product's declared metrics (flywheel/metrics.py): what feedback may name besides the built-ins."""

    #: Name -> declaration: ``[metrics.declared.helpfulness]`` with ``type`` (boolean, float,
    #: comment), ``level`` (generation, session), ``direction`` (max, min; none for a comment) and a
    #: float's optional ``min`` / ``max``. Feedback names one in ``metric`` (kind ``custom`` on the wire).
    declared: Declarations = Field(default_factory=dict)
    #: Custom feedback naming no declared metric: ``reject`` (a 400 naming the field) or ``accept``
    #: (unchecked, as before metrics were declared; never a metric).
    undeclared_custom: UndeclaredCustom = "reject"


class RewardSettings(_Section):
    #: The reward spec (a TOML file, see rewards/spec.py); empty means the built-in default spec
    #: (rewards/specs/default.toml); a shipped template's name (``tab-completion``, ``coding-agent``,
    #: ``support-agent``) means that template. What rewards are worth lives in the spec, not here.
    spec_path: str = ""
    #: Bearer token for the LLM judge's endpoint when the spec enables one (never in the spec file).
    #: A plain string like ``db.url``: ``flywheel up`` hands its children the effective settings.
    judge_api_key: str = ""
    #: At start the worker rebuilds its normalisation statistics from this many newest scored rows
    #: of its spec version (the statistics are not persisted; see rewards/normalise.py).
    restore_rows: int = Field(5000, ge=0)
    #: Score only trajectories ingest stored: a trajectory record whose event has no row in
    #: ``trajectories`` did not come from ingest (a forged or stray record) and is dead-lettered.
    #: Off only to score trajectories replayed into a database that does not hold them.
    require_stored: bool = True


class TrainerSettings(_Section):
    #: async: train on whatever arrives within ``max_staleness`` versions (the product setting).
    #: sync: train only on samples served by the version being trained (on-policy), waiting for
    #: them after each publish; for comparison (bench/trainer.py).
    mode: Literal["async", "sync"] = "async"
    #: With Adam, lr x steps_per_version sets the share of bf16 elements a version changes
    #: (bench/learnability.py: 2e-5 x 2 steps changes ~18%, a delta of ~9% of the full checkpoint;
    #: one step per version halves that).
    lr: float = Field(2e-5, ge=0)
    #: Linear learning-rate warm-up over this many optimizer steps from a start without a checkpoint
    #: (a restart from a checkpoint resumes the schedule).
    warmup_steps: int = Field(10, ge=1)
    #: Trajectories per optimizer step (at most; see ``batch_tokens``).
    batch_size: int = Field(32, ge=1)
    #: Token budget of an optimizer step (0: none): a step takes the oldest samples up to
    #: ``batch_size`` of them and up to this many tokens, and starts once either is buffered.
    batch_tokens: int = Field(0, ge=0)
    #: Tokens per forward/backward pass (padded tokens, rows x longest row, when ``packing`` is
    #: off): a step larger than this is split into micro-batches whose gradients accumulate (same
    #: result as one pass, less memory). A sample longer than this goes alone.
    micro_batch_tokens: int = Field(8192, ge=1)
    #: Pack each micro-batch's samples into one row with no padding (positions restart per
    #: segment, attention never crosses segments: trainer/packing.py); off: one right-padded row
    #: per segment. Both give the same loss and gradients.
    packing: bool = True
    #: Positions per chunk of the lm-head + log-softmax (trainer/head.py): logits are never held
    #: for more than this many positions at once, forward or backward.
    logprob_chunk_tokens: int = Field(1024, ge=1)
    #: Recompute activations in the backward pass instead of keeping them (trainer/compute.py):
    #: ``block``, each transformer block's (it keeps only its input: the least memory, about a
    #: third more compute); ``mlp``, each block's MLP intermediates only (most of the memory, a
    #: small share of the compute); ``none``.
    activation_checkpointing: Literal["none", "mlp", "block"] = "mlp"
    #: ``torch.compile`` the model's blocks (falls back to eager, logged, where compiling fails).
    compile: bool = False
    #: Write checkpoints and publish versions in a background thread while the next steps train
    #: (trainer/publisher.py); off: at the publish point, in the loop.
    publish_in_background: bool = True
    #: Optimizer steps between published versions.
    steps_per_version: int = Field(1, ge=1)
    #: Also publish once this many seconds passed since the last version, if a step was taken
    #: since (0: by ``steps_per_version`` only).
    publish_every_s: float = Field(0.0, ge=0)
    #: Weight of the KL(policy || reference) penalty, the reference being the frozen model the
    #: line started from (``model.path``); 0: no reference is loaded.
    kl_coef: float = Field(0.0, ge=0)
    #: LoRA rank (peft); 0 trains every parameter (trainer/policy.py).
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    #: What a LoRA version is: ``merged``, the full weights ``W + scale * B @ A`` (any node serves
    #: them); ``adapter``, the adapter state only (PEFT names, bf16) on top of the fixed base
    #: ``model.path``, served by vLLM nodes in ``node.vllm_mode = "lora"``. A line keeps one kind.
    lora_publish: Literal["merged", "adapter"] = "merged"
    #: Where the trainer computes: cpu, cuda (this rank's GPU; bf16 compute, fp32 master) or auto.
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    #: Under torchrun (trainer/distributed.py): FSDP2 where this torch has it (auto), or DDP.
    parallel: Literal["auto", "fsdp2", "ddp"] = "auto"
    #: Full-parameter: each rank checkpoints and publishes its own shard (trainer/shard_publish.py;
    #: no rank gathers the model or Adam state; inline) under torchrun with FSDP2, and in one process
    #: with publish_in_background off (the live model streamed as one shard). Off: rank 0 gathers both.
    sharded_versions: bool = True
    #: Samples whose behaviour version is more than this many versions old are dropped.
    max_staleness: int = Field(4, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    #: Truncated importance sampling: per-token ratio cap for the train/inference mismatch.
    is_truncation: float = Field(2.0, ge=1)
    #: A full checkpoint every K versions (the rest are deltas against their parent).
    full_every: int = Field(50, ge=1)
    seed: int = 0
    weight_decay: float = Field(0.0, ge=0)
    #: Where the trainer's checkpoints live (one folder per model line below it); empty means
    #: ``{data_dir}/trainer``. A checkpoint is written at every publish point (trainer/checkpoint.py).
    checkpoint_dir: str = ""
    #: Checkpoints kept; only the newest is ever loaded, older ones are for inspection.
    keep_checkpoints: int = Field(2, ge=1)
    #: Train only on scored trajectories the rewards stage stored: a scored record whose event has
    #: no row in ``scored_trajectories`` did not come from rewards (a forged or stray record) and is
    #: dead-lettered. Off only to train on scored records replayed into another database (an lr-0
    #: control run on a copy of the scored topic).
    require_stored: bool = True

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> TrainerSettings:
        if self.lora_publish == "adapter" and self.lora_rank == 0:
            raise ValueError("trainer.lora_publish = 'adapter' needs trainer.lora_rank > 0")
        return self


class FreezeSettings(_Section):
    """A period in which the rollout controller promotes nothing (one ``rollout.freezes`` entry)."""

    #: ISO 8601 date-times, ``start`` inclusive, ``end`` exclusive; without an offset, in ``rollout.timezone``.
    start: datetime
    end: datetime
    #: Why (shown in every decision the freeze holds).
    reason: str = Field(min_length=1)


class RolloutSettings(_Section):
    """The rollout controller's policy (serving/rollout.py has the statistics and their reading)."""

    #: Seconds between rollout decisions (hours in production, seconds in the demo).
    interval_s: float = Field(10.0, gt=0)
    #: Share of new sessions the gateway sends to a version in ``canary`` status. 0: no canary,
    #: a candidate that passes its gates is promoted to stable directly.
    canary_fraction: float = Field(0.1, ge=0, le=1)
    #: A canary is promoted no earlier than this many seconds after it started.
    window_s: float = Field(3600.0, ge=0)
    #: Generations the canary and the stable version must each have served since the canary
    #: started before they are compared (fewer: keep waiting).
    min_samples: int = Field(200, ge=1)
    #: Significance of the one-sided tests that roll a canary back (each test at this level).
    alpha: float = Field(0.05, gt=0, lt=1)
    #: Latency counts as worse only beyond this relative margin over stable's (0.1: 10% slower).
    latency_tolerance: float = Field(0.1, ge=0)
    #: Held-out gate: both versions need this many held-out trajectories (one reward spec version)
    #: before their held-out reward rates are compared.
    held_out_min_samples: int = Field(100, ge=1)
    #: Held-out gate: a version whose held-out reward rate is below stable's by more than this
    #: (absolute, in the spec's reward units) is not promoted.
    held_out_tolerance: float = Field(0.02, ge=0)
    #: Parity gate: the version metric holding the trainer/inference logprob mismatch (the trainer
    #: records ``parity``: mean |trainer logprob - served logprob| over on-policy tokens, nats).
    parity_metric: str = Field("parity", min_length=1)
    #: Parity gate: a version whose parity figure is at or above this is not promoted.
    parity_max: float = Field(0.05, gt=0)
    # The release calendar (serving/rollout_calendar.py): when a promotion to stable may happen.
    # Canary starts and rollbacks are never held by it.
    #: The IANA time zone the windows, freezes without an offset and the daily limit's days are in.
    timezone: str = "UTC"
    #: Weekly wall-clock windows in which promotions may happen (flywheel/release_windows.py); none may
    #: overlap another. Empty: always.
    windows: list[str] = []
    #: Periods in which nothing is promoted (each ``{start, end, reason}``); they may overlap.
    freezes: list[FreezeSettings] = []
    #: The controller's automatic promotions allowed per local day (0: no limit).
    max_promotions_per_day: int = Field(0, ge=0)
    #: A canary is promoted no earlier than this many seconds after it became canary; a candidate
    #: promoted directly (``canary_fraction`` 0), this long after it was published.
    min_soak_s: float = Field(0.0, ge=0)
    # Promotion on evidence (flywheel/promotion.py; serving/rollout_evidence.py has the statistics).
    #: Metrics the canary must beat stable on, by at least each one's ``min_effect``, to be promoted.
    must_win: list[MustWin] = []
    #: Metrics the canary may not be worse on than stable by more than each one's ``tolerance``.
    must_not_lose: list[MustNotLose] = []
    #: With a gate set: a canary not promoted this many seconds after it started is rolled back.
    max_window_s: float = Field(86400.0, gt=0)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        time_zone(name)
        return name

    @field_validator("windows")
    @classmethod
    def _valid_windows(cls, texts: list[str]) -> list[str]:
        parse_windows(texts)
        return texts

    @model_validator(mode="after")
    def _freezes_in_zone(self) -> RolloutSettings:
        zone = time_zone(self.timezone)
        for i, freeze in enumerate(self.freezes):
            freeze.start, freeze.end = (t if t.tzinfo else t.replace(tzinfo=zone) for t in (freeze.start, freeze.end))
            if freeze.end <= freeze.start:
                raise ValueError(f"rollout.freezes[{i}] ({freeze.reason}) ends before it starts")
        if (self.must_win or self.must_not_lose) and self.max_window_s < self.window_s:
            raise ValueError(f"rollout.max_window_s ({self.max_window_s:g}) is shorter than window_s ({self.window_s:g})")
        return self


#: The topics each consuming stage reads (short names, ``Settings.topic`` adds the prefix), in the
#: order it subscribes to them, under its group ``Settings.group(stage)``: the one table the workers
#: and the operator's lag view (``flywheel.bus.base.stage_lags``) share.
STAGE_TOPICS: dict[str, tuple[str, ...]] = {
    "ingest": ("generations", "feedback"),
    "rewards": ("trajectories",),
    "trainer": ("scored",),
}


class Settings(BaseSettings):
    """The root settings object; build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    data_dir: str = ".flywheel"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: Torch intra-op threads per process; one is fastest when several roles share a few cores.
    torch_threads: int = Field(1, ge=1)
    bus: BusSettings = BusSettings()
    db: DatabaseSettings = DatabaseSettings()
    live: LiveSettings = LiveSettings()
    store: StoreSettings = StoreSettings()
    model: ModelSettings = ModelSettings()
    gateway: GatewaySettings = GatewaySettings()
    node: NodeSettings = NodeSettings()
    ingest: IngestSettings = IngestSettings()
    metrics: MetricsSettings = MetricsSettings()
    rewards: RewardSettings = RewardSettings()
    trainer: TrainerSettings = TrainerSettings()
    rollout: RolloutSettings = RolloutSettings()
    retention: RetentionSettings = RetentionSettings()  # the janitor's schedule (flywheel/retention.py)
    #: Each tenant's data-use policy, ``"*"`` for those not listed (flywheel/consent.py).
    tenants: dict[str, TenantPolicy] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment over explicit (file) values, as documented above; off while applying overrides.
        return (env_settings, init_settings) if _READ_ENV.get() else (init_settings,)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.bus.heartbeat_interval_ms * 3 > self.bus.session_timeout_ms:
            raise ValueError("bus.heartbeat_interval_ms must be at most a third of bus.session_timeout_ms")
        check_gates(self.rollout.must_win, self.rollout.must_not_lose, self.product_metrics())
        check_tenants(self.tenants)
        return self

    def product_metrics(self) -> Metrics:
        """The metrics this deployment knows: the built-ins and ``[metrics.declared]``."""
        return Metrics(self.metrics.declared, undeclared_custom=self.metrics.undeclared_custom)

    # Derived locations -------------------------------------------------------------------------

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    @property
    def database_url(self) -> str:
        return self.db.url or f"sqlite:///{self.data_path / 'flywheel.db'}"

    @property
    def store_path(self) -> Path:
        return Path(self.store.path) if self.store.path else self.data_path / "weights"

    @property
    def bus_log_path(self) -> Path:
        return self.data_path / "bus"

    def topic(self, name: str) -> str:
        """Full topic name for one of: generations, feedback, trajectories, scored, versions."""
        return f"{self.bus.topic_prefix}{name}"

    def group(self, stage: str) -> str:
        """The Kafka consumer group of a stage (``ingest``, ``rewards``, ``trainer``), under the topic
        prefix: deployments sharing a cluster under different prefixes never share a group (a group
        rebalances all its members together, whatever topics they read)."""
        return f"{self.bus.topic_prefix}{stage}"

    def stage_topics(self, stage: str) -> list[str]:
        """Full names of the topics a consuming stage (``ingest``, ``rewards``, ``trainer``) reads
        with its group (:data:`STAGE_TOPICS`), in the order it subscribes to them."""
        return [self.topic(name) for name in STAGE_TOPICS[stage]]


_READ_ENV: contextvars.ContextVar[bool] = contextvars.ContextVar("flywheel_read_env", default=True)
#: Environment variables with the FLYWHEEL_ prefix that are not settings.
_NOT_SETTINGS = {"FLYWHEEL_CONFIG"}


class SettingsError(Exception):
    """Settings could not be loaded; the message lists every problem at once."""


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Load settings from defaults, an optional TOML file, the environment and ``overrides``.

    ``overrides`` are nested dicts keyed like the TOML file and win over everything else.
    """
    file_values: dict[str, Any] = {}
    path = path or os.environ.get("FLYWHEEL_CONFIG")
    if path:
        try:
            text = Path(path).read_text()
            file_values = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot read settings file {path}: {exc}") from exc
    problems = [
        f"  {key}: not a flywheel setting (top-level keys: {', '.join(sorted(Settings.model_fields))})"
        for key in sorted(os.environ)
        if key.startswith("FLYWHEEL_") and key not in _NOT_SETTINGS
        and key[len("FLYWHEEL_"):].split("__")[0].lower() not in Settings.model_fields
    ]
    settings = None
    try:
        settings = Settings(**file_values)
        if overrides:
            token = _READ_ENV.set(False)
            try:
                settings = Settings(**deep_merge(settings.model_dump(), overrides))
            finally:
                _READ_ENV.reset(token)
    except ValidationError as exc:
        problems += [f"  {'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()]
    if problems:
        raise SettingsError(f"{len(problems)} invalid setting(s):\n" + "\n".join(problems))
    assert settings is not None
    return settings


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it: nested dicts merge key by key, anything else in
    ``extra`` replaces what ``base`` holds. Neither argument is modified."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
