"""Balanced stages: cut a model's layers into contiguous pipeline stages by measured cost.

:func:`balance` is the exact min-max contiguous partition (dynamic programming over prefix
sums, O(n^2 * parts)): no other cut into ``parts`` contiguous, non-empty stages has a smaller
slowest stage. Costs are what a profiling run measured per layer (forward + backward time), not
parameter counts, which misjudge embeddings and heads.

Among the cuts with the same slowest stage it returns the one with the smallest sum of squared
stage costs (the most even), and among those the one whose cuts come earliest, so the result is
a function of the costs alone.

Example::

    balance([1, 1, 1, 1, 10], 3)   # [range(0, 2), range(2, 4), range(4, 5)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bitps.worker.pipeline.errors import PartitionError

__all__ = ["balance", "imbalance", "uniform"]


def balance(costs: Sequence[float], parts: int) -> list[range]:
    """The layer ranges of ``parts`` contiguous stages minimising the slowest stage's cost
    (ties: the most even, then the earliest cuts). Raises :class:`PartitionError` for
    ``parts < 1``, ``parts > len(costs)`` or a negative or non-finite cost."""
    _check(costs, parts)
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(j: int, i: int) -> float:
        return prefix[i] - prefix[j]

    # Phase 1: the optimal slowest stage. best[k][i]: layers 0..i-1 in k stages.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            best[k][i] = min(max(best[k - 1][j], cost(j, i)) for j in range(k - 1, i))
    bound = best[parts][n]
    # Phase 2: among cuts whose every stage is within the bound, the smallest sum of squares.
    # (The bound is one of the cost(j, i) values computed the same way, so <= is exact.)
    sq = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[-1] * (n + 1) for _ in range(parts + 1)]
    sq[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                c = cost(j, i)
                if c <= bound and sq[k - 1][j] + c * c < sq[k][i]:
                    sq[k][i], cut[k][i] = sq[k - 1][j] + c * c, j
    ranges = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        ranges.append(range(j, i))
        i = j
    return ranges[::-1]


def uniform(num_layers: int, parts: int) -> list[range]:
    """``parts`` contiguous stages of as equal a layer count as possible (the first stages take
    the remainder): the ``balance="uniform"`` choice, for when no profile exists."""
    _check([0.0] * num_layers, parts)
    size, extra = divmod(num_layers, parts)
    ranges, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        ranges.append(range(start, end))
        start = end
    return ranges


def imbalance(costs: Sequence[float], ranges: Sequence[range]) -> float:
    """Slowest stage cost over mean stage cost (1.0: perfectly even; 1.0 for all-zero costs)."""
    totals = [sum(costs[i] for i in r) for r in ranges]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def _check(costs: Sequence[float], parts: int) -> None:
    if parts < 1:
        raise PartitionError(f"parts must be at least 1, got {parts}", layers=len(costs),
                             parts=parts)
    if parts > len(costs):
        raise PartitionError(f"every stage needs at least one layer, so parts must be at most "
                             f"{len(costs)}", layers=len(costs), parts=parts)
    for i, c in enumerate(costs):
        if not (math.isfinite(c) and c >= 0):
            raise PartitionError(f"layer {i} cost {c!r}: expected a finite number >= 0",
                                 layers=len(costs), parts=parts)
