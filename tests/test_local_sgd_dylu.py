"""Dynamic local updates (``worker.algorithms.dylu``, ``LocalSGD(adaptive=True)``,
``--inner-steps-adaptive``): the sizing rule, the speed measurement with an injected clock, the
speeds the heartbeats carry, and a real cluster (in-process shards on real sockets, two workers)
where the slowed worker takes fewer inner steps per round."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from bitps.worker.algorithms.dylu import DynamicSteps, dynamic_inner_steps

torch = pytest.importorskip("torch")

from bitps.ps import OptimizerConfig  # noqa: E402
from bitps.worker import ClientConfig, PSClient  # noqa: E402
from bitps.worker.algorithms.local_sgd import LocalSGD  # noqa: E402
from tests.test_cluster import servers_of  # noqa: E402


@pytest.mark.parametrize("h,speed,fastest,want", [
    (8, 10.0, 10.0, 8),     # the fastest worker: H
    (8, 5.0, 10.0, 4),
    (8, 10.0 / 1.5, 10.0, 5),  # 1.5x slower: 5.33 -> 5
    (8, 0.1, 10.0, 1),      # never below one step
    (8, 20.0, 10.0, 8),     # faster than the last report: this worker is the fastest
    (8, 0.0, 10.0, 8),      # own speed unknown
    (8, 10.0, 0.0, 8),      # nobody's speed known yet
    (2, 7.5, 10.0, 2),      # 1.5 rounds half up
    (1, 1.0, 100.0, 1),
])
def test_inner_steps_scale_with_speed_over_the_fastest(h, speed, fastest, want):
    assert dynamic_inner_steps(h, speed, fastest) == want


def test_a_bad_h_is_refused():
    with pytest.raises(ValueError, match="inner_steps is 0; expected >= 1"):
        dynamic_inner_steps(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rounds is 0"):
        DynamicSteps(8, _Board(), rounds=0)


class _Board:
    steps_per_s = 0.0
    fastest_steps_per_s = 0.0


def test_speed_is_steps_over_the_last_rounds_and_is_reported():
    now = [0.0]
    board = _Board()
    dyn = DynamicSteps(8, board, rounds=2, clock=lambda: now[0])
    assert dyn.next_steps() == 8 and dyn.speed == 0.0
    for steps, seconds in [(8, 4.0), (8, 1.0), (4, 1.0)]:  # the first falls out of the window
        dyn.start()
        now[0] += seconds
        dyn.finish(steps)
        now[0] += 100.0  # the exchange's wait: not speed
    assert dyn.speed == pytest.approx(12 / 2.0) and board.steps_per_s == dyn.speed
    board.fastest_steps_per_s = 12.0
    assert dyn.next_steps() == 4


def test_heartbeats_carry_speeds_and_answer_the_fastest_live(cluster):
    shards = cluster(2, mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
    clients = [PSClient(ClientConfig(servers=servers_of(shards), rank=r, world_size=2,
                                     heartbeat_s=0.05)) for r in (0, 1)]
    model = torch.nn.Linear(4, 2)
    trainers = []
    try:
        for c in clients:  # registering starts the heartbeats
            trainers.append(LocalSGD(model, c, torch.optim.SGD(model.parameters(), lr=0.1),
                                     inner_steps=4))
        clients[0].control.steps_per_s, clients[1].control.steps_per_s = 30.0, 10.0
        end = time.monotonic() + 10
        while any(c.control.fastest_steps_per_s != 30.0 for c in clients):
            assert time.monotonic() < end, [c.control.fastest_steps_per_s for c in clients]
            time.sleep(0.02)
        status = clients[1].status(0)
        assert {w.rank: w.steps_per_s for w in status.workers} == {0: 30.0, 1: 10.0}
    finally:
        for t in trainers:
            t.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def test_a_slowed_worker_takes_fewer_inner_steps_per_round(cluster):
    """Rank 1 sleeps 3x as long per step as rank 0: after a few rounds its rounds are about
    H/3 steps while rank 0's stay H; it pushes more often per step it takes."""
    h, slow_steps = 8, 72
    shards = cluster(2, mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
    servers = servers_of(shards)
    delay = {0: 0.004, 1: 0.012}
    sizes: dict[int, list[int]] = {0: [], 1: []}
    locals_: dict[int, LocalSGD] = {}
    done, errors = threading.Event(), []

    def run(rank: int) -> None:
        try:
            model = _model()
            client = PSClient(ClientConfig(servers=servers, rank=rank, world_size=2,
                                           partition_bytes=1024, heartbeat_s=0.05))
            local = locals_[rank] = LocalSGD(model, client,
                                             torch.optim.SGD(model.parameters(), lr=0.01),
                                             inner_steps=h, adaptive=True)
            step = 0
            # the fast worker goes on until the slow one is done: a worker that left is not
            # the fastest any more
            while (step < slow_steps) if rank == 1 else not done.is_set():
                x = torch.randn(8, 16)
                torch.nn.functional.mse_loss(model(x), torch.zeros(8, 4)).backward()
                time.sleep(delay[rank])
                local.step()
                step += 1
                if local.inner_step == 0:
                    sizes[rank].append(local.round_steps)
        except Exception as err:  # reported below: a thread must not die silently
            errors.append(err)
        finally:
            if rank == 1:
                done.set()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for local in locals_.values():
        local.close()
    assert not errors, errors
    slow, fast = sizes[1][3:], sizes[0][3:]  # past the first rounds, before speeds are known
    assert slow and fast, sizes
    assert statistics.median(fast) == h, sizes
    assert statistics.median(slow) <= 4 and max(slow) < h, sizes
    assert locals_[1].clock > slow_steps // h + 4, (locals_[1].clock, sizes)


def test_adaptive_takes_whole_rounds_and_the_flag_reaches_the_config():
    from bitps.worker.__main__ import parse_config
    from bitps.worker.config import AlgorithmConfig

    cfg, _ = parse_config(["--servers", "127.0.0.1:1", "--algorithm", "diloco",
                          "--inner-steps-adaptive"], environ={})
    assert cfg.algorithm.inner_steps_adaptive is True
    cfg, _ = parse_config(["--servers", "127.0.0.1:1", "--algorithm", "diloco"], environ={})
    assert cfg.algorithm.inner_steps_adaptive is False
    with pytest.raises(ValueError, match="inner_steps_adaptive sizes whole rounds"):
        AlgorithmConfig(name="diloco", inner_steps_adaptive=True, fragments=2)
