"""Saving ``bitps.Optimizer.state_dict()`` mid-run and resuming in a fresh process, against
shards restarted from their own checkpoints, continues bit for bit in sync mode: with sign1
pushes (the worker's error feedback is in the state) and a torch schedule (its state and the
param groups' lr too). Real processes for the worker, real shards on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitps.ps import OptimizerConfig, ServerConfig, create_server

REPO = Path(__file__).resolve().parents[1]
STEPS, SPLIT = 24, 11

# One worker run: steps [first, last) of a fixed sequence; loads the state first when given,
# saves it and the final parameters at the end.
WORKER = r"""
import sys, torch, bitps
from bitps.proto.codecs import CodecConfig
servers, load, save = sys.argv[1], sys.argv[4], sys.argv[5]
first, last = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
client = bitps.connect(servers=servers, partition_bytes=4096)
encoder = bitps.EncoderConfig(push_codec=CodecConfig(name="sign1", chunk=64),
                              compress_min_bytes=1024)
optimizer = bitps.Optimizer(model, client, lr=3e-3, weight_decay=0.01, encoder=encoder)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=STEPS,
                                                cycle_momentum=False)
if load != "-":
    state = torch.load(load, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
assert optimizer.clock == first, (optimizer.clock, first)
for step in range(first, last):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    scheduler.step()
torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "params": [p.detach().clone() for p in model.parameters()]}, save)
optimizer.close()
""".replace("STEPS", str(STEPS))


def _shards(started: list, ckpt: Path | None):
    """Two sync AdamW shards (started here, stopped by the test), each with its own checkpoint
    directory under ``ckpt`` (restored when it holds one)."""
    shards = [create_server(ServerConfig(
        shard_id=i, num_shards=2, mode="sync", metrics_port=-1,
        optimizer=OptimizerConfig(name="adamw", lr=0.5),
        checkpoint_dir=str(ckpt / f"shard{i}") if ckpt is not None else "")) for i in (0, 1)]
    started.extend(shards)
    return shards


def _run(shards, first, last, load, save):
    servers = ",".join(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", WORKER, servers, str(first), str(last),
                           str(load), str(save)], env=env, capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(save, weights_only=False)


@pytest.fixture
def started():
    shards: list = []
    yield shards
    for s in shards:
        s.stop(0)


def test_resume_from_state_dict_and_shard_checkpoints_is_bit_for_bit(started, tmp_path):
    whole = _run(_shards(started, None), 0, STEPS, "-", tmp_path / "whole.pt")

    shards = _shards(started, tmp_path / "ckpt")
    half = _run(shards, 0, SPLIT, "-", tmp_path / "half.pt")
    assert half["optimizer"]["bitps"]["clock"] == SPLIT
    assert any(r.any() for r in half["optimizer"]["bitps"]["encoder"]["residuals"].values())
    for s in shards:
        s.stop(0)  # the final checkpoint
    restarted = _shards(started, tmp_path / "ckpt")  # fresh shards, restored
    resumed = _run(restarted, SPLIT, STEPS, tmp_path / "half.pt", tmp_path / "resumed.pt")

    lr = [run["optimizer"]["param_groups"][0]["lr"] for run in (resumed, whole)]
    assert lr[0] == lr[1]
    for got, want in zip(resumed["params"], whole["params"]):
        assert torch.equal(got, want), (got - want).abs().max()
    assert not all(torch.equal(a, b) for a, b in zip(half["params"], whole["params"]))
