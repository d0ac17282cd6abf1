"""ingest: generations + feedback from the bus -> persisted raw events -> multi-turn trajectories.

``assemble`` is the pure core (turns -> token segments), ``store`` the data access, ``worker`` the
consumer loop (``ingest.worker:run``).
"""
