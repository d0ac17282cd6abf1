"""API keys: their format, how they are stored, and ``flywheel keys create|list|revoke``.

A key is ``fwk_<key_id>_<secret>``: ``key_id`` is 12 random hex digits, shown in listings and logs
so a key can be named and revoked; ``secret`` is 64 hex digits (256 random bits) and is printed once,
by ``keys create``, and never stored.

Invariants:
- The database keeps only ``sha256(whole key)`` (hex). A slow password hash (bcrypt, scrypt,
  argon2) exists to make guessing a low-entropy password from its hash expensive; a 256-bit random
  secret cannot be guessed at any hash speed (2^256 tries), so a slow hash would only add
  milliseconds of CPU to every uncached request. Stored hashes are compared with
  :func:`hmac.compare_digest`.
- A key is looked up by its ``key_id`` (not secret: listings show it), then the hash is compared;
  a revoked key (``revoked_at`` set) never authenticates again. Revocation is not undone.
- Nothing here logs or prints a secret except ``keys create`` printing the new key once.
- Tenant names are 1-128 characters of ``[A-Za-z0-9._@-]`` starting with a letter or digit, so they
  are safe in logs, metrics labels and live-state keys; every command-line tenant and key id is
  checked before the database is opened (a bad one exits 2 with the reason).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import re
import secrets
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from flywheel.consent import TENANT_NAME

if TYPE_CHECKING:  # the parser is built on every CLI call: SQLAlchemy is imported only when used
    from sqlalchemy.orm import Session, sessionmaker

    from flywheel.db.models import ApiKey

KEY_PREFIX = "fwk_"
KEY_ID_HEX = 12
SECRET_HEX = 64
ROLES = ("tenant", "admin")
_KEY_RE = re.compile(rf"{KEY_PREFIX}([0-9a-f]{{{KEY_ID_HEX}}})_([0-9a-f]{{{SECRET_HEX}}})")
_TENANT_RE = re.compile(TENANT_NAME)  # one grammar for keys and tenants' settings (flywheel.consent)


# Format ----------------------------------------------------------------------------------------


def new_key() -> tuple[str, str]:
    """A fresh ``(key_id, key)``."""
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_hex(SECRET_HEX // 2)}"


def key_id_of(key: str) -> str | None:
    """The ``key_id`` of a well-formed key; None for anything else."""
    match = _KEY_RE.fullmatch(key)
    return match.group(1) if match else None


def key_hash(key: str) -> str:
    """The stored form of a key: sha256 of the whole key, hex."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def check_tenant(tenant: str) -> str:
    if not _TENANT_RE.fullmatch(tenant):
        raise ValueError(
            f"invalid tenant name {tenant!r}: use 1-128 characters of letters, digits, '.', '_', '@', '-', "
            "starting with a letter or digit"
        )
    return tenant


# Data access -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyInfo:
    """A key's row without its hash; what listings show and authentication returns."""

    key_id: str
    tenant: str
    role: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    rate_limit_rpm: int | None

    @classmethod
    def of(cls, row: ApiKey) -> KeyInfo:
        return cls(row.key_id, row.tenant, row.role, row.name, row.created_at, row.revoked_at, row.rate_limit_rpm)

    def as_json(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "role": self.role,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
            "rate_limit_rpm": self.rate_limit_rpm,
        }


