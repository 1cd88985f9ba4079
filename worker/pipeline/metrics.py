"""Prometheus metrics of one pipeline stage process, on a registry of its own.

Names are ``bitps_stage_*`` with unit suffixes, every sample labelled ``stage`` and ``replica``
so the series of a whole pipeline (D replicas x P stages, one process each) can be scraped into
one Prometheus and told apart; docs/metrics.md lists them. The stage runtime calls
:meth:`StageMetrics.observe` once per step with its ``StepReport``; nothing here is on the
per-micro-batch path, so the plain ``prometheus_client`` metric objects (a lock per update) cost
nothing that matters.

    metrics = StageMetrics(stage=1, replica=0)
    metrics.observe(report)            # after each StageRuntime.run_step
    start_http_server(port, registry=metrics.registry)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["StageMetrics"]

_STEP = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LABELS = ("stage", "replica")


class StageMetrics:
    """Every metric a pipeline stage exports; ``observe`` records one step's report.

    ``registry`` defaults to a new one (a process may hold several stages' metrics in tests).
    """

    def __init__(self, stage: int, replica: int, registry: CollectorRegistry | None = None
                 ) -> None:
        if stage < 0 or replica < 0:
            raise ValueError(f"stage and replica must be >= 0, got stage={stage} "
                             f"replica={replica}")
        self.stage, self.replica = stage, replica
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"stage": str(stage), "replica": str(replica)}

        def make(kind, name: str, doc: str, **kw):
            return kind(name, doc, _LABELS, registry=self.registry, **kw).labels(**labels)

        self.busy = make(Counter, "bitps_stage_busy_seconds",
                         "Seconds this stage spent computing F, B and W (the rest of its wall "
                         "time is bubble)")
        self.wall = make(Counter, "bitps_stage_wall_seconds",
                         "Wall seconds of this stage's steps, communication and waits included")
        self.step_time = make(Histogram, "bitps_stage_step_seconds",
                              "Wall time of one pipeline step on this stage", buckets=_STEP)
        self.bubble = make(Gauge, "bitps_stage_bubble_ratio",
                           "Last step: 1 - busy / wall (idle share of the step)")
        self.micro_batch_size = make(Gauge, "bitps_stage_micro_batch_size",
                                     "Samples per micro-batch in use (dynamic micro-batching "
                                     "changes it between steps)")
        self.p2p_bytes = Counter("bitps_stage_p2p_bytes", "Activation and gradient bytes this "
                                 "stage moved point to point, by direction (sent, received)",
                                 (*_LABELS, "direction"), registry=self.registry)
        self._sent = self.p2p_bytes.labels(direction="sent", **labels)
        self._received = self.p2p_bytes.labels(direction="received", **labels)
        self.steps = make(Counter, "bitps_stage_steps", "Pipeline steps this stage completed")
        self.loss = make(Gauge, "bitps_stage_loss",
                         "Last step's mean micro-batch loss (last stage only; NaN elsewhere)")
        self.loss.set(float("nan"))

    def observe(self, report) -> None:
        """Record one step: ``report`` is the stage runtime's ``StepReport`` (``wall_s``,
        ``busy_s``, ``micro_batch_size``, ``p2p_bytes_sent``, ``p2p_bytes_received``, and
        ``losses`` on the last stage)."""
        wall, busy = float(report.wall_s), float(report.busy_s)
        if wall < 0 or busy < 0:
            raise ValueError(f"a step's wall and busy seconds must be >= 0, got wall={wall} "
                             f"busy={busy}")
        self.busy.inc(busy)
        self.wall.inc(wall)
        self.step_time.observe(wall)
        self.bubble.set(1.0 - busy / wall if wall > 0 else 0.0)
        self.micro_batch_size.set(report.micro_batch_size)
        self._sent.inc(report.p2p_bytes_sent)
        self._received.inc(report.p2p_bytes_received)
        self.steps.inc()
        losses = getattr(report, "losses", None)
        if losses:
            self.loss.set(sum(losses) / len(losses))
