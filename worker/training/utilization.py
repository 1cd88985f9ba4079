"""Step timing: how long each step took, how much of it the training thread waited for
communication, and the overlap decision built on those numbers.

A step is the interval between two ``PSModel.step()`` returns, so it holds the forward (with the
waits for pulled parameters when overlap is on), the backward and the step itself. *Exposed*
communication is time the training thread spent waiting for the shards (or sending on their
behalf); *compute* is the rest; *communication* is the union of the intervals during which any
push/pull was under way, hidden or not. On CUDA these are host-side times: they count GPU idle
only where the host waits, which is where ``PSModel`` waits.

    timer = StepTimer()
    with timer.exposed():
        handle.wait()
    stats = timer.end_step(comm_s=...)
    stats.utilization      # (wall - exposed) / wall
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Decision", "StepStats", "StepTimer", "decide", "settled"]


@dataclass(frozen=True)
class StepStats:
    """One step's times, in seconds."""

    wall_s: float
    exposed_s: float
    """Training thread waiting for (or working for) communication."""
    comm_s: float
    """Communication under way, overlapped or not."""
    overlapped: bool

    @property
    def compute_s(self) -> float:
        return max(self.wall_s - self.exposed_s, 0.0)

    @property
    def utilization(self) -> float:
        """Share of the step the training thread computed: (wall - exposed) / wall."""
        return self.compute_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def overlap_ratio(self) -> float:
        """Share of the communication hidden behind compute: 1 - exposed / comm."""
        if self.comm_s <= 0:
            return 0.0
        return min(max(1.0 - self.exposed_s / self.comm_s, 0.0), 1.0)

    @property
    def comm_compute_ratio(self) -> float:
        return self.comm_s / self.compute_s if self.compute_s > 0 else float("inf")


class StepTimer:
    """Accumulates one step's exposed time; :meth:`end_step` closes the step."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._exposed = 0.0

    @contextlib.contextmanager
    def exposed(self) -> Iterator[None]:
        """Time the block as exposed communication."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._exposed += time.perf_counter() - t0

    def end_step(self, *, comm_s: float, overlapped: bool) -> StepStats:
        """Close the step that began at the previous call (or at construction)."""
        now = time.perf_counter()
        stats = StepStats(wall_s=now - self._start, exposed_s=self._exposed, comm_s=comm_s,
                          overlapped=overlapped)
        self._start, self._exposed = now, 0.0
        return stats


@dataclass(frozen=True)
class Decision:
    """The outcome of ``auto`` overlap: the measured ratio against the threshold."""

    enabled: bool
    ratio: float
    """Median communication / compute over the measured steps."""
    min_ratio: float
    reason: str = ""
    """What decided instead of the ratio (a forced mode, or why overlap cannot run); empty
    when the ratio decided."""

    def describe(self) -> str:
        verdict = "on" if self.enabled else "off"
        if self.reason:
            return f"overlap {verdict}: {self.reason}"
        rel = ">" if self.enabled else "<="
        return (f"overlap {verdict}: communication is {self.ratio:.3f} of compute "
                f"({rel} overlap_min_ratio {self.min_ratio:g})")


def _ratio(s: StepStats) -> float:
    return s.exposed_s / s.compute_s if s.compute_s > 0 else float("inf")


def settled(steps: Sequence[StepStats], min_ratio: float, probe_steps: int) -> bool:
    """Whether :func:`decide` over ``probe_steps`` measured steps is already known from the
    first ``steps``: more than half of ``probe_steps`` lie on one side of ``min_ratio``, so the
    median of all of them does too, whatever the rest measure (and the median of these lies
    on that side as well). With the default 3 a clear case costs 2 slow steps, not 3."""
    above = sum(_ratio(s) > min_ratio for s in steps)
    return len(steps) >= probe_steps or max(above, len(steps) - above) > probe_steps // 2


def decide(steps: Sequence[StepStats], min_ratio: float, reason: str = "") -> Decision:
    """Overlap pays when communication exceeds ``min_ratio`` of compute (the problem
    statement's 20 % rule); ``steps`` were measured with overlap off, so their communication
    was all exposed. ``reason`` forces it off (and is reported)."""
    if not steps:
        raise ValueError("decide() needs at least one measured step")
    ratio = statistics.median(_ratio(s) for s in steps)
    return Decision(enabled=not reason and ratio > min_ratio, ratio=ratio,
                    min_ratio=min_ratio, reason=reason)
