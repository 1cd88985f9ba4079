"""Consistency modes as objects: when a push is applied and when a pull is answered.

One class per mode, registered by its ``ServerConfig.mode`` name; :class:`~bitps.ps.shard.
ShardCore` holds one (:func:`make_consistency`) and asks it, never comparing mode names (a mode
sees the core through :class:`Core`):

- :class:`Sync` (BSP): the pushes of one clock are averaged and applied once, when every live
  worker's push of that clock is in; a pull for step ``c`` waits until its keys reach version
  ``c``.
- :class:`Async` (ASP): every push is applied on arrival; every pull is answered at once.
- :class:`SSP`: as async, but a pull for step ``c`` waits until every live worker has clock
  ``>= c - S`` (``ServerConfig.staleness``), so no worker computes on parameters more than S
  steps ahead of the slowest live one.

**Per key, only its pushers count.** A pipeline stage registers only its own stage's keys (a
partial plan), so each key knows the ranks whose plan has it (``Slot.pushers``);
:func:`key_pushers` gives the live ones, plus ranks of the world that have not registered yet
(their plan is unknown, so they are waited for as before). A sync step of a key waits for and
averages over the key's live pushers, an SSP pull waits only for the live pushers of the keys it
asks for, and async splits the learning rate over the key's live pushers. With whole plans
every live worker pushes every key, as before.

Async and SSP apply each push with the learning rate split over the key's live pushers
(``ServerConfig.split_lr``), optionally damped by the push's version gap, and answer float32
pulls ahead (``ServerConfig.lookahead``). How a push is applied (the update rule and its
phases) is ``ps.updates.Updates``'s business; a mode only decides when and at what
learning-rate scale, and never calls back into the core: the core asks it once per push
(:meth:`Consistency.take_push`: check, then apply) and once per pull (:meth:`Consistency.admit`).

Everything here runs under the core's lock, from the data loop's thread.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError
from bitps.ps.clocks import ClockTable
from bitps.ps.compensation import make_compensation
from bitps.ps.config import CONSISTENCY, ServerConfig
from bitps.ps.store import Slot

if TYPE_CHECKING:
    from bitps.native.keypool import KeyPool
    from bitps.ps.metrics import ShardMetrics
    from bitps.ps.updates import Updates

__all__ = ["CONSISTENCY", "SSP", "Async", "Consistency", "Core", "Sync", "hyperparameters",
           "key_pushers", "make_consistency", "register"]


class Core(Protocol):
    """What a mode reads of the shard core (``ps.shard.ShardCore`` is one; the core calls in
    here, so this module does not import it). It reads, and applies through
    :attr:`updates`; it calls no method of the core."""

    clocks: ClockTable
    slots: dict[int, Slot]
    updates: Updates
    """Applies a push (``ps.updates``)."""
    key_pool: KeyPool
    """Runs a push's per-key work on the shard's threads (``native.keypool``)."""
    partial: bool
    """Whether some worker's plan lacks some of the keys (only then do a key's pushers differ
    from the live ranks)."""


def key_pushers(clocks: ClockTable, slots: Sequence[Slot],
                live: Sequence[int] | None = None) -> list[int]:
    """The live ranks that a step of ``slots`` counts (``ClockTable.key_pushers``)."""
    return clocks.key_pushers(slots, live)


def _pushers(core: Core, slot: Slot, live: list[int]) -> list[int]:
    """``slot``'s live pushers; ``live`` itself when no plan is partial."""
    return core.clocks.key_pushers((slot,), live) if core.partial else live


def hyperparameters(header: pb.DataHeader, i: int) -> tuple[float, float] | None:
    """The ``(lr, weight_decay)`` a push carries for its ``i``-th key (``DataHeader.lr``,
    checked by ``ps.checks``), or ``None``: the shard's own."""
    return (header.lr[i], header.weight_decay[i]) if header.lr else None


def _shown(hyper: tuple[float, float] | None) -> str:
    return "the shard's (none sent)" if hyper is None else f"({hyper[0]!r}, {hyper[1]!r})"


def depends_on(clocks: ClockTable, slot: Slot, ranks: Collection[int] | None) -> bool:
    """Whether ``slot``'s step may wait for one of ``ranks`` (``None``: any rank)."""
    return ranks is None or any(r in slot.pushers or not clocks.workers[r].registered
                                for r in ranks if r in clocks.workers)


