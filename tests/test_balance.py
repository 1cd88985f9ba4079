"""Batch balancing (``worker.algorithms.balance``): the split against a brute-force optimum,
the speed measurement from given step timings, the speeds the heartbeats carry between real
shards and workers, and a real sync step whose weighted pushes average to the global batch's
mean gradient."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from bitps.worker.algorithms.balance import BatchBalance, balanced_shares

torch = pytest.importorskip("torch")

from bitps.ps import OptimizerConfig  # noqa: E402
from bitps.worker import ClientConfig, PSClient  # noqa: E402
from bitps.worker.metrics import WorkerMetrics  # noqa: E402
from bitps.worker.training.utilization import StepStats  # noqa: E402
from tests.helpers import run_ranks  # noqa: E402
from tests.test_cluster import servers_of  # noqa: E402


def _best(total: int, speeds: list[float]) -> float:
    """The optimum by enumeration: the least slowest-worker time over every split >= 1."""
    best = math.inf
    for split in itertools.product(range(1, total + 1), repeat=len(speeds)):
        if sum(split) == total:
            best = min(best, max(n / v for n, v in zip(split, speeds)))
    return best


@pytest.mark.parametrize("total,speeds,want", [
    (8, [1.5, 1.0], [5, 3]),          # the 1.5x straggler: 5/1.5 = 3.33 against 4/1.5 | 4/1
    (8, [1.0, 1.0], [4, 4]),
    (7, [1.0, 1.0], [4, 3]),          # a tie goes to the lower rank
    (4, [3.0, 1.0], [3, 1]),
    (3, [100.0, 1.0, 1.0], [1, 1, 1]),  # never below one sample
    (12, [2.0, 1.0, 1.0], [6, 3, 3]),
])
def test_shares_split_by_speed(total, speeds, want):
    assert balanced_shares(total, speeds) == want


def test_shares_are_optimal_against_enumeration():
    rng = np.random.default_rng(0)
    for _ in range(200):
        workers = int(rng.integers(1, 4))
        total = int(rng.integers(workers, 11))
        speeds = [float(v) for v in rng.uniform(0.2, 5.0, workers)]
        shares = balanced_shares(total, speeds)
        assert sum(shares) == total and min(shares) >= 1
        assert max(n / v for n, v in zip(shares, speeds)) == pytest.approx(_best(total, speeds))


@pytest.mark.parametrize("speeds", [[0.0, 2.0, 1.0], [math.nan, 1.0, 1.0], [math.inf, 1, 1],
                                    [-1.0, 1.0, 1.0]])
def test_an_unknown_speed_splits_evenly(speeds):
    assert balanced_shares(8, speeds) == [3, 3, 2]


def test_bad_totals_and_settings_are_refused():
    with pytest.raises(ValueError, match="total is 1; expected at least one sample per worker"):
        balanced_shares(1, [1.0, 1.0])
    with pytest.raises(ValueError, match="speeds is empty"):
        balanced_shares(4, [])
    model = _Model(rank=0, world_size=4)
    with pytest.raises(ValueError, match="global_batch is 3; expected at least one sample"):
        BatchBalance(model, 3)
    with pytest.raises(ValueError, match="window is 0"):
        BatchBalance(model, 8, window=0)
    with pytest.raises(ValueError, match="margin is 1; expected 0 <= margin < 1"):
        BatchBalance(model, 8, margin=1)


class _Board:
    def __init__(self) -> None:
        self.samples_per_s = 0.0
        self.speeds: dict[int, float] = {}


class _Client:
    def __init__(self, rank: int, world_size: int) -> None:
        self.cfg = ClientConfig(servers=("127.0.0.1:1",), rank=rank, world_size=world_size)
        self.control, self.metrics = _Board(), WorkerMetrics()


class _Model:
    """What ``BatchBalance`` reads of a ``PSModel``: its client's config and board, and its
    last step's timing."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.client, self.last_stats = _Client(rank, world_size), None

    def step(self, wall_s: float, exposed_s: float) -> None:
        self.last_stats = StepStats(wall_s=wall_s, exposed_s=exposed_s, comm_s=exposed_s,
                                    overlapped=False)


