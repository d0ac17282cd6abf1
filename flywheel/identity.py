"""End users' identity: the id a client gives its end user, turned into a keyed hash before anything stores it.

A client names the person behind a request with OpenAI's ``user`` body field or the
``X-Flywheel-User`` header (:data:`USER_HEADER`). Flywheel never keeps that raw id: the
gateway replaces it with :func:`user_hash` before the request reaches the upstream, the spool, the
bus or the database, and the generation event carries the hash (``GenerationEvent.user_hash``, the
``generations.user_hash`` column) so that a user's rows can be found, and erased, by their id.

Invariants:
- The hash is HMAC-SHA256 keyed with the deployment's secret over ``tenant NUL user``, as 64 hex
  digits. The same id of the same tenant hashes the same on every request and every gateway that
  shares the secret; two tenants' "alice" are two people; without the secret nobody (an operator
  reading the database included) can test a guessed id, e-mail addresses included, against a hash.
- Ids are compared exactly: no case folding, no trimming. An empty id means no id.
- The secret is ``gateway.user_id_secret`` (at least 32 characters, shown only as ``***``), else the
  file ``{data_dir}/user_id_secret`` (:data:`SECRET_FILE`), made once with 256 random bits, mode
  ``0600`` in the ``0700`` data directory (``flywheel.private``), and read on every later start.
  Several gateways of one deployment on different machines must share one secret: set the setting.
- Changing the secret changes every hash: rows stored before are no longer found by their user's
  id. A secret file that is there but unreadable or too short stops the gateway; it is never
  silently replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

#: The request header that names the end user (as OpenAI's ``user`` body field does).
USER_HEADER = "X-Flywheel-User"
#: The longest end-user id a request may name: the same on completions and the data routes, so an
#: id the gateway took can always be exported and erased by it.
MAX_USER_CHARS = 1024
#: The generated secret's file name under ``data_dir``.
SECRET_FILE = "user_id_secret"
#: The fewest characters a secret may have (the generated one has 64 hex digits: 256 bits).
MIN_SECRET_CHARS = 32
#: What a hash looks like (``GenerationEvent.user_hash``).
HASH_PATTERN = r"^[0-9a-f]{64}$"


class SecretError(Exception):
    """The user-id secret cannot be read or made."""


def user_hash(secret: str, tenant: str, user: str) -> str:
    """The stored form of end user ``user`` of ``tenant``: HMAC-SHA256 keyed with ``secret``, hex.
    A tenant name holds no NUL (``flywheel.events.Ident``), so ``tenant NUL user`` is unambiguous."""
    return hmac.new(secret.encode("utf-8"), f"{tenant}\x00{user}".encode(), hashlib.sha256).hexdigest()


def load_secret(setting: str, data_dir: Path) -> str:
    """The deployment's user-id secret: ``setting`` when set, else the data directory's secret file,
    made on first use (module docstring). Raises :class:`SecretError` with the reason and the fix."""
    if setting:
        if len(setting) < MIN_SECRET_CHARS:  # settings validation refuses it first; a direct caller too
            raise SecretError(f"gateway.user_id_secret has {len(setting)} characters; use at least {MIN_SECRET_CHARS}")
        return setting
    path = data_dir / SECRET_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = _create(path)
    secret = _read(path)  # another process may have made it first: theirs is the deployment's
    if made:
        log.warning("made a new user-id secret in %s: end users' ids are stored as keyed hashes under it. Gateways "
                    "on other machines must share it (set gateway.user_id_secret), and losing it makes stored "
                    "hashes unfindable by user id", path)
    return secret


def _read(path: Path) -> str:
    try:
        secret = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise SecretError(f"cannot read the user-id secret {path}: {exc}; restore it (a new secret would change "
                          "every stored user hash) or set gateway.user_id_secret") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"the user-id secret {path} holds {len(secret)} characters, fewer than {MIN_SECRET_CHARS}: "
                          "it is damaged; restore it (a new secret would change every stored user hash), or delete "
                          "it to start over with a new one")
    return secret


def _create(path: Path) -> bool:
    """Write a fresh secret to ``path`` whole (a temporary file linked into place); False when
    ``path`` already exists (another process made it first)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_hex(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        with contextlib.suppress(OSError):  # the folder entry, so the secret outlives a host crash
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return True
    finally:
        temp.unlink(missing_ok=True)


class EndUserError(ValueError):
    """A request's end user cannot be taken: ``code`` is the gateway's error code for it."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def end_user(body_user: object, header_user: str | None) -> str | None:
    """The raw end-user id a request names: its ``user`` body field or its user header, or None.

    Raises :class:`EndUserError` (the gateway's 400 naming ``user``) when the body's ``user`` is not
    a string or either id is longer than :data:`MAX_USER_CHARS` (``invalid_user``), or when both
    are given and differ (``user_conflict``): attributing the request to either one silently would
    file a person's data under someone else, where erasing by their id would miss it."""
    if body_user is not None and not isinstance(body_user, str):
        raise EndUserError("user must be a string: the id of the end user the request is for", "invalid_user")
    body = body_user or None
    header = header_user or None
    if any(user is not None and len(user) > MAX_USER_CHARS for user in (body, header)):
        raise EndUserError(f"an end user's id has at most {MAX_USER_CHARS} characters", "invalid_user")
    if body is not None and header is not None and body != header:
        raise EndUserError("the user body field and the X-Flywheel-User header name different end users; "
                           "send one of them, or the same id in both", "user_conflict")
    return body if body is not None else header
