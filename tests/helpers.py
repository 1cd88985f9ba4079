"""Small helpers several test modules share (the bigger ones have modules of their own:
``tests.encoding``; the fault injection is ``bench/faults.py``, which the chaos bench
shares)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["docs_generator", "one_key_core", "promtool_problems", "run_ranks"]


def docs_generator():
    """``docs/gen_configuration.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gen_configuration",
                                                  ROOT / "docs" / "gen_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_key_core(cfg, n: int):
    """A ``ShardCore`` for ``cfg`` (clock fixed at 0) with one registered float32 key ``w`` of
    ``n`` elements, its initial values ``linspace(-1, 1, n)``, rank 0 of a world of one."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.wire import PROTOCOL
    from bitps.ps.shard import ShardCore

    core = ShardCore(cfg, now=lambda: 0.0)
    spec = pb.KeySpec(key=0, name="w", offset=0, length=n, dtype=pb.FLOAT32)
    init = np.linspace(-1, 1, n, dtype=np.float32)
    core.register(pb.RegisterRequest(protocol=PROTOCOL, rank=0, world_size=1, signature="s",
                                     num_shards=1, shard_id=0, keys=[spec], sends_values=True),
                  {0: init.tobytes()})
    return core


def run_ranks(rank, ranks=(0, 1), *, timeout_s: float = 120.0) -> None:
    """Run ``rank(r)`` for every r of ``ranks`` on a thread each (in-process workers, each with
    its own client) and wait for all; a thread still running after ``timeout_s`` fails the
    test (a hang), instead of being left behind. ``rank`` records its own errors."""
    import threading
    import time

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(end - time.monotonic(), 0.0))
    stuck = [r for r, t in zip(ranks, threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still running after {timeout_s} s"


def _small_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train_two_workers(servers, *, encoder, overlap: str = "off", steps: int = 12):
    """Two ``PSModel`` workers (threads) train a small model against ``servers`` with the
    ``encoder`` config; by rank: the model's parameters after a last pull, the worker's copies
    by key, the parameters after close, and whether it predicted weights."""
    import threading

    import torch

    from bitps.worker import ClientConfig, PSClient
    from bitps.worker.config import OverlapConfig
    from bitps.worker.training.model import PSModel

    out, barrier = {}, threading.Barrier(2)
    models = [_small_model(), _small_model()]  # here: torch's global seed is not per thread

    def rank(r):
        try:
            cfg = ClientConfig(servers=servers, rank=r, world_size=2, partition_bytes=1024)
            ps = PSModel(models[r], PSClient(cfg), encoder=encoder,
                         overlap=OverlapConfig(mode=overlap, bucket_bytes=1024))
            gen = torch.Generator().manual_seed(r)
            for _ in range(steps):
                ps.model(torch.randn(8, 16, generator=gen)).square().sum().backward()
                ps.step()
            ps.synchronize()
            barrier.wait()  # both pushed everything; one more pull sees the end
            ps.client.pull(ps.keys, ps._staging.outs, clock=ps.clock).wait()
            shown = [p.detach().clone() for p in ps.model.parameters()]
            exact = {k: o.copy() for k, o in zip(ps.keys, ps._staging.outs)}
            ps.close()
            out[r] = (shown, exact, [p.detach().clone() for p in ps.model.parameters()],
                      ps._staging.prediction is not None)
        except BaseException as err:  # noqa: BLE001 - raised by the test thread
            out[r] = err
            barrier.abort()

    run_ranks(rank)
    for r in (0, 1):
        if isinstance(out.get(r), BaseException):
            raise out[r]
    return out


def promtool_problems(text: str) -> list[str]:
    """What ``promtool check metrics`` (Prometheus's own linter: exposition format, naming,
    units) says about the exposition ``text``: one line per problem, none when clean. Skips the
    test when promtool is not installed (``.ci/run`` installs Debian's prometheus, which has
    it)."""
    import shutil
    import subprocess

    import pytest

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it)")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return problems or ([] if out.returncode == 0 else [f"promtool exited {out.returncode}"])
