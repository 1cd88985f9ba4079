"""Idle threads sleep. A shard's data loop wakes once a tick (``ps.data._TICK_S``, 0.1 s) when
no request comes, not every 20 ms as it did; an idle worker's communication thread
(``worker.training.comm``) wakes only when work is submitted or it closes, where a timed wait
woke it 20 times a second. Counted by the kernel: each wake-up of a sleeping thread is one
voluntary context switch in ``/proc/self/task/<tid>/status`` (Linux only)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/task")

torch = pytest.importorskip("torch")

from bitps.ps import OptimizerConfig  # noqa: E402
from bitps.worker import ClientConfig, PSClient  # noqa: E402
from bitps.worker.config import OverlapConfig  # noqa: E402
from tests.test_cluster import servers_of  # noqa: E402

IDLE_S = 1.0


def _switches(thread: threading.Thread) -> int:
    for line in Path(f"/proc/self/task/{thread.native_id}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches for thread {thread.name}")


def _wakeups(thread: threading.Thread, seconds: float = IDLE_S) -> int:
    before = _switches(thread)
    time.sleep(seconds)
    return _switches(thread) - before


def test_an_idle_shards_data_loop_wakes_once_a_tick(cluster):
    (shard,) = cluster(1, mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    loop = shard.data._thread
    time.sleep(0.3)  # past start-up
    # 10 ticks a second (a 20 ms tick: 50); slack for a tick split by a late scheduler
    assert _wakeups(loop) <= 15


def test_an_idle_communication_thread_sleeps_until_work_comes(cluster):
    from bitps.worker.training.model import PSModel

    (shard,) = cluster(1, mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    model = torch.nn.Linear(8, 4)
    ps = PSModel(model, PSClient(ClientConfig(servers=servers_of([shard]), heartbeat_s=3600.0)),
                 overlap=OverlapConfig(mode="on"))
    try:
        for _ in range(2):  # the thread has worked, and is idle again
            model(torch.randn(2, 8)).sum().backward()
            ps.step()
        ps.synchronize()
        comm = ps._overlap.comm._thread
        assert comm.is_alive()
        time.sleep(0.2)
        assert _wakeups(comm) <= 2  # a timed wait of 50 ms: 20
        model(torch.randn(2, 8)).sum().backward()
        ps.step()  # and it still wakes for work
        ps.synchronize()
    finally:
        ps.close()
