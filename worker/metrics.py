"""Prometheus metrics of one worker rank, on a registry of its own. Names are ``bitps_worker_*``
with unit suffixes; the README lists them all."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["WorkerMetrics"]

_LATENCY = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STEP = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    """Every metric a worker exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.push_bytes = Counter("bitps_worker_push_bytes_total", "Gradient bytes pushed",
                                  registry=r)
        self.pull_bytes = Counter("bitps_worker_pull_bytes_total", "Parameter bytes pulled",
                                  registry=r)
        self.push_latency = Histogram("bitps_worker_push_latency_seconds",
                                      "Push message sent to acknowledged",
                                      buckets=_LATENCY, registry=r)
        self.pull_latency = Histogram("bitps_worker_pull_latency_seconds",
                                      "Pull (or push_pull) message sent to parameters received",
                                      buckets=_LATENCY, registry=r)
        self.step_time = Histogram("bitps_worker_step_seconds",
                                   "Wall time of one training step, communication included",
                                   buckets=_STEP, registry=r)
        self.samples_per_s = Gauge("bitps_worker_samples_per_second",
                                   "Training samples per second of this rank (last step)",
                                   registry=r)
        self.clock = Gauge("bitps_worker_clock_steps", "Steps this rank has completed",
                           registry=r)
        self.min_clock = Gauge("bitps_worker_min_clock_steps",
                               "Smallest live clock the shards last reported", registry=r)
        self.loss = Gauge("bitps_worker_loss", "Training loss of the last step", registry=r)
