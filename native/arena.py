"""What every arena allocator (``native.buddy``, ``native.bestfit``) offers: pure bookkeeping of
byte offsets inside one pre-reserved arena, no memory of its own.

    a = BuddyAllocator(64 << 20, min_block=4 << 20, max_block=2 << 30, trim=True)
    off = a.alloc(5 << 20)        # an offset, or None when nothing fits
    a.free(off)
    a.check()                     # raises AllocatorError if an invariant is broken

Statistics are the three usual fragmentation numbers (docs/benchmarks.md, Memory) at the
moment asked: internal = 1 - requested / allocated, external = 1 - largest free / total free, and
the high-water mark (the arena a run needed) for the overhead factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Allocator", "AllocatorError", "ArenaStats", "check_tiling", "in_range"]


class AllocatorError(RuntimeError):
    """A broken invariant, or a free of an offset that is not allocated."""

    @classmethod
    def not_allocated(cls, offset: int) -> AllocatorError:
        return cls(f"free of offset {offset}: not an allocation (double free, or an offset "
                   f"inside one)")


@dataclass(frozen=True)
class ArenaStats:
    """One instant's occupancy of an arena, in bytes."""

    capacity: int
    requested: int
    """Sum of the sizes callers asked for, over live allocations."""
    allocated: int
    """Sum of the blocks handed out for them (rounding included)."""
    free: int
    """Free bytes in the whole arena."""
    largest_free: int
    high_water: int
    """Highest end offset any allocation has reached: the arena this run needed."""
    live: int
    """Live allocations."""
    free_in_range: int
    """Free bytes below :attr:`high_water` (the holes between what was used)."""
    largest_free_in_range: int
    """Largest free block below :attr:`high_water` (clipped to it)."""

    @property
    def internal(self) -> float:
        """1 - requested / allocated (rounding waste; 0 when nothing is live)."""
        return 1.0 - self.requested / self.allocated if self.allocated else 0.0

    @property
    def external(self) -> float:
        """1 - largest free block / total free, inside the range used so far (0 when none of
        it is free). Counting the untouched rest of a large arena would make any arena look
        fragmented once its largest block is capped (a buddy's ``max_block``)."""
        if not self.free_in_range:
            return 0.0
        return 1.0 - self.largest_free_in_range / self.free_in_range


def check_tiling(pieces: list[tuple[int, int]], managed: int, capacity: int) -> None:
    """Raise :class:`AllocatorError` unless the used and free ``(offset, size)`` pieces tile
    ``[0, managed)`` exactly (no overlap, no hole) and ``managed <= capacity``."""
    pos = 0
    for off, size in sorted(pieces):
        if off != pos:
            raise AllocatorError(f"blocks overlap or leave a hole at offset {pos} (next block "
                                 f"at {off})")
        pos = off + size
    if pos != managed or pos > capacity:
        raise AllocatorError(f"blocks cover {pos} bytes; the arena manages {managed} of "
                             f"{capacity}")


def in_range(free_blocks: list[tuple[int, int]], high_water: int) -> tuple[int, int]:
    """(free bytes, largest free block) of ``free_blocks`` below ``high_water``."""
    sizes = [min(size, high_water - off) for off, size in free_blocks if off < high_water]
    return sum(sizes), max(sizes, default=0)


class Allocator(Protocol):
    """The interface ``worker.memory.pool.ActivationPool`` and the memory bench use."""

    capacity: int
    requested: int
    """Bytes callers asked for, over live allocations. This, :attr:`allocated` and
    :attr:`high_water` are plain attributes, cheap to read on every call."""
    allocated: int
    high_water: int

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
