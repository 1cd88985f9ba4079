"""Sleep-based pipeline stages of fixed duration, for measuring schedules rather than hosts.

:class:`SleepStage` is an ``nn.Module`` with one trainable parameter ``weight`` (shape ``(1,)``,
initially 1): ``forward(x) = x * weight``, the output shaped like the input. Each phase of its
work sleeps for a fixed time and records the interval it was busy:

- ``F``: the forward sleeps ``t_f``;
- ``B``: the input-backward (the gradient of ``x``) sleeps ``t_b``;
- ``W``: the weight-backward (the gradient of ``weight``) sleeps ``t_w``.

B and W are separable: the input path and the weight path are two autograd Functions that meet
only in the product, so ``torch.autograd.grad(y, x, g, retain_graph=True)`` runs B alone and a
later ``torch.autograd.grad(y, [weight], g)`` runs W alone, as a schedule that splits the
backward (ZB-H1; torch's ``stage_backward_input`` / ``stage_backward_weight``) does. A full
backward (``y.backward(g)``) runs both. The B sleep runs only when the input's gradient is
computed, so stage 0 costs ``t_b`` only when its input has ``requires_grad=True`` (torch's first
stage runs B inside its W action, as a full backward; give it such an input too).

Sleeping releases the CPU, so several stage processes share a few cores without contention and
the measured bubble depends on the schedule, not on the machine. The intervals go to the
process-wide :data:`RECORDER` (or the recorder passed in); a bench clears it before a step and
reads busy time and in-flight micro-batches from it after.

Example::

    stage = SleepStage(0.02, 0.02, 0.02, stage=1)
    x = torch.ones(4, 8, requires_grad=True)
    y = stage(x)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)   # B
    (gw,) = torch.autograd.grad(y, [stage.weight], torch.ones_like(y))         # W
    RECORDER.busy_s()  # about 0.06
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
from torch import nn

__all__ = ["RECORDER", "BusyRecorder", "Interval", "SleepStage"]

KINDS = ("F", "B", "W")


@dataclasses.dataclass(frozen=True)
class Interval:
    """One busy interval: ``kind`` in ``F``/``B``/``W``, the recording stage's label, and
    ``time.perf_counter()`` at its start and end (seconds)."""

    kind: str
    stage: int
    start: float
    end: float


class BusyRecorder:
    """The busy intervals of the stages in this process, in the order they ended. Thread-safe
    (autograd may run a backward on another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[Interval] = []

    def record(self, kind: str, stage: int, start: float, end: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"interval kind {kind!r}: expected one of {KINDS}")
        with self._lock:
            self._intervals.append(Interval(kind, stage, start, end))

    def clear(self) -> None:
        with self._lock:
            self._intervals.clear()

    def intervals(self, since: float = float("-inf")) -> list[Interval]:
        """The intervals that started at or after ``since``, in the order they ended."""
        with self._lock:
            return [iv for iv in self._intervals if iv.start >= since]

    def busy_s(self, since: float = float("-inf")) -> float:
        """Total busy seconds of the intervals since ``since`` (a rank's stages never overlap,
        so the sum is the rank's busy time)."""
        return sum(iv.end - iv.start for iv in self.intervals(since))

    def mean_s(self, kind: str, since: float = float("-inf")) -> float:
        """Mean duration of the ``kind`` intervals since ``since`` (0.0 if none)."""
        spans = [iv.end - iv.start for iv in self.intervals(since) if iv.kind == kind]
        return sum(spans) / len(spans) if spans else 0.0

    def peak_inflight(self, since: float = float("-inf"), *, until: str = "B",
                      weights: dict[int, float] | None = None) -> float:
        """The most micro-batches whose forward had ended and whose ``until`` interval had
        not, at any moment since ``since``: with ``until="B"`` (the input-backward) the
        activations a stage holds for its backward, with ``until="W"`` also those a deferred
        weight-backward still needs (a full backward records both). ``weights`` gives each
        stage label's share of one micro-batch's activations (a rank that runs two half-size
        chunks counts each at 0.5); every stage counts 1 by default."""
        if until not in ("B", "W"):
            raise ValueError(f"peak_inflight until={until!r}: expected 'B' or 'W'")
        weights = weights or {}
        events = sorted(
            (iv.end, 1 if iv.kind == "F" else -1, iv.stage)
            for iv in self.intervals(since) if iv.kind in ("F", until))
        level = peak = 0.0
        for _, sign, stage in events:
            level += sign * weights.get(stage, 1.0)
            peak = max(peak, level)
        return peak


RECORDER = BusyRecorder()
"""The recorder of this process's stages unless one is given to :class:`SleepStage`."""


def _busy(recorder: BusyRecorder, kind: str, stage: int, seconds: float) -> None:
    start = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    recorder.record(kind, stage, start, time.perf_counter())


class _InputPath(torch.autograd.Function):
    """Identity on the input; forward sleeps ``t_f`` (F), backward sleeps ``t_b`` (B)."""

    @staticmethod
    def forward(ctx, x, stage_ref):
        ctx.stage_ref = stage_ref
        _busy(stage_ref.recorder, "F", stage_ref.stage, stage_ref.t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ref = ctx.stage_ref
        _busy(ref.recorder, "B", ref.stage, ref.t_b)
        return grad, None


class _WeightPath(torch.autograd.Function):
    """Identity on the weight; backward sleeps ``t_w`` (W). Runs only when the weight is
    differentiated."""

    @staticmethod
    def forward(ctx, weight, stage_ref):
        ctx.stage_ref = stage_ref
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        ref = ctx.stage_ref
        _busy(ref.recorder, "W", ref.stage, ref.t_w)
        return grad, None


class SleepStage(nn.Module):
    """A pipeline stage whose F, B and W each sleep a fixed time (seconds) and record it.

    ``stage`` labels the recorded intervals (a rank holding two chunks gives each its own).
    Any input shape works; the output has the input's shape. Raises ValueError on a negative
    duration.
    """

    def __init__(self, t_f: float, t_b: float, t_w: float, *, stage: int = 0,
                 recorder: BusyRecorder | None = None) -> None:
        super().__init__()
        for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
            if not value >= 0:
                raise ValueError(f"SleepStage {name}={value!r}: expected seconds >= 0")
        self.t_f, self.t_b, self.t_w = float(t_f), float(t_b), float(t_w)
        self.stage = stage
        self.recorder = recorder if recorder is not None else RECORDER
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two Functions meeting only in the product: differentiating x never reaches the
        # weight path's backward, and differentiating the weight never reaches the input's
        return _InputPath.apply(x, self) * _WeightPath.apply(self.weight, self)

    def extra_repr(self) -> str:
        return f"t_f={self.t_f}, t_b={self.t_b}, t_w={self.t_w}, stage={self.stage}"
