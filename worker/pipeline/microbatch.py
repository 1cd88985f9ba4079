"""Dynamic micro-batching: pick the micro-batch size that minimises the predicted step time,
keeping the samples per step (per replica) fixed, from measured per-stage times.

:class:`MicroBatchTuner` is pure (no clock, no torch): the runtime measures a step at the size
it runs, calls :meth:`~MicroBatchTuner.observe`, and between steps asks
:meth:`~MicroBatchTuner.choose` which size to run next.

How it decides:

- **Candidates**: sizes ``b`` in ``[minimum, maximum]`` that divide the samples per step ``G``
  and whose ``m = G / b`` the schedule accepts for ``p`` stages (``Schedule.check``).
- **Model**: per stage and op (``f``, ``b``, ``w``, ``pull``, ``push``) a line
  ``t(b) = a + c * b``, least squares over the sizes measured (each size's times are an
  exponential moving average of its observations, weight ``smoothing`` on the newest). With one
  size measured, ``f``, ``b`` and ``w`` are taken as proportional to ``b`` (``a = 0``: compute
  scales with samples) and ``pull``/``push`` as constant (they move weights, not samples). A
  fitted time is never below 0.
- **Prediction**: :meth:`~MicroBatchTuner.predict` simulates the schedule (``simulate``) with the
  modelled times at ``b``, ``m = G / b``, and returns the time of one step in steady state
  (the makespan of three steps minus that of two, so a flush-free schedule's overlap counts).
- **Calibration**: the simulator assumes each stage computes on its own device. Where stages
  share compute (several stage processes on a few CPU cores, or one GPU), idle stages lend
  their share to busy ones and the simulated bubble is not paid in full. So when an observation
  comes with the measured wall time of its step (``observe(..., step_s=...)``), the tuner keeps,
  per measured size, the ratio of measured to simulated step time (a moving average), and
  scales each prediction by that ratio, interpolated linearly in ``b`` between the measured
  sizes (the nearest one beyond them). Without measured walls the ratio is 1: the simulator's
  prediction as it is.
- **Exploration**: until both ends of the candidate range have been measured, :meth:`choose`
  returns the next unmeasured end (the smallest first), so the line spans the range rather
  than extrapolating from one side. Then it returns the predicted best; a size not measured yet
  is measured by running it.
- **Hysteresis**: once the ends are known it switches away from the size in use only if the
  predicted gain exceeds ``threshold`` (default 3 %) of the current predicted step time.
- **Drift**: when two observations in a row at a measured size differ from that size's moving
  average by more than ``drift`` (default 15 %) in the replica's compute per micro-batch (F + B
  + W summed over the stages), the other sizes' measurements are dropped as stale (they predate
  the change) and the ends are explored again; smaller or one-off changes are absorbed by the
  moving average. Why so coarse: a single op of a single stage, or one step, swings by more
  than 10 % on a shared host (measured: the deep model's 4 stages on 2 CPU cores), and a tuner
  that re-explored on each swing would spend its steps at the worst sizes.

Example::

    tuner = MicroBatchTuner(samples_per_step=64, schedule="1f1b", p=4, start=8)
    tuner.observe(8, measured_stage_times)   # one StageTimes per stage, per micro-batch
    b = tuner.choose()                       # the size to run next step
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bitps.worker.pipeline.errors import PlanError
from bitps.worker.pipeline.schedules import Schedule, get_schedule
from bitps.worker.pipeline.simulate import StageTimes, simulate

if TYPE_CHECKING:
    from bitps.worker.pipeline.config import ParallelConfig

__all__ = ["MicroBatchTuner"]

_OPS = ("f", "b", "w", "pull", "push")
_PER_SAMPLE = frozenset({"f", "b", "w"})  # ops that scale with the micro-batch's samples


class MicroBatchTuner:
    """Chooses the micro-batch size between steps; see the module docstring."""

    def __init__(self, *, samples_per_step: int, schedule: Schedule | str, p: int, start: int,
                 minimum: int = 4, maximum: int = 16, threshold: float = 0.03,
                 smoothing: float = 0.5, drift: float = 0.15, comm_s: float = 0.0) -> None:
        """``samples_per_step``: per-replica samples per step G (micro_batch_size x m at the
        start); ``start``: the size in use now (a candidate); ``comm_s``: the simulator's
        per-transfer time."""
        self.schedule = get_schedule(schedule) if isinstance(schedule, str) else schedule
        self.samples_per_step = samples_per_step
        self.p = p
        self.threshold = threshold
        self.smoothing = smoothing
        self.drift = drift
        self.comm_s = comm_s
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if threshold < 0 or drift <= 0:
            raise ValueError(f"threshold must be >= 0 and drift > 0, got {threshold}, {drift}")
        self.candidates = tuple(b for b in range(max(minimum, 1), maximum + 1)
                                if samples_per_step % b == 0 and self._accepts(b))
        if not self.candidates:
            raise PlanError(f"no micro-batch size in [{minimum}, {maximum}] divides "
                            f"{samples_per_step} samples per step into a micro-batch count the "
                            f"schedule accepts", schedule=self.schedule.name, p=p,
                            m=samples_per_step // max(start, 1))
        self._require_candidate(start)
        self.current = start
        self._measured: dict[int, list[StageTimes]] = {}
        self._ratio: dict[int, float] = {}  # measured / simulated step time, per measured size
        self._suspect: int | None = None  # the size whose last observation looked drifted
        # (held aside until the next observation says whether it was a change or a one-off)
        self._predicted: dict[int, float] = {}  # cleared by every observation

    @classmethod
    def from_config(cls, cfg: ParallelConfig, **kwargs: Any) -> MicroBatchTuner:
        """The tuner for ``cfg``: its replica batch, schedule, P, first size and [min, max]."""
        return cls(samples_per_step=cfg.replica_batch, schedule=cfg.schedule,
                   p=cfg.pipeline_parallel_size, start=cfg.micro_batch_size,
                   minimum=cfg.micro_batch_min, maximum=cfg.micro_batch_max, **kwargs)

    @property
    def measured(self) -> tuple[int, ...]:
        """The sizes whose times the model holds now."""
        return tuple(sorted(self._measured))

    def observe(self, b: int, times: Sequence[StageTimes], step_s: float | None = None) -> None:
        """Record the per-stage, per-micro-batch times measured in a step run at size ``b``,
        and (``step_s``) the step's measured wall time, which calibrates the predictions."""
        self._require_candidate(b)
        if len(times) != self.p:
            raise ValueError(f"observe: {len(times)} StageTimes for {self.p} stages")
        if step_s is not None and not step_s > 0:
            raise ValueError(f"observe: step_s must be a positive number of seconds, got "
                             f"{step_s!r}")
        self._predicted.clear()
        old = self._measured.get(b)
        drifted = old is not None and len(self._measured) > 1 and self._drifted(old, times)
        if drifted and self._suspect != b:
            # held aside, not averaged in: a one-off (other load) must not move the model
            self._suspect = b
            return
        self._suspect = None
        if drifted:
            # confirmed by a second observation: the others were measured before the change
            self._measured, self._ratio = {b: list(times)}, {}
        elif old is None:
            self._measured[b] = list(times)
        else:
            a = self.smoothing
            self._measured[b] = [
                StageTimes(**{op: a * getattr(new, op) + (1 - a) * getattr(prev, op)
                              for op in _OPS}) for new, prev in zip(times, old)]
        if step_s is not None:
            ratio = step_s / self._simulated(b)
            prev = self._ratio.get(b)
            self._ratio[b] = ratio if prev is None else \
                self.smoothing * ratio + (1 - self.smoothing) * prev
            self._predicted.clear()

    def model(self, b: int) -> list[StageTimes]:
        """The modelled per-stage times at size ``b`` (needs one observation)."""
        if not self._measured:
            raise ValueError("MicroBatchTuner.model: no observation yet")
        return [StageTimes(**{op: self._fit(s, op, b) for op in _OPS}) for s in range(self.p)]

    def predict(self, b: int) -> float:
        """The predicted time of one steady-state step at size ``b`` (seconds): the simulated
        one, times the calibration ratio at ``b`` (module docstring)."""
        self._require_candidate(b)
        if b not in self._predicted:
            self._predicted[b] = self._simulated(b) * self.calibration(b)
        return self._predicted[b]

    def calibration(self, b: int) -> float:
        """Measured over simulated step time at size ``b``: the moving average at a measured
        size, linear between measured sizes, the nearest beyond them; 1 with no walls."""
        if not self._ratio:
            return 1.0
        sizes = sorted(self._ratio)
        if b <= sizes[0]:
            return self._ratio[sizes[0]]
        if b >= sizes[-1]:
            return self._ratio[sizes[-1]]
        hi = next(x for x in sizes if x >= b)
        lo = max(x for x in sizes if x <= b)
        if hi == lo:
            return self._ratio[lo]
        t = (b - lo) / (hi - lo)
        return (1 - t) * self._ratio[lo] + t * self._ratio[hi]

    def _simulated(self, b: int) -> float:
        """The simulator's steady-state step time at ``b`` with the modelled times."""
        m = self.samples_per_step // b
        times = self.model(b)

        def makespan(steps: int) -> float:
            return simulate(self.schedule.generate(self.p, m, steps), times, self.comm_s,
                            schedule=self.schedule.name).makespan

        return makespan(3) - makespan(2)

    def choose(self) -> int:
        """The size to run next (see the module docstring: explore the ends, then the predicted
        best with hysteresis). Before any observation: the size in use."""
        if not self._measured:
            return self.current
        for end in (self.candidates[0], self.candidates[-1]):
            if end not in self._measured:
                self.current = end
                return end
        predicted = {b: self.predict(b) for b in self.candidates}
        best = min(self.candidates, key=lambda b: (predicted[b], b != self.current, b))
        now = predicted[self.current]
        if best != self.current and now - predicted[best] > self.threshold * now:
            self.current = best
        return self.current

    def _fit(self, stage: int, op: str, b: int) -> float:
        points = [(size, getattr(t[stage], op)) for size, t in self._measured.items()]
        if len(points) == 1:
            (size, t), = points
            return t * b / size if op in _PER_SAMPLE else t
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        slope = (sum((x - mx) * (y - my) for x, y in points)
                 / sum((x - mx) ** 2 for x, _ in points))
        return max(0.0, my + slope * (b - mx))

    def _drifted(self, old: Sequence[StageTimes], times: Sequence[StageTimes]) -> bool:
        def compute(ts: Sequence[StageTimes]) -> float:
            return sum(t.f + t.b + t.w for t in ts)

        got, want = compute(times), compute(old)
        return abs(got - want) > self.drift * max(want, 1e-12) and abs(got - want) > 1e-9

    def _accepts(self, b: int) -> bool:
        try:
            self.schedule.check(self.p, self.samples_per_step // b)
        except PlanError:
            return False
        return True

    def _require_candidate(self, b: int) -> None:
        if b not in self.candidates:
            raise ValueError(f"micro-batch size {b}: expected one of {self.candidates} (divides "
                             f"{self.samples_per_step} samples per step, and the "
                             f"{self.schedule.name!r} schedule accepts the micro-batch count "
                             f"for p={self.p})")