def test_speed_is_samples_over_the_last_steps_compute_and_the_split_waits_for_every_rank():
    model = _Model(rank=1, world_size=2)
    board = model.client.control
    balance = BatchBalance(model, 8, window=2)
    # the first step's timing runs from PSModel's construction: not counted; then the
    # window's last two steps, each its wall time less what it waited for communication
    for wall, waited in ((50.0, 0.0), (10.0, 0.0), (3.0, 1.0), (7.0, 5.0)):
        assert balance.next_batch() == 4 and balance.weight == 1.0  # no speeds yet: even
        model.step(wall, waited)
    assert balance.next_batch() == 4
    assert balance.speed == pytest.approx(8 / 4.0) and board.samples_per_s == balance.speed
    assert balance.next_batch() == 4 and balance.speed == pytest.approx(2.0)  # no new step
    board.speeds = {1: 2.0}  # rank 0 has not reported: still even
    assert balance.next_batch() == 4
    board.speeds = {0: 3.0, 1: 2.0}
    assert balance.next_batch() == 3 and balance.shares == [5, 3]
    assert balance.weight == pytest.approx(3 * 2 / 8)
    registry = model.client.metrics.registry  # the share and the speed, exported
    assert registry.get_sample_value("bitps_worker_batch_share_samples") == 3
    assert registry.get_sample_value("bitps_worker_compute_samples_per_second") == 2.0
    # ranks keep their split until a new one cuts the slowest compute by over 5 %
    board.speeds = {0: 4.0, 1: 1.95}
    assert balanced_shares(8, [4.0, 1.95]) == [6, 2]  # 1.5 s against [5, 3]'s 1.54: 2.5 %
    assert balance.next_batch() == 3 and balance.shares == [5, 3]
    board.speeds = {0: 4.0, 1: 1.8}  # 1.5 s against 1.67: 10 %
    assert balance.next_batch() == 2 and balance.shares == [6, 2]
    board.speeds = {0: 3.0, 1: 2.0}
    assert balance.next_batch() == 3
    model.step(6.0, 0.0)  # 3 samples in 6 s of compute: the window is now 4 s and 6 s
    balance.next_batch()
    assert balance.speed == pytest.approx((4 + 3) / (2.0 + 6.0))


def test_heartbeats_carry_every_live_workers_samples_per_second(cluster):
    shards = cluster(2, mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
    clients = [PSClient(ClientConfig(servers=servers_of(shards), rank=r, world_size=2,
                                     heartbeat_s=0.05)) for r in (0, 1)]
    from bitps.worker.training.model import PSModel

    models = []
    try:
        for c in clients:  # registering starts the heartbeats
            models.append(PSModel(torch.nn.Linear(4, 2), c))
        clients[0].control.samples_per_s, clients[1].control.samples_per_s = 6.0, math.nan
        want = {0: 6.0}  # a speed that is not a positive number is not one: absent
        end = time.monotonic() + 10
        while any(c.control.speeds != want for c in clients):
            assert time.monotonic() < end, [c.control.speeds for c in clients]
            time.sleep(0.02)
        clients[1].control.samples_per_s = 4.0
        want = {0: 6.0, 1: 4.0}
        while any(c.control.speeds != want for c in clients):
            assert time.monotonic() < end, [c.control.speeds for c in clients]
            time.sleep(0.02)
        status = clients[0].status(0)
        assert {w.rank: w.samples_per_s for w in status.workers} == {0: 6.0, 1: 4.0}
        shares = [BatchBalance(m, 10) for m in models]
        assert [b.next_batch() for b in shares] == [6, 4]  # both ranks compute the same split
    finally:
        for m in models:
            m.close()


def test_weighted_sync_step_is_the_global_batchs_mean_gradient(cluster):
    """Rank 0 takes 3 of a global batch of 4, rank 1 one; each scales its loss by its weight:
    the sync step equals SGD on the mean loss over the 4 samples in one process."""
    from bitps.worker.training.model import PSModel

    (shard,) = cluster(1, mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)
    init = torch.nn.Linear(3, 1)
    local = torch.nn.Linear(3, 1)
    local.load_state_dict(init.state_dict())
    torch.nn.functional.mse_loss(local(x), y).backward()
    with torch.no_grad():
        for p in local.parameters():
            p -= 0.1 * p.grad
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            model = torch.nn.Linear(3, 1)
            model.load_state_dict(init.state_dict())
            client = PSClient(ClientConfig(servers=servers_of([shard]), rank=r, world_size=2,
                                           heartbeat_s=3600.0))
            ps = PSModel(model, client)
            client.control.speeds = {0: 3.0, 1: 1.0}  # as heartbeats would have answered
            balance = BatchBalance(ps, 4)
            n = balance.next_batch()
            rows = slice(0, n) if r == 0 else slice(4 - n, 4)
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) * balance.weight
            loss.backward()
            ps.step()
            ps.synchronize()
            out[r] = (n, [p.detach().clone() for p in model.parameters()])
            ps.close()
        except BaseException as err:  # noqa: BLE001 - raised by the test below
            out[r] = err

    run_ranks(rank)
    for r in (0, 1):
        if isinstance(out[r], BaseException):
            raise out[r]
    assert [out[r][0] for r in (0, 1)] == [3, 1]
    for r in (0, 1):
        for got, want in zip(out[r][1], local.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