def create_key(
    sessions: sessionmaker[Session], tenant: str, *, name: str = "", role: str = "tenant", rpm: int | None = None
) -> tuple[KeyInfo, str]:
    """Store a new key; returns its info and the key itself (the only time it exists in clear)."""
    check_tenant(tenant)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if rpm is not None and rpm < 0:
        raise ValueError("rpm must be >= 0 (0: unlimited)")
    if len(name) > 128:
        raise ValueError("name is longer than 128 characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"name must not contain control characters: {name[:40]!r}")
    from flywheel.db.models import ApiKey

    key_id, key = new_key()
    row = ApiKey(
        key_id=key_id,
        tenant=tenant,
        role=role,
        key_sha256=key_hash(key),
        name=name,
        created_at=datetime.now(UTC),
        revoked_at=None,
        rate_limit_rpm=rpm,
    )
    with sessions() as session:
        session.add(row)
        session.commit()
        return KeyInfo.of(row), key


def list_keys(sessions: sessionmaker[Session], tenant: str | None = None) -> list[KeyInfo]:
    if tenant is not None:
        check_tenant(tenant)
    from sqlalchemy import select

    from flywheel.db.models import ApiKey

    stmt = select(ApiKey).order_by(ApiKey.tenant, ApiKey.created_at, ApiKey.key_id)
    if tenant is not None:
        stmt = stmt.where(ApiKey.tenant == tenant)
    with sessions() as session:
        return [KeyInfo.of(row) for row in session.scalars(stmt)]


def revoke_key(sessions: sessionmaker[Session], key_id: str) -> KeyInfo | None:
    """Revoke a key (a no-op if it already is); None if there is no such key."""
    from flywheel.db.models import ApiKey

    with sessions() as session:
        row = session.get(ApiKey, key_id)
        if row is None:
            return None
        if row.revoked_at is None:
            row.revoked_at = datetime.now(UTC)
            session.commit()
        return KeyInfo.of(row)


def find_key(sessions: sessionmaker[Session], key: str) -> KeyInfo | None:
    """The live (unrevoked) key matching ``key`` exactly; None for malformed, unknown, forged or revoked."""
    from flywheel.db.models import ApiKey

    key_id = key_id_of(key)
    if key_id is None:
        return None
    with sessions() as session:
        row = session.get(ApiKey, key_id)
        if row is None or not hmac.compare_digest(row.key_sha256, key_hash(key)) or row.revoked_at is not None:
            return None
        return KeyInfo.of(row)


# Command line ----------------------------------------------------------------------------------


def add_keys_commands(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="gateway API keys: create, list, revoke")
    sub = keys.add_subparsers(dest="keys_command", required=True)

    create = sub.add_parser("create", help="create a key; prints it once (stdout), details on stderr")
    create.add_argument("--tenant", required=True, help="the tenant the key acts for")
    create.add_argument("--name", default="", help="a label to recognise the key by")
    create.add_argument("--rpm", type=int, help="requests per minute for this key (default: gateway.rate_limit_rpm)")
    create.add_argument("--admin", action="store_true", help="an admin key: reaches the admin routes")
    create.add_argument("--json", action="store_true", help="print the key and its details as JSON")

    lst = sub.add_parser("list", help="list keys (never their secrets)")
    lst.add_argument("--tenant", type=_tenant_arg, help="only this tenant's keys")
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")

    revoke = sub.add_parser("revoke", help="revoke a key by its key_id (gateways refuse it within key_cache_s)")
    revoke.add_argument("key_id", type=_key_id_arg)


def _tenant_arg(text: str) -> str:
    try:
        return check_tenant(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _key_id_arg(text: str) -> str:
    """A key id as listings show it (12 hex digits); a whole key is accepted and named by its id."""
    key_id = key_id_of(text) or text
    if not re.fullmatch(rf"[0-9a-f]{{{KEY_ID_HEX}}}", key_id):
        raise argparse.ArgumentTypeError(f"invalid key id {text[:40]!r}: {KEY_ID_HEX} hex digits, as `flywheel keys "
                                         "list` shows them")
    return key_id


def run_keys_command(args: argparse.Namespace, settings: Any) -> int:
    from flywheel.db.session import make_session_factory, open_database

    engine = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(engine)
    try:
        if args.keys_command == "create":
            return _create(args, sessions)
        if args.keys_command == "list":
            return _list(args, sessions)
        if args.keys_command == "revoke":
            return _revoke(args, sessions, settings.gateway.key_cache_s)
        raise AssertionError(f"unhandled keys command {args.keys_command}")
    finally:
        engine.dispose()


def _create(args: argparse.Namespace, sessions: sessionmaker[Session]) -> int:
    try:
        info, key = create_key(
            sessions, args.tenant, name=args.name, role="admin" if args.admin else "tenant", rpm=args.rpm
        )
    except ValueError as exc:
        print(f"flywheel keys: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**info.as_json(), "key": key}))
    else:
        print(key)
    rpm = "default" if info.rate_limit_rpm is None else info.rate_limit_rpm
    print(
        f"created {info.role} key {info.key_id} for tenant {info.tenant} (rpm {rpm}); "
        "the key is shown only this once: store it now",
        file=sys.stderr,
    )
    return 0


def _list(args: argparse.Namespace, sessions: sessionmaker[Session]) -> int:
    keys = list_keys(sessions, args.tenant)
    if args.json:
        print(json.dumps([k.as_json() for k in keys]))
        return 0
    rows = [("KEY_ID", "TENANT", "ROLE", "RPM", "CREATED", "REVOKED", "NAME")]
    for k in keys:
        rows.append((
            k.key_id,
            k.tenant,
            k.role,
            "default" if k.rate_limit_rpm is None else str(k.rate_limit_rpm),
            k.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-",
            k.name,
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _revoke(args: argparse.Namespace, sessions: sessionmaker[Session], cache_s: float) -> int:
    info = revoke_key(sessions, args.key_id)
    if info is None:
        print(f"flywheel keys: no key {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked {info.key_id} (tenant {info.tenant}); gateways refuse it within {cache_s:g}s (key_cache_s)")
    return 0
