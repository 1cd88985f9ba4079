"""Dynamic local updates (DyLU; Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135): each local-SGD worker sizes its rounds from measured speed, so that a
slow worker's pseudo-gradient arrives about as often as a fast one's instead of being many outer
updates stale::

    H_i = max(1, round(H * v_i / v_max))        (halves round up; never above H)

``v_i`` is this worker's speed: inner steps per second over its last few rounds, timed from a
round's start (its parameters landed) to its exchange, so the forward, backward and inner steps
count and waiting for the shards does not. ``v_max`` is the fastest live worker's: every worker
reports its speed in its heartbeats (``HeartbeatRequest.steps_per_s``) and each shard answers
with the fastest live one's (``HeartbeatReply.max_steps_per_s``), which the control client keeps
(``ControlClient.fastest_steps_per_s``). Until a speed is known a round is H steps.

:func:`dynamic_inner_steps` is the sizing; :class:`DynamicSteps` measures and sizes for
``LocalSGD(adaptive=True)`` (``bitps-worker --inner-steps-adaptive``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["DynamicSteps", "SpeedBoard", "dynamic_inner_steps"]


def dynamic_inner_steps(inner_steps: int, speed: float, fastest: float) -> int:
    """A worker's inner steps for its next round: ``inner_steps`` (H) scaled by its ``speed``
    over the ``fastest`` worker's (``max(speed, fastest)``: this worker counts), rounded half up,
    at least 1; H while either speed is unknown (0)."""
    if inner_steps < 1:
        raise ValueError(f"inner_steps is {inner_steps}; expected >= 1")
    if not (speed > 0 and fastest > 0):
        return inner_steps
    return max(1, min(inner_steps, math.floor(inner_steps * speed / max(speed, fastest) + 0.5)))


class SpeedBoard(Protocol):
    """Where speeds are exchanged: ``ControlClient`` (its heartbeats carry them)."""

    steps_per_s: float
    """This worker's speed, reported to the shards."""
    fastest_steps_per_s: float
    """The fastest live worker's speed, as the shards last answered (0: unknown)."""


class DynamicSteps:
    """Measures a worker's rounds and sizes the next one (:func:`dynamic_inner_steps`). Call
    :meth:`start` when a round starts, :meth:`finish` when its last inner step is done (before
    the exchange), then :meth:`next_steps`. ``clock`` is injectable for tests."""

    def __init__(self, inner_steps: int, board: SpeedBoard, *, rounds: int = 4,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if rounds < 1:
            raise ValueError(f"rounds is {rounds}; expected >= 1")
        self.inner_steps, self.board, self._clock = inner_steps, board, clock
        self._rounds: deque[tuple[int, float]] = deque(maxlen=rounds)
        self._start = clock()

    @property
    def speed(self) -> float:
        """Inner steps per second over the measured rounds (0 before the first)."""
        seconds = sum(s for _, s in self._rounds)
        return sum(n for n, _ in self._rounds) / seconds if seconds > 0 else 0.0

    def start(self) -> None:
        self._start = self._clock()

    def finish(self, steps: int) -> None:
        """A round of ``steps`` inner steps ends now: measure it and report the speed."""
        elapsed = self._clock() - self._start
        if elapsed > 0:
            self._rounds.append((steps, elapsed))
            self.board.steps_per_s = self.speed

    def next_steps(self) -> int:
        return dynamic_inner_steps(self.inner_steps, self.speed, self.board.fastest_steps_per_s)
