"""The Grafana dashboard asks only for series bitps exports.

Every metric name in every query of docker/grafana/dashboards/bitps.json must be a sample name
that a shard or a worker really exposes: the names come from the real metric classes
(``ShardMetrics``, ``WorkerMetrics``, the activation pool's collector) rendered into the text
exposition Prometheus scrapes, with every optional family switched on, not from a list kept by
hand. A histogram is queried through ``_bucket``/``_sum``/``_count`` and a counter through
``_total``; bitps exports no ``_created`` series, so a query for one is as wrong as a query for
a family name. Label names the queries group or match on must exist too, and the dashboard must
point at the provisioned datasource.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bitps.proto.metrics import LabeledCounter
from bitps.ps.metrics import ClockSnapshot, ShardMetrics
from bitps.worker.metrics import CodecSnapshot, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "bitps.json"
PROVISIONING = DOCKER / "grafana" / "provisioning"

# Labels Prometheus itself attaches to every scraped series.
TARGET_LABELS = {"job", "instance"}


# --- what bitps exports ---------------------------------------------------------------------------

def _fill_labeled(metrics) -> None:
    """One child in every labeled counter, so that its samples appear in the exposition."""
    for value in vars(metrics).values():
        if isinstance(value, LabeledCounter):
            value.labels("x").inc()


def _exposed(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Sample name -> label names, as Prometheus would parse the scrape."""
    text = generate_latest(registry).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def shard_series() -> dict[str, set[str]]:
    metrics = ShardMetrics(CollectorRegistry())
    # Every optional gauge on (the 1-bit ones appear only under onebit_adam).
    metrics.watch_clocks(lambda: ClockSnapshot(clocks={0: 3, 1: 2}, min_clock=2, live=2, held=0))
    # the rule's own gauges: those of a onebit_adam shard (its collect, over no keys)
    from bitps.ps.config import OptimizerConfig, ServerConfig
    from bitps.ps.rules import make_rule

    onebit = OptimizerConfig(name="onebit_adam")
    rule = make_rule(onebit, ServerConfig(optimizer=onebit))
    metrics.watch_rule(lambda: rule.collect([]))
    _fill_labeled(metrics)
    return _exposed(metrics.registry)


def worker_series() -> dict[str, set[str]]:
    metrics = WorkerMetrics(CollectorRegistry())
    # the push policy's own gauges: those of 1-bit Adam's (its collect, past the switch)
    from bitps.proto.onebit_pb2 import OneBitParams
    from bitps.worker.algorithms.onebit import SyncMomenta

    policy = SyncMomenta(OneBitParams(freeze_step=2, chunk=256))
    metrics.watch_codecs(lambda: CodecSnapshot(residual_norms={0: 0.1, 1: 0.2},
                                               families=tuple(policy.collect(5))))
    _fill_labeled(metrics)
    # bitps-worker --activation-pool adds the pool's collector to the same registry.
    from bitps.worker.config import PoolConfig
    from bitps.worker.memory.pool import ActivationPool

    pool = ActivationPool(PoolConfig(capacity_bytes=1 << 20), device="cpu")
    metrics.registry.register(pool.collector())
    return _exposed(metrics.registry)


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    series: dict[str, set[str]] = {}
    for part in (shard_series(), worker_series()):
        for name, labels in part.items():
            series.setdefault(name, set()).update(labels)
    return series


# --- what the dashboard asks for ------------------------------------------------------------------

def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def dashboard_queries(dash: dict) -> Iterator[tuple[str, str, str]]:
    """``(where, expr, legendFormat)`` for every PromQL query: panel targets, template variables
    and annotations."""
    for panel in _panels(dash.get("panels", [])):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield (f"panel {panel.get('title')!r} {target.get('refId', '')}",
                       target["expr"], target.get("legendFormat", ""))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            yield f"variable {var.get('name')!r}", query, ""
    for ann in dash.get("annotations", {}).get("list", []):
        if "expr" in ann:
            yield f"annotation {ann.get('name')!r}", ann["expr"], ""


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![A-Za-z0-9_:])bitps_[a-z0-9_]+(?![A-Za-z0-9_:])")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def problems(expr: str, legend: str, exported: dict[str, set[str]], labels: set[str]) -> list:
    """What in one query names a series or label that does not exist."""
    found = []
    # __name__ matchers: an exact name must be exported, a regex must match one.
    for label, op, quoted in _MATCHER.findall(expr):
        value = json.loads(quoted)
        if label == "__name__":
            if op == "=" and value not in exported:
                found.append(f"metric {value!r} is not exported")
            elif op == "=~" and not any(re.fullmatch(value, n) for n in exported):
                found.append(f"__name__=~{value!r} matches no exported metric")
        elif label not in labels:
            found.append(f"label {label!r} (matcher) is on no bitps series")
    bare = _STRING.sub('""', expr)  # label values and regexes are no metric names
    for name in sorted(set(_NAME.findall(bare))):
        if name not in exported:
            found.append(f"metric {name!r} is not exported")
    for group in _GROUPING.findall(bare):
        for label in (x.strip() for x in group.split(",")):
            if label and label not in labels:
                found.append(f"label {label!r} (grouping) is on no bitps series")
    for label in _LEGEND.findall(legend):
        if label not in labels:
            found.append(f"label {label!r} (legend) is on no bitps series")
    return found


