"""Every metrics endpoint passes Prometheus's own linter, ``promtool check metrics``
(exposition, naming, units), and no name means two things: a live shard's ``/metrics`` (for
the plain rules and for 1-bit Adam, whose rule exports its own families), a worker's (served
as ``bitps-worker`` serves it) and a stage's, after real training steps. The launched
clusters of tests/test_prometheus.py and tests/test_pipeline_launch.py lint their live
processes' endpoints too."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

import bitps
from bitps.proto.codecs import CodecConfig
from bitps.ps import OptimizerConfig
from bitps.ps.onebit import OneBitConfig
from bitps.worker.pipeline.metrics import StageMetrics
from tests.helpers import promtool_problems

RULES = {"adam": OptimizerConfig(name="adam"),
         "onebit_adam": OptimizerConfig(name="onebit_adam",
                                        rule_config=OneBitConfig(freeze_step=2))}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def endpoints():
    """Text of a shard's endpoint per rule and of the worker that trained against it, after
    6 steps of sign1 pushes (so the labelled families have series), and of a stage."""
    from bitps.ps import ServerConfig, create_server

    texts = {}
    for name, optimizer in RULES.items():
        shard = create_server(ServerConfig(mode="sync", metrics_port=0, optimizer=optimizer))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        client = bitps.connect(servers=f"127.0.0.1:{shard.ports['grpc_port']}",
                               partition_bytes=65536)
        httpd, thread = start_http_server(0, addr="127.0.0.1", registry=client.metrics.registry)
        encoder = bitps.EncoderConfig(push_codec=CodecConfig(name="sign1"),
                                      compress_min_bytes=1024)
        ps_model = bitps.PSModel(model, client, encoder=encoder)
        try:
            for _ in range(6):
                model(torch.randn(8, 256)).square().sum().backward()
                ps_model.step()
            ps_model.synchronize()
            texts[f"shard {name}"] = _scrape(shard.ports["metrics_port"])
            texts[f"worker ({name} shard)"] = _scrape(httpd.server_port)
        finally:
            ps_model.close()
            httpd.shutdown()
            shard.stop(0)
    stage = StageMetrics(stage=1, replica=0)
    stage.observe(SimpleNamespace(wall_s=0.2, busy_s=0.15, micro_batch_size=4,
                                  p2p_bytes_sent=4096, p2p_bytes_received=4096, losses=[2.5]))
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=stage.registry)
    try:
        texts["stage"] = _scrape(httpd.server_port)
    finally:
        httpd.shutdown()
    return texts


def test_every_endpoint_passes_promtool(endpoints):
    assert {"bitps_onebit_compressing_keys"} <= _names(endpoints["shard onebit_adam"])
    assert {"bitps_worker_codec_wire_bytes"} <= _names(endpoints["worker (adam shard)"])
    for name, text in endpoints.items():
        assert promtool_problems(text) == [], name


def test_no_name_is_exported_with_two_meanings(endpoints):
    """A shard's names are its own (``bitps_``, never a worker's ``bitps_worker_`` or a stage's
    ``bitps_stage_``), so a query by name reads one kind of process; a stage serves its
    client's worker families on purpose (same meaning)."""
    shard = set().union(*(_names(t) for n, t in endpoints.items() if n.startswith("shard")))
    worker = set().union(*(_names(t) for n, t in endpoints.items() if n.startswith("worker")))
    stage = _names(endpoints["stage"])
    assert not shard & worker and not shard & stage, shard & (worker | stage)
    assert not [n for n in shard if n.startswith(("bitps_worker_", "bitps_stage_"))]
    assert all(n.startswith("bitps_worker_") for n in worker)
    assert all(n.startswith("bitps_stage_") for n in stage)
    assert "bitps_clock_steps" in shard and "bitps_worker_clock_steps" in worker


def test_promtool_catches_what_it_should():
    """The check bites: a counter without ``_total`` and a gauge in milliseconds."""
    bad = ("# HELP bitps_pushes Pushes.\n# TYPE bitps_pushes counter\nbitps_pushes 3\n"
           "# HELP bitps_wait_milliseconds Wait.\n# TYPE bitps_wait_milliseconds gauge\n"
           "bitps_wait_milliseconds 2\n")
    problems = " ".join(promtool_problems(bad))
    assert '"_total" suffix' in problems and 'base unit "seconds"' in problems, problems
