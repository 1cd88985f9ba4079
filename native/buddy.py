"""``BuddyAllocator``: a binary buddy system over byte offsets of one arena.

Blocks are powers of two from ``min_block`` to ``max_block`` bytes, naturally aligned (a block of
size S starts at a multiple of S). The arena is cut, from offset 0, into the largest aligned
power-of-two *top blocks* that fit (at most ``max_block``); capacity below ``min_block`` at the end
is unused. ``alloc(n)`` takes the lowest-addressed free block of the smallest order that fits
``n`` rounded up to a power of two, splitting larger blocks; ``free`` merges a block with its buddy
(offset XOR size) while the buddy is free, up to its top block.

With ``trim=True`` (Linux's ``alloc_pages_exact``) an allocation keeps only ``n`` rounded up to
``min_block``: the unused tail of its block goes back to the free lists as smaller blocks, and the
allocation is recorded as the pieces it kept, which ``free`` returns one by one (each merging with
its buddy). Without it a 5 MiB request holds an 8 MiB block: the 25-60 % internal waste a buddy
shows on non-power-of-two tensors (docs/benchmarks.md, Memory).

Pure bookkeeping (Python, O(log capacity) splits per call; free lists kept sorted so the lowest
offset is taken, which keeps the high-water mark low).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from bitps.native.arena import AllocatorError, ArenaStats, check_tiling, in_range

__all__ = ["BuddyAllocator"]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass
class _Allocation:
    requested: int
    pieces: list[tuple[int, int]]  # (offset, size), contiguous from the allocation's offset


class BuddyAllocator:
    """Binary buddy allocator (see the module docstring)."""

    def __init__(self, capacity: int, *, min_block: int = 4 << 20, max_block: int = 2 << 30,
                 trim: bool = False) -> None:
        if not (_is_pow2(min_block) and _is_pow2(max_block)) or min_block > max_block:
            raise ValueError(f"min_block and max_block must be powers of two with min <= max, "
                             f"got {min_block} and {max_block}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.min_block, self.max_block, self.trim = min_block, max_block, trim
        self._free: dict[int, list[int]] = {}  # size -> sorted offsets
        self._top: dict[int, int] = {}  # offset -> size of each top block
        off = 0
        while True:
            size = max_block
            while size >= min_block and (off % size or off + size > capacity):
                size //= 2
            if size < min_block:
                break
            self._top[off] = size
            self._free.setdefault(size, []).append(off)
            off += size
        self._managed = off
        self._live: dict[int, _Allocation] = {}
        self.requested = self.allocated = self.high_water = 0

    # -- alloc / free ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        need = max(self.min_block, 1 << (nbytes - 1).bit_length())
        if need > self.max_block:
            return None
        size = need
        while size <= self.max_block and not self._free.get(size):
            size *= 2
        if size > self.max_block:
            return None
        off = self._free[size].pop(0)
        while size > need:  # split: keep the left half, free the right one
            size //= 2
            self._insert(off + size, size)
        if self.trim:
            pieces = self._trim(off, size, -(-nbytes // self.min_block) * self.min_block)
        else:
            pieces = [(off, size)]
        self._live[off] = _Allocation(nbytes, pieces)
        self.requested += nbytes
        self.allocated += sum(s for _, s in pieces)
        end = pieces[-1][0] + pieces[-1][1]
        self.high_water = max(self.high_water, end)
        return off

    def _trim(self, off: int, size: int, keep: int) -> list[tuple[int, int]]:
        """Keep ``keep`` bytes (a multiple of min_block) at the head of block (off, size);
        free the rest as buddies. Returns the kept pieces."""
        pieces = []
        while keep:
            if keep == size:
                pieces.append((off, size))
                break
            half = size // 2
            if keep <= half:
                self._insert(off + half, half)  # the tail half is unused
            else:
                pieces.append((off, half))  # the head half is used whole
                off, keep = off + half, keep - half
            size = half
        return pieces

    def free(self, offset: int) -> None:
        a = self._live.pop(offset, None)
        if a is None:
            raise AllocatorError.not_allocated(offset)
        self.requested -= a.requested
        for off, size in a.pieces:
            self.allocated -= size
            self._release(off, size)

    def _release(self, off: int, size: int) -> None:
        while self._top.get(off) != size:  # merge up to the top block
            buddy = off ^ size
            lst = self._free.get(size)
            i = bisect.bisect_left(lst, buddy) if lst else 0
            if not lst or i == len(lst) or lst[i] != buddy:
                break
            del lst[i]
            off, size = min(off, buddy), size * 2
        self._insert(off, size)

    def _insert(self, off: int, size: int) -> None:
        bisect.insort(self._free.setdefault(size, []), off)

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> ArenaStats:
        free = self._managed - self.allocated
        largest = max((s for s, lst in self._free.items() if lst), default=0)
        free_in, largest_in = in_range(self.free_blocks(), self.high_water)
        return ArenaStats(capacity=self.capacity, requested=self.requested,
                          allocated=self.allocated, free=free, largest_free=largest,
                          high_water=self.high_water, live=len(self._live),
                          free_in_range=free_in, largest_free_in_range=largest_in)

    def blocks(self) -> list[tuple[int, int]]:
        return sorted(p for a in self._live.values() for p in a.pieces)

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free ``(offset, size)`` blocks, sorted by offset."""
        return sorted((o, s) for s, lst in self._free.items() for o in lst)

    def top_blocks(self) -> list[tuple[int, int]]:
        """The blocks a fully free arena consists of."""
        return sorted(self._top.items())

    def check(self) -> None:
        used = self.blocks()
        free = self.free_blocks()
        for off, size in used + free:
            if not _is_pow2(size) or size < self.min_block or size > self.max_block:
                raise AllocatorError(f"block ({off}, {size}) is not a power of two in "
                                     f"[{self.min_block}, {self.max_block}]")
            if off % size:
                raise AllocatorError(f"block ({off}, {size}) is not aligned to its size")
        check_tiling(used + free, self._managed, self.capacity)
        free_set = set(free)
        for off, size in free:
            buddy = off ^ size
            if self._top.get(off) != size and (buddy, size) in free_set:
                raise AllocatorError(f"free buddies ({off}, {size}) and ({buddy}, {size}) "
                                     f"were not merged")
        if sum(s for _, s in used) != self.allocated:
            raise AllocatorError("allocated byte count disagrees with the live blocks")
        if sum(a.requested for a in self._live.values()) != self.requested:
            raise AllocatorError("requested byte count disagrees with the live allocations")
