"""Learning-rate schedules, shared by shards (which apply updates) and workers (which apply
sync 1-bit Adam's published momenta with the shard's learning rate, and benches' DDP peers).

A schedule maps the clock an update is for (0-based: the first optimizer step is clock 0) to a
factor of the configured learning rate. Shards evaluate it at the clock of the push (async/ssp)
or of the aggregated step (sync), so every mode follows the same curve in clocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule"]


@dataclass(kw_only=True, frozen=True)
class LRSchedule:
    """Linear warm-up, then cosine decay (or constant).

    ``factor(c)`` is ``(c + 1) / warmup_steps`` for ``c < warmup_steps``; then, with
    ``decay_steps > 0``, ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` where
    ``p = (c - warmup_steps) / (decay_steps - warmup_steps)`` clamped to [0, 1]; else 1.
    The default (no warm-up, no decay) is the constant learning rate.
    """

    warmup_steps: int = 0
    """Clocks of linear warm-up from ``lr / warmup_steps`` to ``lr``."""
    decay_steps: int = 0
    """The clock at which the cosine reaches ``min_ratio * lr`` (and stays); 0 = no decay.
    Must exceed ``warmup_steps`` when set."""
    min_ratio: float = 0.0
    """The factor the cosine ends at."""

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.decay_steps, int) or self.decay_steps < 0:
            raise ValueError(f"decay_steps must be an int >= 0, got {self.decay_steps!r}")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps must exceed warmup_steps={self.warmup_steps} "
                             f"(or be 0 for no decay), got {self.decay_steps}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {self.min_ratio}")

    @property
    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay_steps == 0

    def factor(self, clock: int) -> float:
        """The learning-rate factor of the update for ``clock`` (negative clocks: as 0)."""
        c = max(int(clock), 0)
        if c < self.warmup_steps:
            return (c + 1) / self.warmup_steps
        if not self.decay_steps:
            return 1.0
        p = min((c - self.warmup_steps) / (self.decay_steps - self.warmup_steps), 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
