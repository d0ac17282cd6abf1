"""The gateway's Prometheus metrics, in one registry that ``GET /metrics`` exposes.

Built once by the app factory (the middleware counts rejected requests before the lifespan opens
anything) and handed to the serving classes, which count what they do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    """The counters and histograms of one gateway; the capture registers its own in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.generations = Counter("flywheel_generations_captured", "Generations accepted by the capture spool",
                                   ["model_version"], registry=registry)
        self.feedback = Counter("flywheel_feedback_captured", "Feedback events accepted by the capture spool",
                                registry=registry)
        self.rejected = Counter("flywheel_gateway_rejected", "Requests answered with an error", ["status"],
                                registry=registry)
        self.added = Histogram("flywheel_gateway_added_seconds",
                               "Time a completion spent in the gateway itself (total minus upstream)",
                               ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.upstream = Histogram("flywheel_upstream_seconds", "Upstream completion time (whole stream for streams)",
                                  ["model_version"], buckets=LATENCY_BUCKETS, registry=registry)
        self.stream_errors = Counter("flywheel_stream_errors", "Streams that ended with an error event (nothing recorded)",
                                     registry=registry)
        self.data_use = Counter("flywheel_gateway_data_use",
                                "Completion and feedback requests served, by the data use that applied (flywheel.consent)",
                                ["route", "data_use"], registry=registry)
        self.unstored = Counter("flywheel_gateway_unstored",
                                "Generations and feedback items served or accepted but never recorded (data use none)",
                                ["kind"], registry=registry)
        self.repinned = Counter("flywheel_sessions_repinned",
                                "Sessions moved to another version because no node held theirs any more",
                                registry=registry)
