"""The costs of ``bitps-bench scale``'s model measured again beside each measured point.

This machine's speed moves between a run's start, where the model's costs are measured, and
a point a few minutes later (by 2-5x between runs: ``bench/results/scale-rerun-1206/``), so
each point can carry the CPU costs measured around it (:class:`Beside`):

- just before the point: the scheme's in-process costs (``scale_costs.measure_costs``), the
  shard's contention, the in-process per-message figures and the wire's CPU
  (``scale_cluster.measure_wire_cpu``: per byte crossing and per message);
- just after it: the in-process costs again.

From them the row reports the prediction from the costs beside (:func:`beside_costs`: the
mean of before and after; :func:`beside_wire`), how far they moved from the run's start
(:meth:`Beside.drift`), and how much they differ before and after the one point
(:meth:`Beside.spread`), which bounds how closely any prediction made from them can hold.
What the link's rate sets (efficiency, round trip) and the wire sizes do not move with the
machine's speed and stay the rate's.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from bitps.bench.scale_cluster import measure_wire_cpu
from bitps.bench.scale_costs import beyond, measure_contention, measure_costs, per_message
from bitps.bench.scale_model import SchemeCosts, WireCosts

__all__ = ["Beside", "beside_costs", "beside_wire", "spread_summary"]

_PER_BYTE = ("shard_fixed", "shard_per_push", "encode", "apply")
"""The :class:`SchemeCosts` fields measured in process (the rest are wire sizes)."""


def beside_costs(start: SchemeCosts, measured: list[SchemeCosts], *,
                 contention: float) -> SchemeCosts:
    """``start`` with its in-process costs the mean of ``measured`` (field by field) and the
    contention measured beside; ``start`` itself when nothing was measured."""
    if not measured:
        return start
    return dataclasses.replace(
        start, contention=contention,
        **{f: float(np.mean([getattr(c, f) for c in measured])) for f in _PER_BYTE})


def beside_wire(wire: WireCosts, cpu: dict | None, *, shard_handle: float,
                worker_thread: float) -> WireCosts:
    """``wire`` with the CPU fields measured beside (``cpu``: ``measure_wire_cpu``'s), less
    the in-process per-message figures measured beside (``scale_costs.beyond``); ``wire``
    itself when nothing was measured."""
    if cpu is None:
        return wire
    return beyond(dataclasses.replace(wire, **cpu), shard_handle, worker_thread)


def _total_ms(figures: dict) -> float:
    """One measurement's in-process figures summed (the shard at every worker count, the
    encode, the apply), ms."""
    return sum(figures["shard_ms"].values()) + figures["encode_ms"] + figures["apply_ms"]


class Beside:
    """The CPU costs measured around one point (module docstring): built just before the point
    (``rounds`` rounds; 0: nothing is measured and every figure is the start's), then
    :meth:`after` just after it. ``start``: the scheme's costs measured at the run's start."""

    def __init__(self, cluster, name: str, start: SchemeCosts, *, keys: int, n: int,
                 workers: tuple[int, ...], rounds: int) -> None:
        self.name, self.start, self.keys, self.n = name, start, keys, n
        self.workers, self.rounds = workers, rounds
        self.measured: list[SchemeCosts] = []
        self.figures: dict = {}
        self.wire_cpu: dict | None = None
        self.contention = start.contention
        self.handle_s = self.thread_s = 0.0
        if not rounds:
            return
        self._in_process("before")
        self.contention = measure_contention((name,), keys=keys, n=n,
                                             cores=os.cpu_count() or 1, rounds=rounds)[name]
        self.handle_s, self.thread_s = per_message(rounds)
        sizes = tuple(sorted({round(b * 4 * n) for b in (start.push_bytes, start.pull_bytes)}))
        self.wire_cpu, _ = measure_wire_cpu(cluster, echo_keys=keys, message_sizes=sizes,
                                            rounds=rounds, tiny_steps=1000)
        self.figures.update(contention=round(self.contention, 3),
                            message_cpu_us=round(self.wire_cpu["message_cpu"] * 1e6, 1))

    def _in_process(self, when: str) -> None:
        costs, figures = measure_costs((self.name,), keys=self.keys, n=self.n,
                                       workers=self.workers, rounds=self.rounds)
        self.measured.append(costs[self.name])
        self.figures[when] = figures[self.name]

    def after(self) -> None:
        """Measure the in-process costs again, the point done."""
        if self.rounds:
            self._in_process("after")

    def costs(self) -> SchemeCosts:
        return beside_costs(self.start, self.measured, contention=self.contention)

    def wire(self, wire: WireCosts) -> WireCosts:
        """``wire`` (the rate's, measured with the start's per-message figures subtracted)
        with the CPU measured beside."""
        return beside_wire(wire, self.wire_cpu, shard_handle=self.handle_s,
                           worker_thread=self.thread_s)

    def drift(self, wire: WireCosts) -> str:
        """The costs beside over the run start's (the shard's step at one worker, the
        worker's encode and apply, a message's CPU against ``wire``'s); "" unmeasured."""
        if not self.measured:
            return ""
        c, s, w = self.costs(), self.start, self.wire(wire)

        def ratio(now: float, then: float) -> str:
            return f"{now / then:.2f}" if then > 0 else "-"

        shard = ratio(c.shard_fixed + c.shard_per_push, s.shard_fixed + s.shard_per_push)
        return (f"shard {shard}, worker {ratio(c.encode + c.apply, s.encode + s.apply)}, "
                f"message {ratio(w.message_cpu, wire.message_cpu)}")

    def spread(self) -> float | None:
        """The in-process costs after the point over those before it, summed (1.0: the
        machine ran at one speed around the point); ``None`` unmeasured."""
        if len(self.measured) < 2:
            return None
        return round(_total_ms(self.figures["after"]) / _total_ms(self.figures["before"]), 3)


def spread_summary(spreads: list[float | None], tolerance: float) -> dict | None:
    """Over the points' :meth:`Beside.spread`: the median factor the costs moved by across one
    point (after over before, or its inverse, whichever is larger) and the share of points
    where they moved by more than ``tolerance`` (``None`` if none was measured)."""
    moved = [max(s, 1 / s) for s in spreads if s]
    if not moved:
        return None
    return {"points": len(moved), "median_factor": round(float(np.median(moved)), 3),
            "beyond_tolerance": round(sum(f > 1 + tolerance for f in moved) / len(moved), 3),
            "largest_factor": round(max(moved), 3)}