def _known_labels(exported: dict[str, set[str]]) -> set[str]:
    static = set()
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        for s in job.get("static_configs", []):
            static.update(s.get("labels", {}))
    return set().union(*exported.values()) | TARGET_LABELS | static


# --- tests ----------------------------------------------------------------------------------------

def test_exported_names_come_from_the_real_metric_objects(exported):
    # Spot checks that the exposition was read right: each kind of family with its suffixes.
    assert "bitps_push_bytes_total" in exported and "bitps_push_bytes" not in exported
    assert {"bitps_push_latency_seconds_bucket", "bitps_push_latency_seconds_sum",
            "bitps_push_latency_seconds_count"} <= set(exported)
    assert "bitps_push_latency_seconds" not in exported
    assert exported["bitps_requests_total"] == {"op"}
    assert "bitps_onebit_residual_norm" in exported  # optional 1-bit gauge switched on
    assert "bitps_worker_onebit_phase" in exported
    assert "bitps_worker_pool_capacity_bytes" in exported
    assert not [n for n in exported if n.endswith("_created")]


def test_checker_catches_wrong_names(exported):
    labels = _known_labels(exported)
    bad = {
        "rate(bitps_push_latency_seconds[5m])": "bitps_push_latency_seconds",  # family name
        "rate(bitps_push_bytes_created[5m])": "bitps_push_bytes_created",
        'sum by (instance) (bitps_nonexistent_total{job="bitps-shard"})': "bitps_nonexistent",
        '{__name__=~"bitps_staleness_gap_bucket"}': "bitps_staleness_gap_bucket",
        "sum by (shrad) (bitps_worker_residual_norm)": "shrad",
    }
    for expr, culprit in bad.items():
        found = problems(expr, "", exported, labels)
        assert len(found) == 1 and culprit in found[0], (expr, found)
    assert problems("bitps_worker_loss", "{{pod}}", exported, labels) == [
        "label 'pod' (legend) is on no bitps series"]
    good = ('histogram_quantile(0.99, sum by (le, instance) '
            '(rate(bitps_push_latency_seconds_bucket{job="bitps-shard", role="shard"}'
            '[$__rate_interval])))')
    assert problems(good, "{{instance}}", exported, labels) == []


def test_every_dashboard_query_names_exported_series(exported):
    dash = json.loads(DASHBOARD.read_text())
    queries = list(dashboard_queries(dash))
    assert len(queries) >= 10, "the dashboard's queries were not found"
    labels = _known_labels(exported)
    named = set()
    report = []
    for where, expr, legend in queries:
        named.update(_NAME.findall(_STRING.sub('""', expr)))
        report += [f"{where}: {p}  in  {expr}" for p in problems(expr, legend, exported, labels)]
    assert not report, "the dashboard asks for what bitps does not export:\n" + "\n".join(report)
    # Both kinds of process are on it.
    assert any(n.startswith("bitps_worker_") for n in named)
    assert any(not n.startswith("bitps_worker_") for n in named)


def test_dashboard_uses_the_provisioned_datasource():
    dash = json.loads(DASHBOARD.read_text())
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    uids = {s["uid"] for s in sources["datasources"] if s["type"] == "prometheus"}
    used = set()
    for panel in _panels(dash["panels"]):
        for thing in (panel, *panel.get("targets", [])):
            ds = thing.get("datasource")
            if isinstance(ds, dict):
                used.add((ds.get("type"), ds.get("uid")))
    assert used and {u for _, u in used} <= uids and {t for t, _ in used} == {"prometheus"}, used
    # $__rate_interval is sized from timeInterval, which must be the scrape interval.
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    for s in sources["datasources"]:
        assert s["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
