"""What each tenant's and request's data may be used for, and how long it is kept: the policy, the header, the effective use.

Three uses, loosest first:

- ``train``: stored, scored and trained on (a tenant's ``train_fraction`` of its sessions; the
  others are ``store_only``);
- ``store_only``: stored and scored (product metrics, promotion gates, exports) but never trained
  on: the events carry ``data_use = "store_only"`` from the gateway on, ingest marks the session's
  trajectory, the rewards stage scores it and does not hand it to the trainer, and the trainer
  drops any such sample before it enters a batch (the mark is per revision: a ``no-train`` turn
  sent after a revision of its session closed marks the later revisions; the earlier one was for
  training when it closed);
- ``none``: served and metered (counters only); nothing of it is written to the capture spool, the
  bus or the database.

A tenant's policy is a settings section of its own (the tenant's home; keys only name a tenant)::

    [tenants."*"]           # every tenant not listed (default: train, train_fraction 1.0)
    data_use = "train"
    train_fraction = 0.5

    [tenants.acme]
    data_use = "store_only"

A tenant's retention (``retention_days``) is how long its rows are kept, counted from each row's
``ts``: one number for every kind, or per kind (``raw_events``: generations, feedback and ingest's
sessions; ``trajectories``; ``scores``); 0 or absent keeps them forever. The retention job
(flywheel/retention.py, run by the ``janitor`` role and ``flywheel data retain``) deletes what is
older. As with the other keys, a tenant's own section replaces ``[tenants."*"]`` whole::

    [tenants."*"]
    retention_days = 30                       # every kind, 30 days

    [tenants.acme]
    retention_days = {raw_events = 7, trajectories = 90}   # scores: kept forever

Settings suffice while tenants are few and their policies change with a deployment; a table that an
operator edits at run time (beside ``api_keys``) is the later step, read through the same
:func:`policy_for`.

A request may only tighten its tenant's policy, with the header ``X-Flywheel-Data: no-train`` (as
``store_only``) or ``no-store`` (as ``none``). A header looser than the policy is not applied (the
policy stands: ``no-train`` under a ``none`` tenant is still ``none``); an unknown value is a
``ValueError`` that the gateway answers with a 400 naming the header, before anything is served.

Sampling for training is by session, so a session is wholly in or out: it is in when the SHA-256 of
``flywheel-train-sample \\x1f tenant \\x1f session_id``, read as a number in [0, 1), is below the
tenant's ``train_fraction``. The salt keeps it independent of the rewards stage's held-out slice
(``rewards.guards``), which hashes the same pair without one. The gateway decides it and the event
records the decision, so a later change of the fraction never relabels what was stored.

Tenant names follow one grammar (:data:`TENANT_NAME`), here and in ``flywheel keys``: a tenant's
settings and its keys name it the same way.

Invariants: pure (no IO, no clock); the settings name tenants by that grammar, or ``*``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: A tenant's name: 1 to 128 letters, digits, ``.``, ``_``, ``@`` and ``-``, starting with a letter or digit.
TENANT_NAME = r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}"
DataUse = Literal["train", "store_only", "none"]
#: The uses, loosest first: the effective use of several is the one latest here.
USES: tuple[DataUse, ...] = ("train", "store_only", "none")
#: The request header that tightens the tenant's policy, and the use each of its values asks for.
HEADER = "X-Flywheel-Data"
HEADER_VALUES: dict[str, DataUse] = {"no-train": "store_only", "no-store": "none"}
#: The response header that tells the client which use applied.
USE_HEADER = "X-Flywheel-Data-Use"
#: The settings key of the policy for tenants not listed.
ANY_TENANT = "*"
#: The kinds a retention names: raw events (generations, feedback, sessions), trajectories, scores.
RETAINED = ("raw_events", "trajectories", "scores")


class RetentionDays(BaseModel):
    """How many days each kind of a tenant's rows is kept; None (or 0 in settings) keeps them forever."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    raw_events: float | None = Field(None, ge=0)
    trajectories: float | None = Field(None, ge=0)
    scores: float | None = Field(None, ge=0)

    @field_validator("raw_events", "trajectories", "scores")
    @classmethod
    def _zero_is_forever(cls, days: float | None) -> float | None:
        return days or None

    def days(self, kind: str) -> float | None:
        """The retention of ``kind`` (one of :data:`RETAINED`) in days; None: forever."""
        return getattr(self, kind)


class TenantPolicy(BaseModel):
    """One tenant's data-use policy (``[tenants.<name>]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    data_use: DataUse = "train"
    #: The share of the tenant's ``train`` sessions that go to training (by session, see above).
    train_fraction: float = Field(1.0, ge=0, le=1)
    #: How long the tenant's rows are kept (module docstring): days for every kind, or per kind.
    retention_days: RetentionDays = RetentionDays()

    @field_validator("retention_days", mode="before")
    @classmethod
    def _one_number_for_all(cls, value: object) -> object:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return dict.fromkeys(RETAINED, value)
        return value


def check_tenants(tenants: Mapping[str, TenantPolicy]) -> None:
    """``ValueError`` naming ``tenants.<name>`` for a name that is no tenant's and not ``*``."""
    for name in tenants:
        if name != ANY_TENANT and not re.fullmatch(TENANT_NAME, name):
            raise ValueError(f"tenants.{name}: not a tenant name (1-128 letters, digits, '.', '_', '@', '-', "
                             f"starting with a letter or digit) nor {ANY_TENANT!r} for every other tenant")


def policy_for(tenants: Mapping[str, TenantPolicy], tenant: str) -> TenantPolicy:
    """``tenant``'s policy: its own section, else ``[tenants."*"]``, else train everything."""
    return tenants.get(tenant) or tenants.get(ANY_TENANT) or TenantPolicy()


def tightest(*uses: DataUse) -> DataUse:
    """The tightest of ``uses`` (``train`` for none)."""
    return max(uses, key=USES.index, default="train")


def requested(header: str | None) -> DataUse:
    """The use a request's ``X-Flywheel-Data`` header asks for (``train``: no header, nothing
    asked); ``ValueError`` for a value that is not ``no-train`` or ``no-store``."""
    if header is None or not header.strip():
        return "train"
    value = header.strip().lower()
    if value not in HEADER_VALUES:
        raise ValueError(f"{HEADER} must be one of {sorted(HEADER_VALUES)}, not {header[:40]!r}: "
                         "a request may only tighten its tenant's data-use policy")
    return HEADER_VALUES[value]


def request_use(policy: TenantPolicy, header: str | None) -> DataUse:
    """The tightest of the tenant's policy and the request's header (a looser header is not applied)."""
    return tightest(policy.data_use, requested(header))


def sample_point(tenant: str, session_id: str) -> float:
    """The session's place in [0, 1) for the training sample (module docstring)."""
    digest = hashlib.sha256(f"flywheel-train-sample\x1f{tenant}\x1f{session_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def sampled(use: DataUse, policy: TenantPolicy, tenant: str, session_id: str) -> DataUse:
    """``use`` after the tenant's training sample: a ``train`` session outside it is ``store_only``."""
    if use == "train" and sample_point(tenant, session_id) >= policy.train_fraction:
        return "store_only"
    return use
