"""Prometheus metrics of one shard, on a registry of its own (several shards can share a process
in tests). Names are ``bitps_*`` with unit suffixes; docs/metrics.md lists them all."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from bitps.proto.metrics import MetricSet, labeled_gauge

__all__ = ["ClockSnapshot", "ShardMetrics"]

_LATENCY = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)
_GAP = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class ShardMetrics:
    """Every metric a shard exports (hot-path primitives, see :mod:`bitps.proto.metrics`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = self.set = MetricSet()
        self.push_bytes = m.counter("bitps_push_bytes_total", "Gradient payload bytes received")
        self.pull_bytes = m.counter("bitps_pull_bytes_total", "Parameter payload bytes sent")
        self.push_latency = m.histogram("bitps_push_latency_seconds",
                                        "Time to validate and apply one push message", _LATENCY)
        self.pull_latency = m.histogram("bitps_pull_latency_seconds",
                                        "Pull arrival to reply, holding time included", _LATENCY)
        self.pull_wait = m.histogram("bitps_pull_wait_seconds",
                                     "Time a pull was held by the consistency policy", _LATENCY)
        self.clock_gap = m.histogram("bitps_staleness_clock_gap_steps",
                                     "Per applied push: pusher's clock minus the shard's min "
                                     "clock", _GAP)
        self.version_gap = m.histogram("bitps_staleness_version_gap_updates",
                                       "Per applied push: key version at apply minus the "
                                       "version the gradient was computed from", _GAP)
        self.admission_gap = m.histogram("bitps_admission_clock_gap_steps",
                                         "Per admitted SSP pull: requested clock minus min live "
                                         "clock", _GAP)
        self.updates = m.counter("bitps_updates_applied_total",
                                 "Optimizer updates applied to keys")
        self.requests = m.labeled_counter("bitps_requests_total", "Data-plane requests by op",
                                          "op")
        self.errors = m.labeled_counter("bitps_errors_total", "Error replies by code", "code")
        self.codec_wire_bytes = m.labeled_counter(
            "bitps_push_codec_wire_bytes_total", "Compressed gradient bytes received, by codec",
            "codec")
        self.codec_decoded_bytes = m.labeled_counter(
            "bitps_push_codec_decoded_bytes_total",
            "Float32 bytes those compressed pushes decoded to, by codec", "codec")
        self.registry.register(m)

    def watch_clocks(self, snapshot: Callable[[], ClockSnapshot]) -> None:
        """Export clocks read at scrape time from ``snapshot`` (always current, no hot-path
        cost): per-worker clock, min live clock, live workers and held pulls."""
        self.registry.register(_ClockCollector(snapshot))

    def watch_rule(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Export the update rule's own metric families, read at scrape time from ``collect``
        (``UpdateRule.collect`` over the shard's keys); this module names no rule."""
        self.registry.register(_Collect(collect))


@dataclass(frozen=True)
class ClockSnapshot:
    """What the clock gauges show: ``clocks`` maps rank to steps completed."""

    clocks: dict[int, int]
    min_clock: int
    live: int
    held: int


class _ClockCollector(Collector):
    def __init__(self, snapshot: Callable[[], ClockSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        yield labeled_gauge("bitps_clock_steps",
                            "Steps completed, per worker, as this shard has seen", "worker",
                            snap.clocks)
        yield GaugeMetricFamily("bitps_min_clock_steps", "Smallest clock over live workers",
                                value=snap.min_clock)
        yield GaugeMetricFamily("bitps_live_workers", "Workers counted as live", value=snap.live)
        yield GaugeMetricFamily("bitps_pending_pulls", "Pulls held by the consistency policy",
                                value=snap.held)


class _Collect(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self):
        yield from self._collect()
