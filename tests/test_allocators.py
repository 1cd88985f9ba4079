"""Arena allocators (``native.buddy``, ``native.bestfit``): property tests over random
alloc/free sequences (hypothesis), sizes scaled down, plus the exact cases the docstrings state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitps.native.arena import AllocatorError
from bitps.native.bestfit import BestFitAllocator
from bitps.native.buddy import BuddyAllocator

MIN, MAX, ALIGN = 16, 256, 16

ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 2 * MAX)),
                         st.tuples(st.just("free"), st.integers(0, 10_000))), max_size=120)


def _make(kind: str, capacity: int):
    if kind == "bestfit":
        return BestFitAllocator(capacity, align=ALIGN)
    return BuddyAllocator(capacity, min_block=MIN, max_block=MAX, trim=kind == "buddy+trim")


def _run(a, sequence):
    """Apply ``sequence``; after every step check the invariants from outside the allocator.
    Returns the live ``offset -> requested`` map."""
    live: dict[int, int] = {}
    for op, n in sequence:
        if op == "alloc":
            off = a.alloc(n)
            if off is None:
                continue
            assert off not in live
            assert off + n <= a.capacity, "allocation runs past the arena"
            align = MIN if isinstance(a, BuddyAllocator) else ALIGN
            assert off % align == 0
            for o, r in live.items():  # no overlap between what callers may touch
                assert off + n <= o or o + r <= off, f"[{off}, +{n}) overlaps [{o}, +{r})"
            live[off] = n
        elif live:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        a.check()
        s = a.stats()
        assert s.requested == sum(live.values()) and s.live == len(live)
        assert s.requested <= s.allocated <= a.capacity
        assert s.allocated + s.free <= a.capacity and s.largest_free <= s.free
    return live


@pytest.mark.parametrize("kind", ["buddy", "buddy+trim", "bestfit"])
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 1500), sequence=ops)
def test_random_sequences_keep_every_invariant_and_coalesce_back(kind, capacity, sequence):
    a = _make(kind, capacity)
    initial = a.free_blocks()
    live = _run(a, sequence)
    for off in list(live):
        a.free(off)
    a.check()
    assert a.free_blocks() == initial, "freeing everything did not restore the arena"
    if kind == "bestfit":
        assert len(initial) <= 1  # one free arena
    else:
        assert initial == a.top_blocks()


def test_buddy_rounds_to_powers_of_two_and_trim_returns_the_tail():
    plain = BuddyAllocator(1024, min_block=16, max_block=1024)
    off = plain.alloc(300)  # 512-byte block
    assert off == 0 and plain.blocks() == [(0, 512)]
    assert plain.stats().internal == pytest.approx(1 - 300 / 512)
    trim = BuddyAllocator(1024, min_block=16, max_block=1024, trim=True)
    assert trim.alloc(300) == 0  # 304 bytes kept: 256 + 32 + 16
    assert trim.blocks() == [(0, 256), (256, 32), (288, 16)]
    assert trim.stats().allocated == 304
    assert trim.alloc(100) is not None and trim.alloc(600) is None
    trim.free(0)
    trim.check()


def test_buddy_top_blocks_follow_capacity_and_max_block():
    a = BuddyAllocator(1000, min_block=16, max_block=256)
    # 8 bytes at the end are below min_block and stay unused
    assert a.top_blocks() == [(0, 256), (256, 256), (512, 256), (768, 128), (896, 64),
                              (960, 32)]
    assert a.alloc(257) is None  # above max_block


def test_bestfit_picks_the_smallest_hole_and_merges_neighbours():
    a = BestFitAllocator(1024, align=16)
    x, y, z = a.alloc(100), a.alloc(200), a.alloc(40)
    a.free(x)  # hole of 112 at 0
    a.free(z)  # merges with the tail
    assert a.alloc(90) == 0  # smallest hole that fits
    a.free(0)
    a.free(y)
    assert a.free_blocks() == [(0, 1024)]


@pytest.mark.parametrize("make", [lambda: BuddyAllocator(256, min_block=16, max_block=256),
                                  lambda: BestFitAllocator(256, align=16)])
def test_bad_frees_and_sizes_get_typed_errors(make):
    a = make()
    off = a.alloc(10)
    with pytest.raises(AllocatorError, match="not an allocation"):
        a.free(off + 16)
    a.free(off)
    with pytest.raises(AllocatorError, match="double free"):
        a.free(off)
    with pytest.raises(ValueError, match="nbytes"):
        a.alloc(0)


def test_stats_give_the_three_fragmentation_numbers():
    a = BuddyAllocator(256, min_block=16, max_block=256)
    offs = [a.alloc(16) for _ in range(16)]
    for off in offs[::2]:
        a.free(off)
    s = a.stats()
    assert s.free == 128 and s.largest_free == 16
    assert s.external == pytest.approx(1 - 16 / 128)
    assert s.high_water == 256
