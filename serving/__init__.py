"""Serving stage: gateway (capture + feedback), built-in node, rollout controller. Imports only ``flywheel``."""
