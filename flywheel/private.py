"""Private data stays private on disk: what flywheel writes is its owner's alone.

Under ``data_dir`` live the gateway's spool and the local bus log (prompts and completions), the
SQLite database (feedback, API key hashes), weights, checkpoints, heartbeats, and the effective
settings ``flywheel up`` hands its children (passwords included). All of it is created with folders
``0700`` and files ``0600``, whatever umask the process was started with (docs/security.md).

Two steps, both taken by a process's entry point (``launch.cli.main``) before anything is created:

- :func:`private_umask` sets the umask to ``077``. Only a umask reaches every file the process and
  its libraries create: SQLite's ``-wal`` and ``-shm`` files, torch checkpoints, the bus log's
  explicit ``0644`` opens. Child processes (``flywheel up``'s roles) inherit it.
- :func:`make_private` makes the data directory itself ``0700``: created so when asked to (``flywheel
  up`` prepares it before any role starts), and tightened when it already exists (made by hand or
  by an earlier version), which also puts what an earlier run left in it out of other users' reach.

Invariants: nothing here loosens a mode; a folder is chmod-ed only when it belongs to the running
user and is not a shared sticky folder such as ``/tmp`` (:func:`chmod_refusal`); one that cannot be
made private is reported in a warning naming the command that fixes it, never silently left.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

#: The umask every flywheel process runs under: no group or other bits on anything it creates.
UMASK = 0o077
#: The data directory's mode.
DIR_MODE = 0o700


def private_umask() -> int:
    """Set the process umask to :data:`UMASK`; returns the one it replaces."""
    return os.umask(UMASK)


def chmod_refusal(mode: int, owner: int, user: int) -> str | None:
    """Why a folder with ``st_mode`` ``mode`` owned by uid ``owner`` must not be chmod-ed to
    :data:`DIR_MODE` by uid ``user``, or None when it may."""
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != user:
        return f"it belongs to uid {owner}, not to this user (uid {user})"
    if mode & stat.S_ISVTX:
        return "it is a shared sticky folder (like /tmp); point data_dir at a folder of its own"
    return None


def make_private(path: Path, *, create: bool = False) -> bool:
    """Make the folder ``path`` :data:`DIR_MODE` (creating it and its parents first when ``create``);
    True when it is private now, False when it does not exist or cannot be made private (warned)."""
    if create:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    current = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode) and (current & 0o077) == 0:
        return True
    refusal = chmod_refusal(info.st_mode, info.st_uid, os.geteuid())
    if refusal is not None:
        log.warning("data_dir %s is readable by other users (mode %04o) and flywheel leaves it so: %s; "
                    "run `chmod 700 %s` as its owner", path, current, refusal, path)
        return False
    os.chmod(path, DIR_MODE)
    log.info("data_dir %s made private (mode %04o, was %04o)", path, DIR_MODE, current)
    return True
