"""Prometheus metrics of one shard, on a registry of its own (several shards can share a process
in tests). Names are ``bitps_*`` with unit suffixes; the README lists them all."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ShardMetrics"]

_LATENCY = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
_GAP = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class ShardMetrics:
    """Every metric a shard exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.push_bytes = Counter("bitps_push_bytes_total", "Gradient payload bytes received",
                                  registry=r)
        self.pull_bytes = Counter("bitps_pull_bytes_total", "Parameter payload bytes sent",
                                  registry=r)
        self.push_latency = Histogram("bitps_push_latency_seconds",
                                      "Time to validate and apply one push message",
                                      buckets=_LATENCY, registry=r)
        self.pull_latency = Histogram("bitps_pull_latency_seconds",
                                      "Pull arrival to reply, holding time included",
                                      buckets=_LATENCY, registry=r)
        self.pull_wait = Histogram("bitps_pull_wait_seconds",
                                   "Time a pull was held by the consistency policy",
                                   buckets=_LATENCY, registry=r)
        self.clock_gap = Histogram("bitps_staleness_clock_gap_steps",
                                   "Per applied push: pusher's clock minus the shard's min clock",
                                   buckets=_GAP, registry=r)
        self.version_gap = Histogram("bitps_staleness_version_gap_updates",
                                     "Per applied push: key version at apply minus the version "
                                     "the gradient was computed from", buckets=_GAP, registry=r)
        self.admission_gap = Histogram("bitps_admission_clock_gap_steps",
                                       "Per admitted pull: requested clock minus min live clock",
                                       buckets=_GAP, registry=r)
        self.updates = Counter("bitps_updates_applied_total", "Optimizer updates applied to keys",
                               registry=r)
        self.requests = Counter("bitps_requests_total", "Data-plane requests by op", ["op"],
                                registry=r)
        self.errors = Counter("bitps_errors_total", "Error replies by code", ["code"], registry=r)
        self.worker_clock = Gauge("bitps_worker_clock_steps", "Steps completed, per worker",
                                  ["worker"], registry=r)
        self.min_clock = Gauge("bitps_min_clock_steps", "Smallest clock over live workers",
                               registry=r)
        self.live_workers = Gauge("bitps_live_workers", "Workers counted as live", registry=r)
        self.pending_pulls = Gauge("bitps_pending_pulls", "Pulls held by the consistency policy",
                                   registry=r)
