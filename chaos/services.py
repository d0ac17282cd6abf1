"""The run's private services: one PostgreSQL cluster, one Redis and one Tansu broker of its own.

Each is a child process of the run on a port of its own (:mod:`testbed`; PostgreSQL through
``pg_ctl``), so a fault stops, kills, freezes or restarts the real thing. :class:`Services` owns
them for the whole run; each scenario gets a fresh database, topic prefix and Redis key prefix on
them. A missing tool raises :class:`testbed.procs.ServiceUnavailable` saying how to get it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from testbed.broker import TansuBroker
from testbed.postgres import PrivatePostgres
from testbed.procs import free_port
from testbed.redis import RedisServer

log = logging.getLogger("flywheel.chaos")


class Services:
    """The run's private PostgreSQL, Redis and Tansu broker. The broker's storage is in memory (as
    the test suite runs it), so a broker outage is a freeze, never a restart (:mod:`testbed.broker`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.postgres = PrivatePostgres()
        self.redis = RedisServer(root, new_session=True)
        self.broker = TansuBroker(free_port(), root / "tansu.log", new_session=True)

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def start(self) -> None:
        self.postgres.start()
        self.redis.start()
        self.broker.start(timeout_s=60.0)

    def close(self, keep: bool = False) -> None:
        self.broker.thaw()
        for service in (self.broker, self.redis):
            try:
                service.stop()
            except Exception as exc:
                log.warning("stopping %s: %s", service.name, exc)
        self.postgres.close(keep)
