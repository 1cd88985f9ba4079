"""Worker clocks and liveness, for the consistency modes (``ps.consistency``) to decide on.

A worker's *clock* is the number of steps it has completed as this shard has seen it: a pull for
step ``c`` (or a push_pull at step ``c - 1``) says the worker has completed ``c`` steps, and since
one DEALER->ROUTER connection is FIFO, all of its pushes for earlier steps have already arrived.

Pure and socket-free: time comes from an injected ``now`` so tests drive it by hand.

A worker is live while it has been heard from (heartbeat or data) within ``timeout_s``; ranks of
the registered world that have not shown up yet count as live from the first registration, so
``sync`` waits for them instead of racing ahead, and drops them if they never come.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

__all__ = ["ClockTable", "WorkerClock"]


@dataclass
class WorkerClock:
    """What a shard knows of one worker."""

    rank: int
    clock: int = 0
    last_seen: float = 0.0
    registered: bool = False
    left: bool = False
    dropped: bool = False
    skipped: bool = False
    """Dropped since it last registered, even if heard from again since: its peers may have
    gone on without it (``ps.registration`` names it the step they are at)."""
    steps_per_s: float = 0.0
    """The training speed its last heartbeat reported (0: none; ``HeartbeatRequest``)."""
    samples_per_s: float = 0.0
    """The samples per second of compute its last heartbeat reported (0: none)."""


class ClockTable:
    """Clocks and liveness of the workers of one shard."""

    def __init__(self, *, timeout_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.now = now
        self.workers: dict[int, WorkerClock] = {}
        self.world_size = 0
        self.generation = 0
        """Counts the changes of any clock or of the live set: what a consistency mode
        decides on has stayed the same while it has (``ps.held``)."""
        self._silent_since: float | None = None  # every live worker silent since (expire)
        self._healed_at = self._grace_until = float("-inf")  # the link back (expire)

    # -- membership ---------------------------------------------------------------------------
    def register(self, rank: int, world_size: int, start_clock: int = 0) -> None:
        """A worker joins (or rejoins); absent ranks of its world become expected."""
        t = self.now()
        self.generation += 1
        if world_size > self.world_size:
            for r in range(self.world_size, world_size):
                self.workers.setdefault(r, WorkerClock(rank=r, clock=start_clock, last_seen=t))
            self.world_size = world_size
        w = self.workers.setdefault(rank, WorkerClock(rank=rank, clock=start_clock))
        w.registered, w.left, w.dropped, w.skipped, w.last_seen = True, False, False, False, t
        w.clock = max(w.clock, start_clock)

    def leave(self, rank: int) -> None:
        if rank in self.workers:
            self.workers[rank].left = True
            self.generation += 1

    def is_registered(self, rank: int) -> bool:
        w = self.workers.get(rank)
        return w is not None and w.registered

    def is_dropped(self, rank: int) -> bool:
        """Whether ``rank`` was dropped (silent past the timeout) and has not spoken since."""
        w = self.workers.get(rank)
        return w is not None and w.dropped and not w.left

    def was_dropped(self, rank: int) -> bool:
        """Whether ``rank`` was dropped since it last registered (spoken since or not)."""
        w = self.workers.get(rank)
        return w is not None and (w.dropped or w.skipped) and not w.left

    # -- observations -------------------------------------------------------------------------
    def seen(self, rank: int, clock: int | None = None) -> tuple:
        """``rank`` was heard from; ``clock`` (steps completed) only ever moves forward.
        Returns what :meth:`unsee` needs to take it back (a request refused after this)."""
        w = self.workers[rank]
        undo = (w, w.last_seen, w.dropped, w.clock, self.generation)
        w.last_seen = self.now()
        if w.dropped and not w.left:
            w.dropped = False  # a dropped worker that speaks again is back
            self.generation += 1
        if clock is not None and clock > w.clock:
            w.clock = clock
            self.generation += 1
        return undo

    def unsee(self, undo: tuple) -> None:
        """Take back one :meth:`seen` (nothing else changed since): the request it was for was
        refused, and a refused request leaves the clocks as they were."""
        w, w.last_seen, w.dropped, w.clock, self.generation = undo

    def key_pushers(self, slots, live: Collection[int] | None = None) -> list[int]:
        """The live ranks that a step of ``slots`` (``ps.store.Slot``) counts, ascending: those
        whose registered plan has one of the keys (``Slot.pushers``), and ranks of the world
        not registered yet (their plan is unknown until they come). With whole plans, or no
        slots: every live rank. ``live``: the live ranks, when the caller has them."""
        live = self.live() if live is None else live
        if not slots:
            return list(live)
        ranks = slots[0].pushers if len(slots) == 1 else set().union(*(s.pushers for s in slots))
        workers = self.workers
        return [r for r in live if r in ranks or not workers[r].registered]

    def expire(self) -> list[int]:
        """Drop workers silent for longer than the timeout while this shard still hears
        others: a worker is dropped once another registered worker (not left) has been heard
        from after its silence passed the timeout. When every worker falls silent together
        (this shard cut off from them: a partition), none is dropped, so no sync step is
        applied without the pushes the link holds up; once one speaks again, those not heard
        since get one more timeout plus the length of the silence to speak, and the job continues
        as if nothing had happened. The silence's length counts because a connection comes
        back only at its next TCP retransmission (or connect attempt), whose interval doubles
        while the link is down: one worker can be heard up to about that long after another.
        Returns the ranks newly dropped."""
        t, gone = self.now(), []
        active = [w for w in self.workers.values() if w.registered and not w.left
                  and not w.dropped]
        latest = max((w.last_seen for w in active), default=None)
        if latest is not None and t - latest > self.timeout_s:
            if self._silent_since is None:  # every worker silent: this shard is cut off
                self._silent_since = latest
            return gone
        if self._silent_since is not None and latest is not None:
            # the link is back (someone spoke): the others get as long to speak too
            silence, self._silent_since = latest - self._silent_since, None
            self._healed_at, self._grace_until = latest, latest + self.timeout_s + silence
        for w in self.workers.values():
            if w.dropped or w.left or t - w.last_seen <= self.timeout_s:
                continue
            if w.last_seen < self._healed_at and t < self._grace_until:
                continue  # not heard since the link came back: still reconnecting
            deadline = w.last_seen + self.timeout_s
            if any(o is not w and o.registered and not o.left and o.last_seen > deadline
                   for o in self.workers.values()):
                w.dropped = w.skipped = True
                gone.append(w.rank)
                self.generation += 1
        return gone

    # -- queries ------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return sorted(r for r, w in self.workers.items() if not (w.left or w.dropped))

    def min_clock(self) -> int:
        """Smallest clock over live workers (0 when none is live)."""
        clocks = [w.clock for w in self.workers.values() if not (w.left or w.dropped)]
        return min(clocks) if clocks else 0

    def below(self, need: int, ranks: Collection[int] | None = None) -> list[int]:
        """Live ranks (of ``ranks``; ``None``: all) whose clock is below ``need``."""
        return sorted(r for r, w in self.workers.items()
                      if not (w.left or w.dropped) and w.clock < need
                      and (ranks is None or r in ranks))

    def min_clock_of(self, ranks: Collection[int]) -> int:
        """Smallest clock over the live ones of ``ranks`` (0 when none is live)."""
        clocks = [w.clock for r in ranks if (w := self.workers.get(r)) is not None
                  and not (w.left or w.dropped)]
        return min(clocks) if clocks else 0
