"""``Updates``: how a validated push reaches a key's parameters, and the count of updates made.

The consistency mode decides *when* and *at what learning-rate scale* a push is applied
(``ps.consistency``); this applies it through the update rule (``ps.rules``) and counts it, so
a mode never calls back into the shard core:

- :meth:`Updates.on_arrival` (async, SSP): one push, applied as it arrives;
- :meth:`Updates.aggregate` (sync): a key's step, once every live pusher's push of it is in,
  applied as their mean.

Everything here runs under the shard core's lock, from the data loop's thread or, for a
push's keys, from the key pool's threads (``native.keypool``): each call touches one key, and the
count and the metrics, shared by every key, are updated under :attr:`Updates.lock`.
"""

from __future__ import annotations

import threading

import numpy as np

from bitps.ps.config import ServerConfig
from bitps.ps.metrics import ShardMetrics
from bitps.ps.rules import UpdateRule
from bitps.ps.store import Slot

__all__ = ["Updates"]


class Updates:
    """Applies pushes to slots through ``rule`` and counts them (:attr:`applied`)."""

    def __init__(self, rule: UpdateRule, cfg: ServerConfig, metrics: ShardMetrics) -> None:
        self.rule, self.cfg, self.metrics = rule, cfg, metrics
        self.lock = threading.Lock()
        """Serializes the count and the metrics (hot-path metrics need one writer at a time)."""
        self.applied = 0
        """Updates made since the shard started (or as its checkpoint had it)."""

    def on_arrival(self, slot: Slot, grad: np.ndarray, clock: int, lr_scale: float, *,
                   clock_gap: int, version_gap: int,
                   weight_decay: float | None = None) -> None:
        """Apply one push of step ``clock`` at ``lr_scale`` times the learning rate (and the
        push's own ``weight_decay``, if it has one); the gaps (the push's clock ahead of the
        slowest live worker, the key's version ahead of the one the gradient was computed on)
        are its staleness, for the metrics."""
        self.rule.arrived(slot, clock)
        if weight_decay is None:
            self.rule.update(slot, grad, clock=clock, lr_scale=lr_scale)
        else:  # only rules that take them get here (ps.checks)
            self.rule.update(slot, grad, clock=clock, lr_scale=lr_scale,
                             weight_decay=weight_decay)
        self._count(clock_gap, version_gap)

    def aggregate(self, slot: Slot, live: list[int]) -> bool:
        """sync: apply the mean of ``slot``'s pushes once every one of ``live`` (the key's live
        pushers, ``ClockTable.key_pushers``) is in; whether it did."""
        if not slot.pushed or not slot.pushed.issuperset(live):
            return False
        grad, n = slot.step_sum()
        # the step being applied is clock slot.version; its pushes' own lr, or the schedule's
        opt, hyper = self.cfg.optimizer, slot.step_hyper
        if hyper is None:
            self.rule.update(slot, grad, clock=slot.version, grad_scale=1.0 / n,
                             lr_scale=opt.schedule.factor(slot.version))
        else:  # only rules that take them get here (ps.checks)
            self.rule.update(slot, grad, clock=slot.version, grad_scale=1.0 / n,
                             lr_scale=hyper[0] / opt.lr, weight_decay=hyper[1])
        slot.end_step()
        self._count(0, 0)
        self.rule.aggregated(slot)
        return True

    def _count(self, clock_gap: int, version_gap: int) -> None:
        with self.lock:
            self.applied += 1
            self.metrics.updates.inc()
            self.metrics.clock_gap.observe(max(clock_gap, 0))
            self.metrics.version_gap.observe(max(version_gap, 0))
