"""Overlap with several worker processes: sync (and ssp at its bound) must make progress
whatever the timing.

The shards run in this process (real sockets); each worker rank is its own process. Buckets are
several times larger than the credit window, so a worker has one bucket in flight at a time,
and every worker sleeps a random while in its forward and backward, differently per rank and
step, so the workers' buckets become ready in different orders. Before the fix each worker kept
the bucket its next forward needed in flight while the shard held that bucket's reply for the
other worker's push, which waited behind another bucket in that worker's window: a circular wait
broken only by the deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitps.ps import OptimizerConfig, ServerConfig, create_server

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import random, sys, time
import torch
from bitps.worker import ClientConfig, PSClient
from bitps.worker.config import OverlapConfig
from bitps.worker.training.model import PSModel

rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
runs = {"off": tuple(sys.argv[4].split(",")), "on": tuple(sys.argv[5].split(","))}
torch.set_num_threads(1)


class Jitter(torch.autograd.Function):
    # sleeps in backward: this layer's gradients, and every bucket after, come later
    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.delay)
        return grad, None


def train(servers, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    client = PSClient(ClientConfig(servers=servers, rank=rank, world_size=world,
                                   partition_bytes=16 << 10, deadline_s=20))
    # buckets of two layers (129 KiB), four times the window: one bucket in flight at a time
    ps_model = PSModel(model, client, overlap=OverlapConfig(
        mode=mode, bucket_bytes=128 << 10, inflight_bytes=32 << 10))
    assert ps_model.decision.enabled == (mode == "on")
    rng = random.Random(1000 * rank + 7)
    data = torch.Generator().manual_seed(rank)
    for step in range(20):
        h = torch.randn(16, 128, generator=data)
        for layer in model:
            time.sleep(rng.random() * 0.003)
            h = Jitter.apply(torch.tanh(layer(h)), rng.random() * 0.006)
        h.square().mean().backward()
        ps_model.step()
    ps_model.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    ps_model.close()
    return params


torch.save({mode: train(servers, mode) for mode, servers in runs.items()}, out)
"""


def _shards(n: int, mode: str) -> list:
    return [create_server(ServerConfig(shard_id=i, num_shards=n, metrics_port=-1, mode=mode,
                                       staleness=0,
                                       optimizer=OptimizerConfig(name="adam", lr=1e-2)))
            for i in range(n)]


@pytest.mark.parametrize(("mode", "world"), [("sync", 2), ("sync", 3), ("ssp", 2)])
def test_overlap_with_buckets_larger_than_the_window_completes_and_matches_overlap_off(
        tmp_path, mode, world):
    """Acceptance 1: 20 sync steps with overlap on complete and end where overlap off ends
    (the issue asks rtol 1e-6; the shard adds a step's pushes in rank order, so it is exact).
    ssp at its tightest bound (S = 0) completes too (its pushes apply as they come, so the two
    runs need not agree)."""
    off, on = _shards(2, mode), _shards(2, mode)
    try:
        addr = {name: ",".join(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
                for name, shards in (("off", off), ("on", on))}
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world),
                                   str(tmp_path / f"rank{r}.pt"), addr["off"], addr["on"]],
                                  cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
    finally:
        for s in off + on:
            s.stop(0)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    torch.manual_seed(0)
    start = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    assert any(not torch.equal(p, q) for p, q in zip(results[0]["on"], start.parameters()))
    if mode != "sync":
        return
    for r, res in enumerate(results):
        for p_off, p_on, p_ref in zip(res["off"], res["on"], results[0]["off"]):
            assert torch.equal(p_off, p_ref), f"rank {r} disagrees with rank 0 (overlap off)"
            assert torch.equal(p_on, p_off), f"rank {r}: overlap on differs from overlap off"
