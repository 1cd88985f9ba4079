"""``BestFitAllocator``: best-fit with immediate coalescing over byte offsets of one arena, the
comparison point for ``native.buddy`` (same interface, ``native.arena``).

Requests are rounded up to ``align`` bytes. ``alloc`` takes the smallest free range that fits (the
lowest-addressed among equals) and carves the allocation from its start; ``free`` merges the range
with free neighbours on both sides. Internal waste is at most ``align - 1`` bytes per allocation;
what it can suffer from is external fragmentation (free space in pieces too small to use).

Pure bookkeeping: free ranges kept sorted by offset (O(free ranges) per call).
"""

from __future__ import annotations

import bisect

from bitps.native.arena import AllocatorError, ArenaStats, check_tiling, in_range

__all__ = ["BestFitAllocator"]


class BestFitAllocator:
    """Best-fit, coalescing allocator (see the module docstring)."""

    def __init__(self, capacity: int, *, align: int = 512) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity, self.align = capacity, align
        managed = capacity // align * align
        self._starts: list[int] = [0] if managed else []  # free ranges, sorted by offset
        self._sizes: dict[int, int] = {0: managed} if managed else {}
        self._managed = managed
        self._live: dict[int, tuple[int, int]] = {}  # offset -> (requested, size)
        self.requested = self.allocated = self.high_water = 0

    def alloc(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        size = -(-nbytes // self.align) * self.align
        best = None
        for off in self._starts:
            s = self._sizes[off]
            if s >= size and (best is None or s < self._sizes[best]):
                best = off
                if s == size:
                    break
        if best is None:
            return None
        rest = self._sizes.pop(best) - size
        i = bisect.bisect_left(self._starts, best)
        if rest:
            self._starts[i] = best + size
            self._sizes[best + size] = rest
        else:
            del self._starts[i]
        self._live[best] = (nbytes, size)
        self.requested += nbytes
        self.allocated += size
        self.high_water = max(self.high_water, best + size)
        return best

    def free(self, offset: int) -> None:
        entry = self._live.pop(offset, None)
        if entry is None:
            raise AllocatorError.not_allocated(offset)
        requested, size = entry
        self.requested -= requested
        self.allocated -= size
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == offset + size:  # merge the right one
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        if i and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:  # and left
            self._sizes[self._starts[i - 1]] += size
            return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    def stats(self) -> ArenaStats:
        free_in, largest_in = in_range(self.free_blocks(), self.high_water)
        return ArenaStats(capacity=self.capacity, requested=self.requested,
                          allocated=self.allocated, free=self._managed - self.allocated,
                          largest_free=max(self._sizes.values(), default=0),
                          high_water=self.high_water, live=len(self._live),
                          free_in_range=free_in, largest_free_in_range=largest_in)

    def blocks(self) -> list[tuple[int, int]]:
        return sorted((o, s) for o, (_, s) in self._live.items())

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free ``(offset, size)`` ranges, sorted by offset."""
        return [(o, self._sizes[o]) for o in self._starts]

    def check(self) -> None:
        if self._starts != sorted(self._sizes):
            raise AllocatorError("free range index disagrees with the free ranges")
        free = self.free_blocks()
        for (o1, s1), (o2, _) in zip(free, free[1:]):
            if o1 + s1 == o2:
                raise AllocatorError(f"adjacent free ranges at {o1} and {o2} were not merged")
        pieces = self.blocks() + free
        for off, size in pieces:
            if off % self.align or size % self.align or size <= 0:
                raise AllocatorError(f"range ({off}, {size}) is not aligned to {self.align}")
        check_tiling(pieces, self._managed, self.capacity)
        if sum(s for _, s in self._live.values()) != self.allocated or \
                sum(r for r, _ in self._live.values()) != self.requested:
            raise AllocatorError("byte counts disagree with the live allocations")
