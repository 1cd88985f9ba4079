"""Consistency modes as objects: when a push is applied and when a pull is answered.

One class per mode, registered by its ``ServerConfig.mode`` name; :class:`~bitps.ps.shard.
ShardCore` holds one (:func:`make_consistency`) and asks it, never comparing mode names:

- :class:`Sync` (BSP): the pushes of one clock are averaged and applied once, when every live
  worker's push of that clock is in; a pull for step ``c`` waits until its keys reach version
  ``c``.
- :class:`Async` (ASP): every push is applied on arrival; every pull is answered at once.
- :class:`SSP`: as async, but a pull for step ``c`` waits until every live worker has clock
  ``>= c - S`` (``ServerConfig.staleness``), so no worker computes on parameters more than S
  steps ahead of the slowest live one.

Async and SSP apply each push with the learning rate split over the live workers
(``ServerConfig.split_lr``), optionally damped by the push's version gap, and answer float32
pulls ahead (``ServerConfig.lookahead``). How a push is applied (the update rule, 1-bit Adam's
phases) is the core's business; a mode only decides when and at what learning-rate scale.

Everything here runs under the core's lock, from the data loop's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError
from bitps.ps.clocks import ClockTable
from bitps.ps.config import CONSISTENCY, ServerConfig
from bitps.ps.store import Slot

if TYPE_CHECKING:  # the core calls in here; no import at run time
    from bitps.ps.metrics import ShardMetrics
    from bitps.ps.shard import ShardCore

__all__ = ["CONSISTENCY", "SSP", "Async", "Consistency", "Sync", "make_consistency",
           "register"]


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

    def holds_pulls(self, world_size: int) -> bool:
        """Whether a worker's pull may be held in this mode: ``RegisterReply.holds_pulls``
        (SSP says no because it holds only behind a slower peer, which the worker cannot
        plan for)."""
        return False

    @property
    def looks_ahead(self) -> bool:
        """Whether float32 pulls get the parameters moved ahead (``ServerConfig.lookahead``)."""
        return False

    def observe_admission(self, metrics: ShardMetrics, clock: int, min_clock: int) -> None:
        """A pull for step ``clock`` was answered while the slowest live worker was at
        ``min_clock``."""

    # -- pushes --------------------------------------------------------------------------------
    def check_push(self, header: pb.DataHeader, slots: list[Slot]) -> None:
        """Refuse (:class:`PSError`) a push this mode cannot take; nothing has changed yet."""

    def push(self, core: ShardCore, header: pb.DataHeader, slots: list[Slot], grads: list,
             live: list[int], min_clock: int) -> None:
        """Take one validated push of ``grads`` (decoded, one per slot)."""
        raise NotImplementedError

    def membership_changed(self, core: ShardCore, live: list[int]) -> None:
        """The live set changed (a worker left or expired): finish what waited for it."""


register = CONSISTENCY.register


def make_consistency(cfg: ServerConfig) -> Consistency:
    """The mode object ``cfg.mode`` names."""
    return CONSISTENCY.lookup(cfg.mode)(cfg)


@register
class Sync(Consistency):
    name = "sync"

    def admits(self, clocks, clock, slots):
        return all(s.version >= clock for s in slots)

    def waited_ranks(self, clocks, clock, slots):
        # the live workers whose push of the step is missing from the first key still behind
        behind = next((s for s in slots if s.version < clock), None)
        return sorted(set(clocks.live()) - behind.pushed) if behind is not None else []

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return (f"worker {worker} pull for clock {clock} keys {keys}: sync step "
                f"{clock - 1} still lacks pushes from workers "
                f"{self.waited_ranks(clocks, clock, slots)}")

    def holds_pulls(self, world_size):
        return world_size > 1

    def check_push(self, header, slots):
        for slot in slots:
            if header.clock != slot.version or header.worker in slot.pushed:
                raise PSError(pb.BAD_CLOCK, f"key {slot.spec.key}: sync push from worker "
                              f"{header.worker} at clock {header.clock}; the shard is "
                              f"aggregating clock {slot.version}"
                              + (" and already has this worker's push"
                                 if header.worker in slot.pushed else ""))

    def push(self, core, header, slots, grads, live, min_clock):
        for slot, grad in zip(slots, grads):
            slot.accumulate(header.worker, grad, live)
            core.try_aggregate(slot, live)

    def membership_changed(self, core, live):
        for slot in core.slots.values():
            core.try_aggregate(slot, live)


@register
class Async(Consistency):
    name = "async"
    ordered = True

    def admits(self, clocks, clock, slots):
        return True

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return f"worker {worker} pull for clock {clock} keys {keys}: nothing (async)"

    @property
    def looks_ahead(self):
        return self.cfg.lookahead

    def push(self, core, header, slots, grads, live, min_clock):
        cfg = self.cfg
        # a clock's pushes share one step's learning rate (ServerConfig.split_lr)
        split = 1.0 / max(len(live), 1) if cfg.split_lr else 1.0
        for i, (slot, grad) in enumerate(zip(slots, grads)):
            vgap = slot.version - header.versions[i] if header.versions else 0
            lr_scale = cfg.optimizer.schedule.factor(header.clock) * split
            if cfg.staleness_damping:
                lr_scale /= 1 + max(vgap, 0)
            core.apply_arrived(slot, grad, header.clock, lr_scale)
            core.applied(header.clock - min_clock, vgap)


@register
class SSP(Async):
    name = "ssp"

    def admits(self, clocks, clock, slots):
        return clocks.min_clock() >= clock - self.cfg.staleness

    def laggards(self, clocks: ClockTable, clock: int) -> list[int]:
        """Live ranks whose clock is below what a pull for step ``clock`` needs."""
        return clocks.below(clock - self.cfg.staleness)

    def waited_ranks(self, clocks, clock, slots):
        return self.laggards(clocks, clock)

    def waiting_for(self, clocks, worker, clock, slots):
        keys = [s.spec.key for s in slots][:8]
        return (f"worker {worker} pull for clock {clock} keys {keys}: SSP bound "
                f"{self.cfg.staleness} needs every live worker at clock >= "
                f"{clock - self.cfg.staleness}; behind: "
                + ", ".join(f"worker {r} at {clocks.workers[r].clock}"
                            for r in self.laggards(clocks, clock)))

    def observe_admission(self, metrics, clock, min_clock):
        metrics.admission_gap.observe(max(clock - min_clock, 0))

