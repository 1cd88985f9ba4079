"""Prometheus metrics of one pipeline stage process, on a registry of its own.

Names are ``bitps_stage_*`` with unit suffixes, every sample labelled ``stage`` and ``replica``
so the series of a whole pipeline (D replicas x P stages, one process each) can be scraped into
one Prometheus and told apart; docs/metrics.md lists them. The stage runtime calls
:meth:`StageMetrics.observe` once per step with its ``StepReport`` (nothing here is on the
per-micro-batch path); the families are built when Prometheus scrapes.

    metrics = StageMetrics(stage=1, replica=0)
    metrics.observe(report)            # after each StageRuntime.run_step
    start_http_server(port, registry=metrics.registry)
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from bitps.proto.metrics import HotHistogram

__all__ = ["StageMetrics"]

_STEP = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LABELS = ["stage", "replica"]


class StageMetrics(Collector):
    """Every metric a pipeline stage exports; ``observe`` records one step's report.

    The values are plain numbers under :attr:`lock`, turned into labelled Prometheus families
    when scraped (as ``proto.metrics`` does for the worker's). ``registry`` defaults to a new
    one; give the stage's ``PSClient``'s (``client.metrics.registry``) to serve both on one
    endpoint.
    """

    def __init__(self, stage: int, replica: int, registry: CollectorRegistry | None = None
                 ) -> None:
        if stage < 0 or replica < 0:
            raise ValueError(f"stage and replica must be >= 0, got stage={stage} "
                             f"replica={replica}")
        self.stage, self.replica = stage, replica
        self.lock = threading.Lock()
        self.busy_s = self.wall_s = 0.0
        self.steps = 0
        self.bubble = 0.0
        self.micro_batch_size = 0
        self.p2p_bytes = {"sent": 0, "received": 0}
        self.loss = float("nan")
        self.step_time = HotHistogram(_STEP)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def observe(self, report) -> None:
        """Record one step: ``report`` is the stage runtime's ``StepReport`` (``wall_s``,
        ``busy_s``, ``micro_batch_size``, ``p2p_bytes_sent``, ``p2p_bytes_received``, and
        ``losses`` on the last stage)."""
        wall, busy = float(report.wall_s), float(report.busy_s)
        if wall < 0 or busy < 0:
            raise ValueError(f"a step's wall and busy seconds must be >= 0, got wall={wall} "
                             f"busy={busy}")
        losses = getattr(report, "losses", None)
        with self.lock:
            self.busy_s += busy
            self.wall_s += wall
            self.step_time.observe(wall)
            self.bubble = 1.0 - busy / wall if wall > 0 else 0.0
            self.micro_batch_size = report.micro_batch_size
            self.p2p_bytes["sent"] += report.p2p_bytes_sent
            self.p2p_bytes["received"] += report.p2p_bytes_received
            self.steps += 1
            if losses:
                self.loss = sum(losses) / len(losses)

    def collect(self):
        labels = [str(self.stage), str(self.replica)]

        def family(kind, name: str, doc: str, value: float):
            f = kind(name, doc, labels=_LABELS)
            f.add_metric(labels, value)
            return f

        yield family(CounterMetricFamily, "bitps_stage_busy_seconds",
                     "Seconds this stage spent computing F, B and W (the rest of its wall time "
                     "is bubble)", self.busy_s)
        yield family(CounterMetricFamily, "bitps_stage_wall_seconds",
                     "Wall seconds of this stage's steps, communication and waits included",
                     self.wall_s)
        yield family(CounterMetricFamily, "bitps_stage_steps",
                     "Pipeline steps this stage completed", self.steps)
        yield family(GaugeMetricFamily, "bitps_stage_bubble_ratio",
                     "Last step: 1 - busy / wall (idle share of the step)", self.bubble)
        yield family(GaugeMetricFamily, "bitps_stage_micro_batch_size",
                     "Samples per micro-batch in use (dynamic micro-batching changes it "
                     "between steps)", self.micro_batch_size)
        yield family(GaugeMetricFamily, "bitps_stage_loss",
                     "Last step's mean micro-batch loss (last stage only; NaN elsewhere)",
                     self.loss)
        p2p = CounterMetricFamily("bitps_stage_p2p_bytes",
                                  "Activation and gradient bytes this stage moved point to "
                                  "point, by direction (sent, received)",
                                  labels=[*_LABELS, "direction"])
        for direction, value in self.p2p_bytes.items():
            p2p.add_metric([*labels, direction], value)
        yield p2p
        h = self.step_time
        counts, running, buckets = list(h.counts), 0, []
        for bound, c in zip((*h.bounds, float("inf")), counts):
            running += c
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        step = HistogramMetricFamily("bitps_stage_step_seconds",
                                     "Wall time of one pipeline step on this stage",
                                     labels=_LABELS)
        step.add_metric(labels, buckets, sum_value=h.sum)
        yield step
