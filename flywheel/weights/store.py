"""Object store for weight blobs: a small interface, a local folder and any S3-compatible bucket.

Invariants:
- Keys are relative, ``/``-separated, made of ``[A-Za-z0-9._-]`` segments that do not start with a
  dot (so no ``.``/``..`` segments and no hidden temp names); anything else raises
  :class:`InvalidKey` before the filesystem is touched.
- A folder key always resolves (symlinks followed) to a path strictly under the store root.
- An S3 key is ``prefix + key`` with ``key`` validated as above, so no key reaches outside the
  store's prefix (S3 does not resolve ``..``, but some S3-compatible servers and proxies do).
- ``put`` is atomic: a reader sees either the old object, the new one, or none, never a partial
  one (folder: write a temp file in the same directory, fsync, ``os.replace``, fsync the directory;
  S3: a single PUT is atomic, and its ``Content-MD5`` makes the server refuse a body damaged on the
  way). ``get`` checks the length it received against the object's; ``get_range`` returns exactly
  the bytes asked for, or raises (a range past the object's end included).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flywheel.settings import Settings

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_MAX_KEY = 1024
_TMP_PREFIX = ".tmp-"
# A regional cache's ledger of pulls (a dot name: never an object key, never listed).
_LEDGER = ".pulled"
# A regional cache pulls a big object from the origin in ranges of this many bytes.
PULL_CHUNK = 64 << 20
# Linux reads at most about this many bytes in one call.
_IO_CHUNK = 1 << 30


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

    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    def size(self, key: str) -> int: ...

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
        self.put_chunks(key, (data,))

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        """:meth:`put` of the concatenated ``chunks``, written as they come (an object bigger than
        memory); returns its size."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path = self._path(key)  # a directory created above may not be redirected by a symlink
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
        size = 0
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
                    size += len(chunk)
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
        return size

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"no object {key!r} in {self}") from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object from ``offset``; a range past its end is a :class:`StoreError`."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"no object {key!r} in {self}") from None
        try:
            out = bytearray()
            while len(out) < length:
                got = os.pread(fd, min(_IO_CHUNK, length - len(out)), offset + len(out))
                if not got:
                    raise StoreError(f"get {key!r} bytes {offset}+{length} in {self}: the object ends at "
                                     f"{offset + len(out)}")
                out += got
            return bytes(out)
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except (FileNotFoundError, NotADirectoryError):
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


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is empty or a valid key followed by ``/``, else raise :class:`InvalidKey`."""
    if prefix:
        if not prefix.endswith("/"):
            raise InvalidKey(f"invalid store prefix {prefix!r}: empty, or a valid key ending in '/'")
        validate_key(prefix[:-1])
    return prefix


def _listing_prefix(prefix: str) -> str:
    """A ``list`` prefix: whole valid segments, the last one possibly partial (or empty)."""
    head, _, last = prefix.rpartition("/")
    if head:
        validate_key(head)
    if last and not _SEGMENT.fullmatch(last):
        raise InvalidKey(f"invalid listing prefix {prefix!r}")
    return prefix


class S3Store:
    """Objects in an S3-compatible bucket (AWS S3, MinIO, Ceph, R2, ...) under ``prefix``, via boto3.

    Credentials come from boto3's usual chain (environment, shared files, instance roles), never
    from flywheel's settings. ``client`` is for tests and custom sessions."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, region: str | None = None,
                 client: object | None = None) -> None:
        if not bucket:
            raise StoreError("store.bucket is required for the S3 store")
        self.bucket = bucket
        self.prefix = validate_prefix(prefix)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None,
                                  config=Config(retries={"max_attempts": 5, "mode": "standard"},
                                                connect_timeout=10, read_timeout=60))
        self._client: Any = client

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix})"

    def _key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _call(self, what: str, key: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(f"no object {key!r} in {self}") from None
            raise StoreError(f"{what} {key!r} in {self}: {code or exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"{what} {key!r} in {self}: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        self._call("put", key, self._client.put_object, Key=self._key(key), Body=data, ContentMD5=md5)

    def get(self, key: str) -> bytes:
        response = self._call("get", key, self._client.get_object, Key=self._key(key))
        data = response["Body"].read()
        if len(data) != response.get("ContentLength", len(data)):
            raise StoreError(f"get {key!r} in {self}: {len(data)} of {response['ContentLength']} bytes received")
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object from ``offset`` (one ranged GET); a range past its end is a
        :class:`StoreError`."""
        if length == 0:
            return b""
        response = self._call("get", key, self._client.get_object, Key=self._key(key),
                              Range=f"bytes={offset}-{offset + length - 1}")
        data = response["Body"].read()
        if len(data) != length:
            raise StoreError(f"get {key!r} bytes {offset}+{length} in {self}: {len(data)} bytes received")
        return data

    def size(self, key: str) -> int:
        return int(self._call("head", key, self._client.head_object, Key=self._key(key))["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self._call("head", key, self._client.head_object, Key=self._key(key))
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing object is not an error."""
        self._call("delete", key, self._client.delete_object, Key=self._key(key))

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix`` (a plain string prefix)."""
        full = self.prefix + _listing_prefix(prefix)
        keys = []
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        try:
            for page in pages:
                keys.extend(item["Key"][len(self.prefix):] for item in page.get("Contents", ()))
        except Exception as exc:  # botocore errors surface while iterating
            raise StoreError(f"list {prefix!r} in {self}: {exc}") from exc
        return sorted(k for k in keys if _valid(k))


def _valid(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKey:
        return False
    return True


class RegionalCache:
    """Reads through a region's cache: the first reader in a region pulls an object from the origin
    and writes it into the cache folder the region's nodes share; every later read there is local.

    Weight objects never change once published (every key carries a random token), so a cached
    object is never stale and each object crosses into a region once: readers take a per-key file
    lock in the cache (``.locks/``) and look again before pulling, so concurrent nodes of one region
    wait for one pull instead of each pulling. Writes and deletes go to the origin (deletes also
    drop the cached copy). Whatever comes out is still checked by the registry against its sha256.
    ``pulled_bytes`` counts what this process pulled from the origin; every pull of the region (any
    process) is also appended to a ledger in the cache folder (``.pulled``: one ``key<TAB>bytes``
    line each, a single append), which :meth:`pulled` sums per key. ``region`` names the region in
    reports (default: the cache folder's name)."""

    def __init__(self, origin: Store, cache: FolderStore, region: str = "") -> None:
        self.origin = origin
        self.cache = cache
        self.region = region or Path(cache.root).name
        self.pulled_bytes = 0

    def __repr__(self) -> str:
        return f"RegionalCache({self.origin!r} via {self.cache!r})"

    def get(self, key: str) -> bytes:
        try:
            return self.cache.get(key)
        except ObjectNotFound:
            pass
        pulled: list[bytes] = []

        def pull() -> int:
            pulled.append(self.origin.get(key))
            self.cache.put(key, pulled[0])
            return len(pulled[0])

        self._pull(key, pull)
        return pulled[0] if pulled else self.cache.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """A range of the cached object; an object not cached yet is pulled whole first, in ranges
        of :data:`PULL_CHUNK` (never held whole)."""
        if not self.cache.exists(key):
            def pull() -> int:
                size = self.origin.size(key)
                return self.cache.put_chunks(key, (self.origin.get_range(key, at, min(PULL_CHUNK, size - at))
                                                   for at in range(0, size, PULL_CHUNK)))

            self._pull(key, pull)
        return self.cache.get_range(key, offset, length)

    def size(self, key: str) -> int:
        return self.cache.size(key) if self.cache.exists(key) else self.origin.size(key)

    def _pull(self, key: str, pull: Callable[[], int]) -> None:
        """Run ``pull`` (origin to cache; returns the bytes pulled) under the key's region-wide
        lock, unless another node of the region cached the object meanwhile; then log it."""
        import fcntl

        locks = Path(os.path.realpath(self.cache.root)) / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / hashlib.sha256(validate_key(key).encode()).hexdigest(), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.cache.exists(key):  # another node of the region pulled it meanwhile
                return
            size = pull()
            self.pulled_bytes += size
            fd = os.open(locks.parent / _LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{key}\t{size}\n".encode())
            finally:
                os.close(fd)

    def pulled(self) -> dict[str, int]:
        """Bytes the region's cache pulled from the origin, per key, as its ledger records them (a
        key pulled again after its cached copy was deleted counts twice)."""
        try:
            text = (Path(os.path.realpath(self.cache.root)) / _LEDGER).read_text()
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for line in text.splitlines():
            key, _, size = line.partition("\t")
            if size.isdigit():  # a malformed line (a crash mid-append) is skipped
                out[key] = out.get(key, 0) + int(size)
        return out

    def put(self, key: str, data: bytes) -> None:
        self.origin.put(key, data)

    def exists(self, key: str) -> bool:
        return self.cache.exists(key) or self.origin.exists(key)

    def delete(self, key: str) -> None:
        self.origin.delete(key)
        self.cache.delete(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.origin.list(prefix)


def make_store(settings: Settings) -> Store:
    """The store that ``settings.store`` names, read through ``store.cache_path`` when set."""
    cfg = settings.store
    origin: Store
    if cfg.kind == "folder":
        origin = FolderStore(settings.store_path)
    elif cfg.kind == "s3":
        origin = S3Store(cfg.bucket, cfg.prefix, endpoint_url=cfg.endpoint_url, region=cfg.region)
    else:
        raise ValueError(f"unknown store kind {cfg.kind!r}")
    return RegionalCache(origin, FolderStore(cfg.cache_path), settings.node.region) if cfg.cache_path else origin
