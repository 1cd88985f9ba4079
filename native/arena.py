"""What every arena allocator (``native.buddy``, ``native.bestfit``) offers: pure bookkeeping of
byte offsets inside one pre-reserved arena, no memory of its own.

    a = BuddyAllocator(64 << 20, min_block=4 << 20, max_block=2 << 30, trim=True)
    off = a.alloc(5 << 20)        # an offset, or None when nothing fits
    a.free(off)
    a.check()                     # raises AllocatorError if an invariant is broken

Statistics are the three fragmentation numbers of ``reference/pipeline_memory.md`` §B5 at the
moment asked: internal = 1 - requested / allocated, external = 1 - largest free / total free, and
the high-water mark (the arena a run needed) for the overhead factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Allocator", "AllocatorError", "ArenaStats"]


class AllocatorError(RuntimeError):
    """A broken invariant, or a free of an offset that is not allocated."""


@dataclass(frozen=True)
class ArenaStats:
    """One instant's occupancy of an arena, in bytes."""

    capacity: int
    requested: int
    """Sum of the sizes callers asked for, over live allocations."""
    allocated: int
    """Sum of the blocks handed out for them (rounding included)."""
    free: int
    largest_free: int
    high_water: int
    """Highest end offset any allocation has reached: the arena this run needed."""
    live: int
    """Live allocations."""

    @property
    def internal(self) -> float:
        """1 - requested / allocated (rounding waste; 0 when nothing is live)."""
        return 1.0 - self.requested / self.allocated if self.allocated else 0.0

    @property
    def external(self) -> float:
        """1 - largest free block / total free (0 when nothing is free)."""
        return 1.0 - self.largest_free / self.free if self.free else 0.0


class Allocator(Protocol):
    """The interface ``worker.pool.ActivationPool`` and the memory bench use."""

    capacity: int

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a region of at least ``nbytes`` (> 0), or None when none is free."""

    def free(self, offset: int) -> None:
        """Return the allocation at ``offset``; :class:`AllocatorError` if there is none."""

    def stats(self) -> ArenaStats:
        """Occupancy now."""

    def blocks(self) -> list[tuple[int, int]]:
        """Live ``(offset, allocated size)`` pieces, sorted by offset."""

    def check(self) -> None:
        """Raise :class:`AllocatorError` unless every invariant holds."""
