"""The pulls a shard holds back, and when to look at them again.

A pull the consistency mode does not admit yet waits here until a push, a clock or a change of
the live set admits it, or its deadline passes (``ps.shard``). Looking at every held pull on
every request made a flood of held pulls quadratic: 5,000 of them cost a shard 7.6 s of CPU.
So :meth:`HeldPulls.release` looks again only when something a mode decides on has changed
(the caller's ``state``: the clock table's generation and the count of pushes taken) or a
deadline is due, and, when the mode's admission is ordered by clock (SSP: admitted at clock c
means admitted below c), stops at the first pull still waiting, lowest clock first.

Each worker may have at most ``limit`` pulls held (``ServerConfig.max_held_pulls``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bitps.proto import bitps_pb2 as pb

__all__ = ["HeldPull", "HeldPulls"]


@dataclass(order=True)
class HeldPull:
    """One held pull: who asked (routing id and header), for which step and slots, since when,
    and until when it may wait. Ordered by clock, then arrival."""

    clock: int
    seq: int
    ident: bytes = field(compare=False)
    header: pb.DataHeader = field(compare=False)
    slots: list = field(compare=False)
    since: float = field(compare=False)
    deadline: float = field(compare=False)


class HeldPulls:
    """Held pulls, lowest clock first; ``len()`` and iteration as a list of :class:`HeldPull`."""

    def __init__(self, *, limit: int) -> None:
        self.limit = limit
        self._heap: list[HeldPull] = []
        self._per_worker: dict[int, int] = {}
        self._seq = itertools.count()
        self._state: object = None
        self._next_deadline = math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[HeldPull]:
        return iter(sorted(self._heap))

    def __eq__(self, other: object) -> bool:  # compares as the list it replaced
        return list(self) == list(other) if isinstance(other, (list, HeldPulls)) \
            else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def count(self, worker: int) -> int:
        """Pulls of ``worker`` held now."""
        return self._per_worker.get(worker, 0)

    def full(self, worker: int) -> bool:
        return self.count(worker) >= self.limit

    def hold(self, ident: bytes, header: pb.DataHeader, clock: int, slots: list,
             since: float, deadline: float) -> None:
        """Hold one more pull (the caller checked :meth:`full`)."""
        heapq.heappush(self._heap, HeldPull(clock, next(self._seq), ident, header, slots,
                                            since, deadline))
        self._per_worker[header.worker] = self.count(header.worker) + 1
        self._next_deadline = min(self._next_deadline, deadline)

    def release(self, admits: Callable[[int, list], bool], *, state: object, now: float,
                ordered: bool) -> tuple[list[HeldPull], list[HeldPull]]:
        """``(admitted, expired)``: the pulls ``admits(clock, slots)`` (the consistency mode's
        question, ``Consistency.admit``) lets go now and those past their
        deadline, both removed. Nothing is looked at unless ``state`` differs from the last
        call's or a deadline is due; with ``ordered``, a change is looked at lowest clock first
        until the first pull ``admits`` refuses."""
        if not self._heap:
            return [], []
        due = now >= self._next_deadline
        if state == self._state and not due:
            return [], []
        self._state = state
        if ordered and not due:
            admitted = []
            while self._heap and admits(self._heap[0].clock, self._heap[0].slots):
                admitted.append(self._pop())
            return admitted, []
        admitted, expired, kept = [], [], []
        for h in sorted(self._heap):
            if admits(h.clock, h.slots):
                admitted.append(h)
            elif now >= h.deadline:
                expired.append(h)
            else:
                kept.append(h)
        self._heap = kept  # sorted, hence a heap
        for h in admitted + expired:
            self._forget(h.header.worker)
        self._next_deadline = min((h.deadline for h in kept), default=math.inf)
        return admitted, expired

    def _pop(self) -> HeldPull:
        h = heapq.heappop(self._heap)
        self._forget(h.header.worker)
        return h

    def _forget(self, worker: int) -> None:
        n = self._per_worker[worker] - 1
        if n:
            self._per_worker[worker] = n
        else:
            del self._per_worker[worker]
