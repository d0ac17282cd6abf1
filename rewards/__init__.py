"""rewards: the reward spec (``spec``), pure builders (``builders``, ``judge``), credit rules (``credit``),
guards (``guards``), normalisation (``normalise``), the scorer that composes them (``scorer``), and the
thin IO around them: the worker (``rewards.worker:run``), ``store``, and rescore/report (``rescore``)."""
