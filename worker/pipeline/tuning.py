"""Dynamic micro-batching between steps, across one replica's stage processes.

After each step every stage of a replica contributes its measured per-micro-batch times (the
runtime's ``StepReport.times``) and its step's wall time; :class:`DynamicMicroBatch` gathers them
over the replica's process group, feeds them to a
:class:`~bitps.worker.pipeline.microbatch.MicroBatchTuner` (the slowest stage's wall is the
step's, which calibrates the tuner's simulator), and returns the size the next step runs
with. Every stage holds the same gathered times (in stage order) and the tuner is a pure
function of what it observed, so every stage of the replica adopts the same size without a
further message. The samples per step stay fixed: the next step
runs ``samples_per_step // size`` micro-batches.

    dyn = DynamicMicroBatch(tuner, num_stages=p, group=replica_group)
    for step in range(steps):
        m = dyn.samples_per_step // dyn.size
        report = runtime.run_step(schedule.generate(p, m)[stage], ...)
        dyn.after_step(report.times, report.wall_s)   # collective over the replica's group

Replicas tune independently (each its own group): what the shards aggregate is a step's
gradient, whatever micro-batches it was accumulated from.
"""

from __future__ import annotations

import dataclasses

from bitps.worker.pipeline.microbatch import MicroBatchTuner
from bitps.worker.pipeline.simulate import StageTimes

__all__ = ["DynamicMicroBatch", "FixedMicroBatch"]


class FixedMicroBatch:
    """The micro-batch size when dynamic micro-batching is off: the configured one, always.
    The same surface as :class:`DynamicMicroBatch`, so the step loop has one shape."""

    def __init__(self, size: int, samples_per_step: int) -> None:
        if size < 1 or samples_per_step % size:
            raise ValueError(f"micro-batch size {size} must be >= 1 and divide the "
                             f"{samples_per_step} samples per step")
        self.size, self.samples_per_step = size, samples_per_step

    def after_step(self, times: StageTimes, wall_s: float | None = None) -> int:
        return self.size


class DynamicMicroBatch:
    """Gathers every stage's times after a step, asks the tuner, adopts its size.

    ``group``: the ``torch.distributed`` group of this replica's stages, ranked in stage order
    (None: the default group, for a single replica). ``after_step`` is collective over it:
    every stage of the replica calls it after every step.
    """

    def __init__(self, tuner: MicroBatchTuner, *, num_stages: int, group=None,
                 warmup_steps: int = 1) -> None:
        if tuner.p != num_stages:
            raise ValueError(f"the tuner plans for p={tuner.p} stages, the replica has "
                             f"{num_stages}")
        self.tuner, self.num_stages, self.group = tuner, num_stages, group
        self.warmup_steps = warmup_steps
        """Steps whose times are not observed: the first runs several times slower (allocator
        and autograd warm-up: 2.5 s against 0.4 s on the deep model), which would make its size
        look worst for good."""
        self._steps = 0
        self.size = tuner.current
        """The micro-batch size in use (the next step's, after :meth:`after_step`)."""
        self.samples_per_step = tuner.samples_per_step
        self.history: list[int] = [self.size]
        """The size of every step run so far, and the next one's last."""

    def after_step(self, times: StageTimes, wall_s: float | None = None) -> int:
        """Record this stage's ``times`` (and ``wall_s``, its step's wall time) of the step just
        run at :attr:`size` with every other stage's, and return the size of the next step
        (every stage gets the same)."""
        import torch.distributed as dist

        self._steps += 1
        if self._steps <= self.warmup_steps:  # the same on every stage: no message needed
            self.history.append(self.size)
            return self.size
        gathered: list[tuple | None] = [None] * self.num_stages
        dist.all_gather_object(gathered, (dataclasses.astuple(times), wall_s), group=self.group)
        walls = [w for _, w in gathered]
        step_s = max(walls) if all(w is not None and w > 0 for w in walls) else None
        self.tuner.observe(self.size, [StageTimes(*t) for t, _ in gathered], step_s)
        self.size = self.tuner.choose()
        self.history.append(self.size)
        return self.size
