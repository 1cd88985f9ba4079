"""Batch balancing: each step, a global batch split over the workers by their measured speed, so
that a slow worker gets fewer samples instead of holding every other worker to its pace.

A persistent straggler holds a sync job, and an SSP job past its bound, to the slow worker's
step: with equal batches the fast workers wait. Sizing each worker's batch to its speed keeps
the global batch (the samples one step averages) and lets every worker finish its share at
about the same time, so the clocks advance together and nobody waits (the batch-size analogue
of local SGD's dynamic inner steps, ``worker.algorithms.dylu``; load-balanced BSP, Chen et al.
2020, "Semi-Dynamic Load Balancing: Efficient Distributed Learning in Non-Dedicated
Environments").

**The split** (:func:`balanced_shares`): integers ``n_i >= 1`` summing to the global batch ``B``
that minimise the slowest worker's compute, ``max_i n_i / v_i`` for speeds ``v_i`` in samples
per second. Every rank computes the whole split from the same table and takes its own share,
so ranks that see the same speeds agree and the shares sum to ``B``.

**The speeds**: each worker's samples per second of compute over its last few steps, from
``PSModel``'s own step timing (``PSModel.last_stats``: a step's wall time less the time it
waited for communication, the forward's waits for pulled parameters under overlap included,
so a fast worker held by its peers does not read as slow). Each worker reports its speed in
its heartbeats (``HeartbeatRequest.samples_per_s``) and each shard answers with every live
worker's (``HeartbeatReply.samples_per_s``), which the control client keeps
(``ControlClient.speeds``). Until every rank of the world has reported one, the split is even
(the remainder to the lowest ranks); so it is again while a rank is gone (left, or dropped for
silence: the shards answer for live workers only).

**Agreement**: speeds jitter from step to step, and a heartbeat round can reach two ranks on
either side of a new report. So that ranks agree, a rank keeps its split until the table's best
one would cut the slowest worker's compute by more than ``margin`` (5 %) against it, judged on
the same table. Where two ranks judge a switch on tables either side of a report, their shares
can sum to ``B`` +- a few for the steps until the next heartbeat: rare where a step takes about
a heartbeat period, common where many steps fit in one (docs/algorithms.md).

**Weighting**: a sync shard averages the workers' pushes with equal weight; a worker that scales
its loss by :attr:`BatchBalance.weight` (``n_i W / B``) makes that average the mean over the
global batch's samples, as with equal batches. Rules that normalise each worker's own moments
(1-bit Adam with worker moments) are unaffected by the factor.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bitps.worker.training.model import PSModel

__all__ = ["BatchBalance", "SampleBoard", "balanced_shares"]


def balanced_shares(total: int, speeds: Sequence[float]) -> list[int]:
    """Split ``total`` samples over workers of ``speeds`` (samples per second): integers >= 1
    summing to ``total`` that minimise ``max_i n_i / speeds[i]``.

    One sample each, then every further sample to the worker that would finish soonest with it
    (``(n_i + 1) / v_i``; the lower rank on a tie): this greedy is optimal for the bottleneck
    objective and deterministic. If any speed is unknown (not a positive finite number) the
    split is even, the remainder to the lowest ranks."""
    workers = len(speeds)
    if workers < 1:
        raise ValueError("speeds is empty; expected one speed per worker")
    if total < workers:
        raise ValueError(f"total is {total}; expected at least one sample per worker "
                         f"(>= {workers})")
    if not _known(speeds):
        even, extra = divmod(total, workers)
        return [even + (i < extra) for i in range(workers)]
    shares = [1] * workers
    heap = [(2 / v, i) for i, v in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(total - workers):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / speeds[i], i))
    return shares


class SampleBoard(Protocol):
    """Where speeds are exchanged: ``ControlClient`` (its heartbeats carry them)."""

    samples_per_s: float
    """This worker's speed, reported to the shards."""
    speeds: dict[int, float]
    """Every live worker's reported speed by rank, as the shards last answered."""


class BatchBalance:
    """This rank's share of a global batch of ``global_batch`` samples, step by step, from the
    speeds the workers measure and exchange (module docstring)::

        balance = BatchBalance(ps_model, global_batch=64)
        for step in range(steps):
            n = balance.next_batch()        # this step's share
            loss = loss_fn(model, *take(n)) * balance.weight
            loss.backward()
            ps_model.step()

    ``ps_model`` is the rank's ``PSModel`` (its steps' timing gives the speed, its client the
    rank, the world size and the board); ``window``: the steps a speed is measured over;
    ``margin``: how much a new split must cut the slowest worker's compute to replace the
    current one."""

    def __init__(self, ps_model: PSModel, global_batch: int, *, window: int = 4,
                 margin: float = 0.05) -> None:
        cfg = ps_model.client.cfg
        if global_batch < cfg.world_size:
            raise ValueError(f"global_batch is {global_batch}; expected at least one sample per "
                             f"worker (>= world_size {cfg.world_size})")
        if window < 1:
            raise ValueError(f"window is {window}; expected >= 1")
        if not 0 <= margin < 1:
            raise ValueError(f"margin is {margin}; expected 0 <= margin < 1")
        self.margin = margin
        self.ps_model = ps_model
        self.board: SampleBoard = ps_model.client.control
        self.rank, self.world_size, self.global_batch = cfg.rank, cfg.world_size, global_batch
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._seen = ps_model.last_stats
        # PSModel's step timer runs from its construction: its first step's time is not one
        # step's compute
        self._first = ps_model.last_stats is None
        self.shares = balanced_shares(global_batch, [0.0] * cfg.world_size)
        """The whole split of the last :meth:`next_batch`, by rank."""
        self._table: list[float] = []
        self._best = self.shares  # balanced_shares of _table: a table changes once a heartbeat

    @property
    def share(self) -> int:
        """This rank's samples in the current step."""
        return self.shares[self.rank]

    @property
    def weight(self) -> float:
        """The factor for this rank's loss that makes a sync average of the workers' gradients
        the mean over the global batch: ``share * world_size / global_batch``."""
        return self.share * self.world_size / self.global_batch

    @property
    def speed(self) -> float:
        """Samples per second of compute over the measured steps (0 before the first)."""
        seconds = sum(s for _, s in self._steps)
        return sum(n for n, _ in self._steps) / seconds if seconds > 0 else 0.0

    def next_batch(self) -> int:
        """This rank's share of the step starting now, from the speeds last exchanged (even
        until every rank reported one). The step before it, if it ran since the last call, is
        measured first and the speed reported."""
        stats = self.ps_model.last_stats
        if stats is not None and stats is not self._seen:
            self._seen = stats
            if not self._first and stats.compute_s > 0:
                self._steps.append((self.share, stats.compute_s))
                self.board.samples_per_s = self.speed
            self._first = False
        table = [self.board.speeds.get(r, 0.0) for r in range(self.world_size)]
        if table != self._table:
            self._table, self._best = table, balanced_shares(self.global_batch, table)
        best = self._best
        if not _known(table) or _slowest(best, table) < (1 - self.margin) * _slowest(
                self.shares, table):
            self.shares = best
        m = self.ps_model.client.metrics
        with m.lock:
            m.batch_share.set(self.share)
            m.compute_speed.set(self.speed)
        return self.share


def _known(speeds: Sequence[float]) -> bool:
    return all(math.isfinite(v) and v > 0 for v in speeds)


def _slowest(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """The slowest worker's compute under ``shares`` (seconds, at known ``speeds``)."""
    return max(n / v for n, v in zip(shares, speeds))