class Consistency:
    """One consistency mode. Subclass, set :attr:`name`, and :func:`register` it."""

    name: ClassVar[str]
    ordered: ClassVar[bool] = False
    """Admission is ordered by clock: whenever a pull for step ``c`` is admitted, so is every
    pull for a step below ``c`` (whatever its keys), so held pulls are looked at lowest clock
    first and no further than the first still waiting (``ps.held``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg

    # -- pulls ---------------------------------------------------------------------------------
    def admit(self, clocks: ClockTable, clock: int, slots: list[Slot], *,
              metrics: ShardMetrics) -> bool:
        """The core's one question for a pull (answered now, or each time a held one is looked
        at again): :meth:`admits`, and when it does, :meth:`observe_admission`."""
        if not self.admits(clocks, clock, slots):
            return False
        self.observe_admission(metrics, clocks, clock, slots)
        return True

    def admits(self, clocks: ClockTable, clock: int, slots: list[Slot]) -> bool:
        """May a pull for step ``clock`` of ``slots`` be answered now? Decided on the clock
        table and the slots' versions only: held pulls are looked at again when one of those
        may have changed (a clock, the live set, a push)."""
        raise NotImplementedError

    def waiting_for(self, clocks: ClockTable, worker: int, clock: int,
                    slots: list[Slot]) -> str:
        """What a held pull waits for, in words (``DEADLINE`` errors, Status)."""
        raise NotImplementedError

    def waited_ranks(self, clocks: ClockTable, clock: int, slots: list[Slot]) -> list[int]:
        """The live ranks a held pull for ``clock`` of ``slots`` waits for (``bitps-status``
        names them); none by default."""
        return []

    def rejoin_step(self, slots: Sequence[Slot]) -> int:
        """``RegisterReply.step`` for a worker that re-registers ``slots`` after it was
        dropped (its peers went on without it): the step whose push this shard takes next
        from it, when the mode has one (sync); 0 otherwise. A worker that was not dropped is
        answered 0 (its clock, ``start_clock``, says where it is)."""
        return 0

    def start_clock(self, rank: int, slots: Sequence[Slot], clock: int) -> int:
        """``RegisterReply.start_clock`` for ``rank`` re-registering ``slots``, whose clock on
        this shard is ``clock`` (its last pull's): that clock, unless the mode knows the
        shard holds its pushes of later steps (sync, below)."""
        return clock

    def holds_pulls(self, world_size: int) -> bool:
        """Whether a worker's pull may be held in this mode: ``RegisterReply.holds_pulls``
        (SSP says no because it holds only behind a slower peer, which the worker cannot
        plan for)."""
        return False

    @property
    def looks_ahead(self) -> bool:
        """Whether float32 pulls get the parameters moved ahead (``ServerConfig.lookahead``)."""
        return False

    @property
    def takes_codes(self) -> bool:
        """Whether a push may reach the update rule still a code (``ps.pushcode``): the mode
        reads none of its values (sync sums a step's pushes in the key's store, which adds
        codes as they decode, ``Slot.accumulate``). No by default: a mode of its own says
        so."""
        return False

    def observe_admission(self, metrics: ShardMetrics, clocks: ClockTable, clock: int,
                          slots: list[Slot]) -> None:
        """A pull for step ``clock`` of ``slots`` was admitted (for the mode's own metrics;
        nothing by default)."""

    def answered(self, worker: int, slots: list[Slot], frames: list) -> None:
        """A pull of ``worker`` for ``slots`` was answered with ``frames`` (per slot: ``(frame,
        buffer)``, the frame float32 parameters, moved ahead or not, or codes); nothing by
        default (a no-op on every pull, so nothing is built for it)."""

    # -- pushes --------------------------------------------------------------------------------
    def take_push(self, core: Core, header: pb.DataHeader, slots: list[Slot], grads: list,
                  live: list[int], min_clock: int) -> None:
        """The core's one call for a push: :meth:`check_push`, then :meth:`push`. A refusal
        comes before anything here changed (the core takes back what it did before)."""
        self.check_push(header, slots)
        self.push(core, header, slots, grads, live, min_clock)

    def check_push(self, header: pb.DataHeader, slots: list[Slot]) -> None:
        """Refuse (:class:`PSError`) a push this mode cannot take; nothing has changed yet."""

    def push(self, core: Core, header: pb.DataHeader, slots: list[Slot], grads: list,
             live: list[int], min_clock: int) -> None:
        """Take one checked push of ``grads`` (decoded, one per slot), applying through
        ``core.updates``."""
        raise NotImplementedError

    def membership_changed(self, core: Core, live: list[int],
                           ranks: Collection[int] | None = None) -> None:
        """The live set changed (``ranks`` left, expired or registered a plan without some
        keys; ``None``: unknown): finish what waited for them."""


register = CONSISTENCY.register


def make_consistency(cfg: ServerConfig) -> Consistency:
    """The mode object ``cfg.mode`` names."""
    return CONSISTENCY.lookup(cfg.mode)(cfg)


@register
class Sync(Consistency):
    name = "sync"

    @property
    def takes_codes(self):
        return True  # a step's pushes are summed as they decode (Slot.accumulate)

    def admits(self, clocks, clock, slots):
        return all(s.version >= clock for s in slots)

    def waited_ranks(self, clocks, clock, slots):
        # the key's live pushers whose push of the step is missing from the first key still
        # behind
        behind = next((s for s in slots if s.version < clock), None)
        if behind is None:
            return []
        return [r for r in key_pushers(clocks, (behind,)) if r not in behind.pushed]

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return (f"worker {worker} pull for clock {clock} keys {keys}: sync step "
                f"{clock - 1} still lacks pushes from workers "
                f"{self.waited_ranks(clocks, clock, slots)}")

    def holds_pulls(self, world_size):
        return world_size > 1

    def rejoin_step(self, slots):
        # a worker dropped (silent past the timeout) while its peers went on: the steps were
        # applied without it, and its next push is for the step its keys are at now
        return min((s.version for s in slots), default=0)

    def start_clock(self, rank, slots, clock):
        # Its clock here is its last pull's. But no sync step completes without the push of
        # every live worker, so a key at version v holds its pushes of every step below v,
        # and of v too where it is among v's pushers already (acknowledged, say, before a
        # restart from a checkpoint, its next pull not seen yet). Told only ``clock``, it
        # would count those pushes as lost and push them again: refused by every key ("already
        # has this worker's push", then, the step complete, a push of a past clock) until its
        # deadline. A dropped worker's keys went on without it: ``rejoin_step`` named its
        # step, where it has pushed nothing.
        if not slots:
            return clock
        return max(clock, min(s.version + (rank in s.pushed) for s in slots))

    def check_push(self, header, slots):
        for i, slot in enumerate(slots):
            if header.clock != slot.version or header.worker in slot.pushed:
                raise PSError(pb.BAD_CLOCK, f"key {slot.spec.key}: sync push from worker "
                              f"{header.worker} at clock {header.clock}; the shard is "
                              f"aggregating clock {slot.version}"
                              + (" and already has this worker's push"
                                 if header.worker in slot.pushed else ""))
            # one step, one learning rate: ranks whose schedules disagree are refused
            mine = hyperparameters(header, i)
            if slot.pushed and slot.step_hyper != mine:
                raise PSError(pb.BAD_HYPERPARAMETERS, f"key {slot.spec.key}: sync push from "
                              f"worker {header.worker} at clock {header.clock} with (lr, "
                              f"weight_decay) {_shown(mine)}; workers "
                              f"{sorted(slot.pushed)} pushed this step with "
                              f"{_shown(slot.step_hyper)}")

    def push(self, core, header, slots, grads, live, min_clock):
        def one(i):  # one key: touches only its slot (native.keypool)
            slot, grad = slots[i], grads[i]
            if not slot.pushed:
                slot.step_hyper = hyperparameters(header, i)
            pushers = _pushers(core, slot, live)
            slot.accumulate(header.worker, grad, pushers)
            core.updates.aggregate(slot, pushers)

        core.key_pool.map(one, range(len(slots)), sum(s.nbytes for s in slots))

    def membership_changed(self, core, live, ranks=None):
        clocks = core.clocks
        for slot in core.slots.values():
            if slot.pushed and depends_on(clocks, slot, ranks):
                core.updates.aggregate(slot, _pushers(core, slot, live))


@register
class Async(Consistency):
    name = "async"
    ordered = True

    def __init__(self, cfg: ServerConfig) -> None:
        super().__init__(cfg)
        self.compensation = make_compensation(cfg)
        """How a stale push is adjusted (``ServerConfig.compensation``, ``ps.compensation``)."""
        self.by_progress = cfg.lr_by == "progress"
        """A push's learning rate is the schedule's at the key's updates over its live
        pushers, not at the push's clock (``ServerConfig.lr_by``)."""

    def admits(self, clocks, clock, slots):
        return True

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return f"worker {worker} pull for clock {clock} keys {keys}: nothing (async)"

    @property
    def looks_ahead(self):
        return self.cfg.lookahead

    @property
    def takes_codes(self):
        return not self.compensation.reads_gradient

    def push(self, core, header, slots, grads, live, min_clock):
        def one(i):  # one key: touches only its slot, its compensation state (native.keypool)
            slot, grad = slots[i], grads[i]
            vgap = slot.version - header.versions[i] if header.versions else 0
            hyper = hyperparameters(header, i)
            pushers = len(_pushers(core, slot, live))
            step = slot.version // max(pushers, 1) if self.by_progress else header.clock
            lr_scale = self.lr_scale(step, pushers, vgap, lr=None if hyper is None else hyper[0])
            grad = self.compensation.gradient(slot, grad, header.worker)
            core.updates.on_arrival(slot, grad, header.clock, lr_scale,
                                    clock_gap=header.clock - min_clock, version_gap=vgap,
                                    weight_decay=None if hyper is None else hyper[1])

        core.key_pool.map(one, range(len(slots)), sum(s.nbytes for s in slots))

    def lr_scale(self, clock: int, pushers: int, version_gap: int, *,
                 lr: float | None = None) -> float:
        """The learning-rate scale of one push of step ``clock`` of a key with ``pushers``
        live pushers, ``version_gap`` updates after the version it was computed on: the
        schedule's factor (or the push's own ``lr`` over the configured one), split over the
        pushers (``ServerConfig.split_lr``: a clock's pushes of a key share one step's
        learning rate), times the compensation's factor (``ServerConfig.compensation``)."""
        cfg = self.cfg
        scale = cfg.optimizer.schedule.factor(clock) if lr is None else lr / cfg.optimizer.lr
        if cfg.split_lr:
            scale *= 1.0 / max(pushers, 1)
        return scale * self.compensation.lr_scale(version_gap=version_gap, pushers=pushers)

    def answered(self, worker, slots, frames):
        if not self.compensation.snapshots:
            return
        for slot, (frame, _) in zip(slots, frames):
            values = frame if isinstance(frame, np.ndarray) and frame.dtype == np.float32 \
                and frame.shape == slot.param.shape else slot.param  # codes: the exact values
            self.compensation.handed(slot, worker, values)


@register
class SSP(Async):
    name = "ssp"

    def admits(self, clocks, clock, slots):
        need = clock - self.cfg.staleness
        if need <= 0:
            return True
        pushers = key_pushers(clocks, slots)
        return not pushers or clocks.min_clock_of(pushers) >= need

    def laggards(self, clocks: ClockTable, clock: int,
                 slots: Iterable[Slot] | None = None) -> list[int]:
        """Live ranks whose clock is below what a pull for step ``clock`` (of ``slots``: only
        their live pushers count; ``None``: every live rank) needs."""
        ranks = None if slots is None else key_pushers(clocks, slots)
        return clocks.below(clock - self.cfg.staleness, ranks)

    def waited_ranks(self, clocks, clock, slots):
        return self.laggards(clocks, clock, slots)

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return (f"worker {worker} pull for clock {clock} keys {keys}: SSP bound "
                f"{self.cfg.staleness} needs every live worker pushing these keys at clock >= "
                f"{clock - self.cfg.staleness}; behind: "
                + ", ".join(f"worker {r} at {clocks.workers[r].clock}"
                            for r in self.laggards(clocks, clock, slots)))

    def observe_admission(self, metrics, clocks, clock, slots):
        # against the slowest of the keys' live pushers: what the bound was checked on
        min_clock = clocks.min_clock_of(key_pushers(clocks, slots))
        metrics.admission_gap.observe(max(clock - min_clock, 0))

