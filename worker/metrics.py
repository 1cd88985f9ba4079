"""Prometheus metrics of one worker rank, on a registry of its own. Names are ``bitps_worker_*``
with unit suffixes; docs/metrics.md lists them all. Hot-path primitives
(:mod:`bitps.proto.metrics`): writers hold :attr:`WorkerMetrics.lock`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bitps.proto.metrics import MetricSet, labeled_gauge

__all__ = ["CodecSnapshot", "WorkerMetrics"]

_LATENCY = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STEP = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    """Every metric a worker exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = self.set = MetricSet()
        self.lock = m.lock
        self.push_bytes = m.counter("bitps_worker_push_bytes_total",
                                    "Float32 gradient bytes pushed (before any codec)")
        self.push_wire_bytes = m.counter("bitps_worker_push_wire_bytes_total",
                                         "Payload bytes pushes sent (after codecs)")
        self.pull_bytes = m.counter("bitps_worker_pull_bytes_total",
                                    "Payload bytes pulls received (float32 parameters, or the "
                                    "codes of compressed pulls)")
        self.push_latency = m.histogram("bitps_worker_push_latency_seconds",
                                        "Push message sent to acknowledged", _LATENCY)
        self.pull_latency = m.histogram("bitps_worker_pull_latency_seconds",
                                        "Pull (or push_pull) message sent to parameters received",
                                        _LATENCY)
        self.step_time = m.histogram("bitps_worker_step_seconds",
                                     "Wall time of one training step, communication included",
                                     _STEP)
        self.samples_per_s = m.gauge("bitps_worker_samples_per_second",
                                     "Training samples per second of this rank (last step)")
        self.batch_share = m.gauge("bitps_worker_batch_share_samples",
                                   "This rank's samples of the global batch in its current step "
                                   "(BatchBalance)")
        self.compute_speed = m.gauge("bitps_worker_compute_samples_per_second",
                                     "Samples per second of this rank's compute, as "
                                     "BatchBalance measures and reports it")
        self.clock = m.gauge("bitps_worker_clock_steps", "Steps this rank has completed")
        self.min_clock = m.gauge("bitps_worker_min_clock_steps",
                                 "Smallest live clock the shards last reported")
        self.loss = m.gauge("bitps_worker_loss", "Training loss of the last step")
        self.codec_raw_bytes = m.labeled_counter(
            "bitps_worker_codec_raw_bytes_total",
            "Float32 gradient bytes handed to the push codec, by codec", "codec")
        self.codec_wire_bytes = m.labeled_counter(
            "bitps_worker_codec_wire_bytes_total",
            "Bytes the push codec sent for them, by codec (ratio = raw / wire)", "codec")
        self.nonfinite = m.counter(
            "bitps_worker_nonfinite_pushes_total",
            "Pushes refused on this worker (NON_FINITE) because a gradient held NaN or Inf "
            "where error feedback or 1-bit Adam moments would have kept it; nothing was sent")
        self.compute_utilization = m.gauge(
            "bitps_worker_compute_utilization_ratio",
            "Last step: (wall time - exposed communication) / wall time")
        self.exposed_comm = m.histogram(
            "bitps_worker_exposed_comm_seconds",
            "Per step: time the training thread waited for communication", _STEP)
        self.comm_time = m.histogram(
            "bitps_worker_comm_seconds",
            "Per step: time during which communication was under way, hidden or not", _STEP)
        self.overlap_ratio = m.gauge(
            "bitps_worker_overlap_ratio",
            "Last step: share of communication time hidden behind compute (1 - exposed/comm)")
        self.inflight_bytes = m.gauge("bitps_worker_inflight_bytes",
                                      "Gradient bytes of buckets in flight (overlap on)")
        self.overlap_enabled = m.gauge("bitps_worker_overlap_enabled",
                                       "1 when gradients are pushed from backward hooks")
        self.held_steps = m.counter(
            "bitps_worker_overlap_held_steps_total",
            "Steps overlap on held for their exact clip factor (the last step clipped): "
            "pushed whole by step(), not from backward hooks")
        self.comm_compute_ratio = m.gauge(
            "bitps_worker_comm_compute_ratio",
            "Communication time / compute time as measured to decide on overlap")
        self.recoveries = m.counter(
            "bitps_worker_shard_recoveries_total",
            "Times this worker re-registered with a lost shard (it timed out, or restarted)")
        self.shard_restarts = m.counter(
            "bitps_worker_shard_restarts_total",
            "Shard restarts a heartbeat noticed (another incarnation than the shard's "
            "registration answered); the worker re-registers before its next request there")
        self.lost_steps = m.counter(
            "bitps_worker_lost_steps_total",
            "Steps of a shard's updates lost because it came back from an older checkpoint "
            "than this worker's clock, summed over recoveries (the worker adopts its clock)")
        self.registry.register(m)

    def watch_codecs(self, snapshot: Callable[[], CodecSnapshot]) -> None:
        """Export, read at scrape time from ``snapshot``: the push compression ratio, the
        error-feedback residual norm per shard, and the push policy's own metrics."""
        self.registry.register(_CodecCollector(self, snapshot))


@dataclass(frozen=True)
class CodecSnapshot:
    """What the codec gauges show."""

    residual_norms: dict[int, float]
    """Shard -> L2 norm of this worker's residuals for that shard's keys."""
    families: tuple[Metric, ...] = ()
    """The push policy's own metric families (``PushPolicy.collect``)."""


class _CodecCollector(Collector):
    def __init__(self, metrics: WorkerMetrics, snapshot: Callable[[], CodecSnapshot]) -> None:
        self.metrics, self.snapshot = metrics, snapshot

    def collect(self):
        snap, m = self.snapshot(), self.metrics
        raw = sum(c.value for c in m.codec_raw_bytes.children.values())
        wire = sum(c.value for c in m.codec_wire_bytes.children.values())
        yield GaugeMetricFamily("bitps_worker_compression_ratio",
                                "Float32 bytes / wire bytes of compressed pushes so far",
                                value=raw / wire if wire else 0.0)
        yield labeled_gauge("bitps_worker_residual_norm",
                            "L2 norm of the error-feedback residuals, by shard", "shard",
                            snap.residual_norms)
        yield from snap.families
