"""Object store for weight blobs: a small interface, a local-folder implementation, a factory.

Invariants:
- Keys are relative, ``/``-separated, made of ``[A-Za-z0-9._-]`` segments that do not start with a
  dot (so no ``.``/``..`` segments and no hidden temp names); anything else raises
  :class:`InvalidKey` before the filesystem is touched.
- A folder key always resolves (symlinks followed) to a path strictly under the store root.
- ``put`` is atomic: a reader sees either the old object, the new one, or none, never a partial
  one (write a temp file in the same directory, fsync, ``os.replace``, fsync the directory).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flywheel.settings import Settings

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_MAX_KEY = 1024
_TMP_PREFIX = ".tmp-"


class StoreError(Exception):
    """A store operation failed."""


class InvalidKey(StoreError, ValueError):
    """A key is not a safe relative object name."""


class ObjectNotFound(StoreError, KeyError):
    """No object under that key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "object not found"


@runtime_checkable
class Store(Protocol):
    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str = "") -> list[str]: ...


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object name, else raise :class:`InvalidKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("object key must be a non-empty string")
    if len(key) > _MAX_KEY:
        raise InvalidKey(f"object key longer than {_MAX_KEY} characters")
    for segment in key.split("/"):
        if not _SEGMENT.fullmatch(segment):
            raise InvalidKey(
                f"invalid object key {key!r}: segments must match [A-Za-z0-9_-][A-Za-z0-9._-]* "
                "(relative, no '..', no backslashes, no leading dots or slashes)"
            )
    return key


class FolderStore:
    """Objects as files under ``root`` (created on first use)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"FolderStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        validate_key(key)
        root = os.path.realpath(self.root)
        path = os.path.realpath(os.path.join(root, key))
        if not path.startswith(root + os.sep):
            raise InvalidKey(f"object key {key!r} resolves outside the store root")
        return Path(path)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path = self._path(key)  # a directory created above may not be redirected by a symlink
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"no object {key!r} in {self}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing object is not an error."""
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a plain string prefix)."""
        root = os.path.realpath(self.root)
        if not os.path.isdir(root):
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, root)
            for filename in filenames:
                if filename.startswith("."):
                    continue
                key = filename if rel == "." else f"{rel.replace(os.sep, '/')}/{filename}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


def make_store(settings: Settings) -> Store:
    """The store that ``settings.store`` names."""
    kind = settings.store.kind
    if kind == "folder":
        return FolderStore(settings.store_path)
    if kind == "s3":
        raise NotImplementedError(
            "the S3 store is not available yet (boto3 is not installed); use store.kind = 'folder'"
        )
    raise ValueError(f"unknown store kind {kind!r}")
