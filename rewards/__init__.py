"""rewards: pure reward builders (``builders``) and the worker that applies them (``rewards.worker:run``)."""
