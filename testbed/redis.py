"""Redis to run against: the shared server on 127.0.0.1:6379 (checked, and cleaned key prefix by
key prefix), or :class:`RedisServer`, a server of our own on a port of its own, without
persistence, that a test or a fault can kill and start again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from testbed.procs import ChildService, ServiceUnavailable, free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
CONNECT_TIMEOUT_S = 3
REDIS_START = 'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no'


def require_redis(url: str = REDIS_URL) -> str:
    """``url`` once the server there answers a PING; raises :class:`ServiceUnavailable` saying how
    to start it otherwise."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"Redis is not reachable at {url} ({exc}).\nStart it with: {REDIS_START}") from None
    finally:
        client.close()
    return url


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix``."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def redis_answers(port: int) -> bool:
    """True once the server on ``port`` answers a PING (raises while it does not)."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    finally:
        client.close()


class RedisServer(ChildService):
    """``redis-server`` on ``port`` (a free one by default), bound to 127.0.0.1, nothing saved; its
    working folder and log under ``folder``."""

    def __init__(self, folder: Path, port: int | None = None, *, new_session: bool = False) -> None:
        port = port or free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
               str(folder)]
        super().__init__("redis", cmd, port, folder / "redis.log", new_session=new_session)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 60.0) -> RedisServer:
        self.start_process(lambda: redis_answers(self.port), timeout_s)
        return self
