"""Shared test fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_without_jit(tmp_path):
    """``run_without_jit(script, **arrays)`` runs ``script`` in a fresh interpreter with
    ``NUMBA_DISABLE_JIT=1`` (every kernel as plain Python), passing the arrays through
    ``sys.argv[1]`` (an .npz) and returning what it saved to ``sys.argv[2]``."""

    def run(script: str, **arrays) -> dict:
        np.savez(tmp_path / "in.npz", **arrays)
        env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.npz"),
                               str(tmp_path / "out.npz")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return dict(np.load(tmp_path / "out.npz"))

    return run


@pytest.fixture
def cluster():
    """``cluster(num_shards, **server_config)`` -> list of running in-process shards (real
    sockets), stopped afterwards."""
    from bitps.ps import ServerConfig, create_server

    started = []

    def make(num_shards: int = 1, **kw):
        shards = [create_server(ServerConfig(shard_id=i, num_shards=num_shards, **kw))
                  for i in range(num_shards)]
        started.extend(shards)
        return shards

    yield make
    for s in started:
        s.stop(0)
