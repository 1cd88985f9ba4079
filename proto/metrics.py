"""Hot-path metric primitives, exported through ``prometheus_client`` at scrape time.

``prometheus_client``'s own metric objects take a lock and walk several layers per update, which
costs a few microseconds each; a shard updates about ten metrics per message and the message
itself is handled in tens of microseconds. These primitives are plain Python numbers updated
in place (about 0.1 us), and a :class:`MetricSet` (a ``prometheus_client`` collector) turns them
into standard counter / gauge / histogram families when Prometheus scrapes.

Writers must be serialized: a shard writes from its data loop or under its core lock; a worker
updates its metrics under :attr:`MetricSet.lock`. Scrapes read without the lock and may see a
histogram mid-update by one observation, which Prometheus tolerates.

    metrics = MetricSet()
    sent = metrics.counter("bitps_push_bytes_total", "Gradient bytes received")
    sent.inc(4096)
    registry.register(metrics)
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

__all__ = ["HotCounter", "HotGauge", "HotHistogram", "LabeledCounter", "MetricSet",
           "labeled_gauge"]


class HotCounter:
    """A monotonically increasing number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HotGauge:
    """A number that goes up and down."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


class HotHistogram:
    """Bucket counts (``le`` upper bounds, +Inf last) and the sum of observations."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"bucket bounds must be strictly increasing, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class LabeledCounter:
    """Counters keyed by the value of one label."""

    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[str, HotCounter] = {}

    def labels(self, value: str) -> HotCounter:
        child = self.children.get(value)
        if child is None:
            child = self.children.setdefault(value, HotCounter())
        return child


class MetricSet(Collector):
    """A family of hot metrics, collected by ``prometheus_client`` on scrape."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._families: list[tuple[str, str, str, object, str]] = []

    def _add(self, kind: str, name: str, doc: str, metric, label: str = ""):
        self._families.append((kind, name, doc, metric, label))
        return metric

    def counter(self, name: str, doc: str) -> HotCounter:
        if not name.endswith("_total"):
            raise ValueError(f"counter name {name!r} must end in _total")
        return self._add("counter", name, doc, HotCounter())

    def labeled_counter(self, name: str, doc: str, label: str) -> LabeledCounter:
        if not name.endswith("_total"):
            raise ValueError(f"counter name {name!r} must end in _total")
        return self._add("labeled", name, doc, LabeledCounter(), label)

    def gauge(self, name: str, doc: str) -> HotGauge:
        return self._add("gauge", name, doc, HotGauge())

    def histogram(self, name: str, doc: str, bounds: Sequence[float]) -> HotHistogram:
        return self._add("histogram", name, doc, HotHistogram(bounds))

    def collect(self):
        for kind, name, doc, metric, label in self._families:
            if kind == "counter":
                yield CounterMetricFamily(name[: -len("_total")], doc, value=metric.value)
            elif kind == "labeled":
                family = CounterMetricFamily(name[: -len("_total")], doc, labels=[label])
                for value, child in sorted(metric.children.items()):
                    family.add_metric([value], child.value)
                yield family
            elif kind == "gauge":
                yield GaugeMetricFamily(name, doc, value=metric.value)
            else:
                counts, running, buckets = list(metric.counts), 0, []
                for bound, c in zip((*metric.bounds, float("inf")), counts):
                    running += c
                    buckets.append((_le(bound), running))
                yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=metric.sum)


def labeled_gauge(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
    """A gauge family with one sample per ``{label value: value}`` item, in sorted order (for
    collectors that read state at scrape time)."""
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
