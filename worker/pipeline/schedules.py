"""Pipeline schedules as data: each :class:`Schedule` turns (p stages, m micro-batches per step,
steps) into one :class:`~bitps.worker.pipeline.actions.Action` list per stage.

Registered schedules (``get_schedule(name)``; ``SCHEDULES`` maps name to class):

=========  ========  ==========  ==================================================================
name       flushes   splits B/W  order on stage ``s`` (``w = min(p - s - 1, m)`` warm-up forwards)
=========  ========  ==========  ==================================================================
``gpipe``  yes       no          all ``m`` forwards, then all ``m`` backwards (``BW``), in mb order
``1f1b``   yes       no          ``w`` forwards, then ``F(w+j) BW(j)`` pairs, then the last ``w``
                                 ``BW``'s (PipeDream-Flush / Megatron non-interleaved)
``zb-h1``  yes       yes         1F1B with ``B`` for ``BW``; ``W(j)`` is deferred while fewer than
                                 ``s + 1`` are pending, so the last stage's ``W``'s fill the drain
                                 (Qi et al., ZB-H1); at most ``p`` micro-batches in flight
``2bw``    no        no          1F1B run without a break over all ``steps * m`` micro-batches,
                                 two weight versions (PipeDream-2BW)
``zb-v``   yes       yes         2 chunks per rank in a V (rank ``r``: virtual stages ``r`` and
                                 ``2p-1-r``); warm-up of chunk-0 forwards, then ``F B W`` per
                                 chunk, ``W``'s deferred into the drain (Qi et al., ZB-V); at
                                 most ``2p`` chunks (``p`` stages' worth) in flight per rank
=========  ========  ==========  ==================================================================

A plan is one list per stage; for ``zb-v`` one per *rank*, each action's ``chunk`` saying
which of the rank's two chunks it is for (``actions``: peers, local hand-offs).

Communication is placed as the contract in ``actions`` says: ``RECV_F`` just before its ``F``,
``SEND_F`` just after it; ``RECV_B`` just before ``B``/``BW``, ``SEND_B`` just after it (the
runtime posts receives early on its own; sends never block).

Steps and weight versions:

- Flushing schedules repeat the one-step plan ``steps`` times (a flush between steps). Step ``k``
  holds micro-batches ``k*m .. k*m+m-1``; each stage opens it with ``PULL(version=k)`` before its
  first ``F`` and closes it with ``PUSH(step=k)`` after its last ``W``/``BW``; every action of the
  step computes with version ``k``.
- ``2bw``: no flush. Weights are updated once per step (the PS applies step ``k``'s coalesced
  gradient, pushed after the stage's last ``BW`` of step ``k``, making version ``k + 1``). The
  update is one step stale, as in 2BW: ``W(k+1) = W(k) - lr * grad f(W(k-1))``. So step ``k``
  reads version ``max(k - 1, 0)``: steps 0 and 1 both read version 0 (pulled once, at the start);
  step ``k >= 2`` reads version ``k - 1``, pulled right after the stage's ``PUSH`` of step
  ``k - 2`` (the first point where that version can exist, and before this stage's push of step
  ``k - 1``, so in sync mode the shard serves exactly version ``k - 1``). Each micro-batch's
  ``F`` and ``BW`` use the version its step reads (weight stashing); with ``m >= p - 1`` the
  micro-batches in flight span at most two steps, so at most two versions are live per stage
  (fewer is refused).

Example::

    plan = get_schedule("1f1b").generate(p=4, m=8)
    [str(a) for a in plan[3][:4]]   # ['PULL', 'RECV_F0', 'F0', 'BW0'] (the last stage)
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import ClassVar

from bitps.worker.pipeline.actions import Action, Op, virtual_stage
from bitps.worker.pipeline.errors import PlanError, UnknownScheduleError
from bitps.worker.pipeline.simulate import StageTimes, check, simulate

__all__ = ["SCHEDULES", "GPipe", "OneFOneB", "PipeDream2BW", "Schedule", "ZeroBubbleH1",
           "ZeroBubbleV", "closed_form_bubble", "get_schedule", "register_schedule"]

Slot = tuple[Op, int]
"""One compute action of a stage's order before communication is added: (F|B|BW|W, mb)."""


class Schedule:
    """A pipeline schedule: which compute a stage runs in which order.

    Subclasses set ``name``, ``splits_backward`` (``B`` + ``W`` rather than ``BW``) and
    ``flushes`` and implement :meth:`_order`; :meth:`generate` adds communication, steps and
    versions. :meth:`check` refuses a (p, m) the schedule does not support *and* any plan the
    event simulator cannot complete, so a refused plan is refused before any process starts.
    """

    name: ClassVar[str]
    splits_backward: ClassVar[bool]
    flushes: ClassVar[bool]
    chunks: ClassVar[int] = 1
    """Model chunks per rank: 1, or 2 for the V of ``zb-v`` (the plan's lists are then ranks,
    and each rank's runtime gets ``chunks`` modules)."""

    def refusal(self, p: int, m: int) -> str | None:
        """Why this schedule does not support (p, m), or None. The base refuses sizes < 1."""
        if p < 1 or m < 1:
            return "p and m must both be at least 1"
        return None

    def check(self, p: int, m: int) -> None:
        """Raise :class:`PlanError` naming p, m and the schedule unless a plan for (p, m)
        exists, keeps the contracts of ``actions`` (``simulate.check``) and completes in the
        simulator (the deadlock guard) with at most 2 live weight versions per stage."""
        self._refuse(p, m)
        # Three steps for a flush-free schedule, so its version hand-over is checked too.
        plan = self._build(p, m, steps=1 if self.flushes else 3)
        check(plan, schedule=self.name, m=m)
        result = simulate(plan, StageTimes(f=1.0, b=1.0, w=1.0), schedule=self.name, m=m)
        if max(result.max_live_versions) > 2:
            raise PlanError(f"{max(result.max_live_versions)} weight versions would be live on "
                            "one stage (at most 2 are allowed)", schedule=self.name, p=p, m=m)

    def generate(self, p: int, m: int, steps: int = 1) -> list[list[Action]]:
        """The plan: one action list per stage ``0 .. p-1`` for ``steps`` optimizer steps of
        ``m`` micro-batches each. Raises :class:`PlanError` if the schedule refuses (p, m)."""
        self._refuse(p, m)
        if steps < 1:
            raise PlanError(f"steps must be at least 1, got {steps}", schedule=self.name, p=p, m=m)
        return self._build(p, m, steps)

    def closed_form_bubble(self, p: int, m: int, times: StageTimes) -> float | None:
        """The idle fraction of a step (every stage) with these per-stage times on every stage,
        no communication and no pull/push time, where a closed form exists; else None."""
        return None

    def _order(self, s: int, p: int, mbs: range) -> Iterator[Slot]:
        """Stage ``s``'s compute order over the micro-batches ``mbs`` (one flushing step, or the
        whole plan for a flush-free schedule)."""
        raise NotImplementedError

    def _refuse(self, p: int, m: int) -> None:
        reason = self.refusal(p, m)
        if reason is not None:
            raise PlanError(reason, schedule=self.name, p=p, m=m)

    def _build(self, p: int, m: int, steps: int) -> list[list[Action]]:
        return [self._stage_plan(s, p, m, steps) for s in range(p)]

    def _stage_plan(self, s: int, p: int, m: int, steps: int) -> list[Action]:
        acts: list[Action] = []
        for k in range(steps):
            acts.append(Action(op=Op.PULL, stage=s, step=k, version=k))
            for op, mb in self._order(s, p, range(k * m, (k + 1) * m)):
                acts.extend(_with_comm(op, s, p, mb, step=k, version=k))
            acts.append(Action(op=Op.PUSH, stage=s, step=k, version=k))
        return acts


def _with_comm(op: Op, s: int, p: int, mb: int, *, step: int, version: int, chunk: int = 0,
               chunks: int = 1) -> list[Action]:
    """One compute slot (of ``chunk`` on stage/rank ``s``) with its receive just before and its
    send just after; the first virtual stage receives no activation, the last sends none."""
    def act(o: Op) -> Action:
        return Action(op=o, stage=s, step=step, mb=mb, version=version, chunk=chunk)

    v, last = virtual_stage(s, chunk, p), chunks * p - 1
    if op is Op.F:
        return ([act(Op.RECV_F)] if v > 0 else []) + [act(Op.F)] + (
            [act(Op.SEND_F)] if v < last else [])
    if op in (Op.B, Op.BW):
        return ([act(Op.RECV_B)] if v < last else []) + [act(op)] + (
            [act(Op.SEND_B)] if v > 0 else [])
    return [act(op)]


def _one_f_one_b(s: int, p: int, mbs: range, backward: Op) -> Iterator[Slot]:
    """``w`` warm-up forwards, then forward/backward pairs, then the remaining backwards."""
    n = len(mbs)
    w = min(p - s - 1, n)
    for i in range(w):
        yield Op.F, mbs[i]
    for j in range(n):
        if w + j < n:
            yield Op.F, mbs[w + j]
        yield backward, mbs[j]


SCHEDULES: dict[str, type[Schedule]] = {}
"""Registered schedules by name (see :func:`register_schedule`)."""


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: register ``cls`` under ``cls.name`` (a name registered twice is a bug)."""
    if cls.name in SCHEDULES:
        raise ValueError(f"pipeline schedule {cls.name!r} is already registered "
                         f"({SCHEDULES[cls.name].__qualname__})")
    SCHEDULES[cls.name] = cls
    return cls


def get_schedule(name: str) -> Schedule:
    """The schedule registered as ``name``; :class:`UnknownScheduleError` lists the choices."""
    try:
        return SCHEDULES[name]()
    except (KeyError, TypeError):
        raise UnknownScheduleError(name, sorted(SCHEDULES)) from None


def closed_form_bubble(schedule: Schedule | str, p: int, m: int, times: StageTimes) -> float | None:
    """The schedule's (or the registered name's) closed-form idle fraction of a step with
    ``times`` on every stage, no communication and no pull/push time, or None where it has none
    (``2bw``: steady state 0, measure it with ``SimResult.steady_bubble``)."""
    if isinstance(schedule, str):
        schedule = get_schedule(schedule)
    return schedule.closed_form_bubble(p, m, times)


def _flush_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


@register_schedule
class GPipe(Schedule):
    """All forwards, then all backwards (GPipe, Huang et al. 2019): ``m`` micro-batches in flight
    on every stage; bubble ``(p-1)/(m+p-1)``."""

    name = "gpipe"
    splits_backward = False
    flushes = True

    def closed_form_bubble(self, p: int, m: int, times: StageTimes) -> float:
        return _flush_bubble(p, m)

    def _order(self, s: int, p: int, mbs: range) -> Iterator[Slot]:
        yield from ((Op.F, mb) for mb in mbs)
        yield from ((Op.BW, mb) for mb in mbs)


@register_schedule
class OneFOneB(Schedule):
    """1F1B with a flush (PipeDream-Flush): at most ``min(p - s, m)`` micro-batches in flight on
    stage ``s``; bubble ``(p-1)/(m+p-1)``. Refuses ``m < p``, as torch's ``Schedule1F1B`` does
    (a warm-up longer than the step is the known hang of other systems)."""

    name = "1f1b"
    splits_backward = False
    flushes = True

    def refusal(self, p: int, m: int) -> str | None:
        if m < p:
            return (f"{self.name} needs at least as many micro-batches per step as stages "
                    f"(m >= p = {p}), as torch's Schedule1F1B; with fewer its warm-up exceeds "
                    "the step (the hang other systems hit)")
        return super().refusal(p, m)

    def closed_form_bubble(self, p: int, m: int, times: StageTimes) -> float:
        return _flush_bubble(p, m)

    def _order(self, s: int, p: int, mbs: range) -> Iterator[Slot]:
        yield from _one_f_one_b(s, p, mbs, Op.BW)


@register_schedule
class ZeroBubbleH1(OneFOneB):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): 1F1B with the backward
    split into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient). Stage
    ``s`` keeps up to ``s`` ``W``'s pending, so at most ``p`` micro-batches are in flight on any
    stage (1F1B's peak) and the late stages' ``W``'s fill the drain. Bubble time per stage
    ``(p-1)(T_F + T_B - T_W)`` against 1F1B's ``(p-1)(T_F + T_B + T_W)`` when
    ``T_W <= min(T_F, T_B)`` (sail-sg/zero-bubble-pipeline-parallelism ``efficiency.py``)."""

    name = "zb-h1"
    splits_backward = True
    flushes = True

    def closed_form_bubble(self, p: int, m: int, times: StageTimes) -> float | None:
        # The formula holds while a deferred W fits in the gaps it fills: T_W <= min(T_F, T_B).
        # Beyond that the start-up wait (p-1)T_F or the drain (p-1)T_B dominates; simulate it.
        if times.w > min(times.f, times.b):
            return None
        idle = (p - 1) * (times.f + times.b - times.w)
        return idle / (m * (times.f + times.b + times.w) + idle)

    def _order(self, s: int, p: int, mbs: range) -> Iterator[Slot]:
        pending: collections.deque[int] = collections.deque()
        for op, mb in _one_f_one_b(s, p, mbs, Op.B):
            yield op, mb
            if op is Op.B:
                pending.append(mb)
                if len(pending) > s:
                    yield Op.W, pending.popleft()
        yield from ((Op.W, mb) for mb in pending)


@register_schedule
class PipeDream2BW(Schedule):
    """Flush-free 1F1B with two weight versions (PipeDream-2BW, Narayanan et al. ICML'21); see
    the module docstring for which version each step reads and where its ``PULL`` sits.
    Refuses ``m < p - 1``: the micro-batches in flight would span three steps (three
    versions)."""

    name = "2bw"
    splits_backward = False
    flushes = False

    def refusal(self, p: int, m: int) -> str | None:
        # Stage 0 holds up to p micro-batches in flight; they span at most two steps (two
        # versions), and step k-2's push precedes step k's first forward, iff m >= p - 1.
        if m < p - 1:
            return (f"2BW needs m >= p - 1 = {p - 1}: with fewer micro-batches per step, stage "
                    "0's in-flight micro-batches span three steps (three live weight versions)")
        return super().refusal(p, m)

    def _order(self, s: int, p: int, mbs: range) -> Iterator[Slot]:
        yield from _one_f_one_b(s, p, mbs, Op.BW)

    def _stage_plan(self, s: int, p: int, m: int, steps: int) -> list[Action]:
        def version(step: int) -> int:
            return max(step - 1, 0)

        acts = [Action(op=Op.PULL, stage=s, step=0, version=0)]
        for op, mb in self._order(s, p, range(steps * m)):
            k = mb // m
            acts.extend(_with_comm(op, s, p, mb, step=k, version=version(k)))
            if op is Op.BW and mb % m == m - 1:  # the step's last backward: its gradient is final
                acts.append(Action(op=Op.PUSH, stage=s, step=k, version=version(k)))
                if k + 2 < steps:
                    acts.append(Action(op=Op.PULL, stage=s, step=k + 2, version=k + 1))
        return acts


ChunkSlot = tuple[Op, int, int]
"""One compute action of a rank with several chunks: (F|B|W, chunk, mb)."""


@register_schedule
class ZeroBubbleV(Schedule):
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 v2+, section 6):
    two model chunks per rank in a V, ``B`` and ``W`` split, flushing. Rank ``r`` holds virtual
    stages ``r`` (chunk 0) and ``2p - 1 - r`` (chunk 1), so rank 0 feeds the inputs and computes
    the loss, and rank ``p - 1`` hands chunk 0's output to its own chunk 1 locally.

    Rank ``r``'s order over the step's ``m`` micro-batches (each phase skips what is done):

    1. ``2(p - r) - 1`` forwards of chunk 0;
    2. ``r`` times: a forward of chunk 1, a forward of chunk 0;
    3. ``p - r`` times: chunk 1's ``F``, ``B``, ``W`` (the first backwards start at once on
       rank 0, where chunk 1's forward ends in the loss);
    4. steady state, until every forward ran: chunk 0's ``F`` (while any is left), ``B``,
       ``W``; chunk 1's ``F``, ``B``, ``W``;
    5. cool-down: ``r`` times chunk 0's ``B`` then chunk 1's ``B``; ``p - r`` times chunk 0's
       ``B`` then a deferred ``W`` of chunk 0; then the deferred ``W``'s of chunk 1, then of
       chunk 0 (the ``W``'s fill the drain, as in ZB-H1).

    Memory: at most ``2p`` chunks' activations in flight on any rank (``peak_inflight``, in
    chunks), each half a stage's: the ``p`` full-stage micro-batches of 1F1B's first stage.
    Every ``m >= 1`` is accepted (as torch's ``ScheduleZBVZeroBubble`` does): with
    ``m < 2p - 1`` the phases run out of micro-batches early and the plan is still complete and
    deadlock-free (the simulator checks every p <= 8, m <= 32), only with a larger bubble.

    Bubble, per rank's chunk times ``f_c = f / 2`` etc., no communication: rank ``p - 1``
    cannot start before ``p - 1`` chunk forwards, and with ``m >= 2p - 1``, ``f = b`` and
    ``f / 2 <= w <= f`` that is all its idle time, the largest of any rank's (the simulator
    agrees on every p <= 8, m <= 32; a shorter ``W`` leaves gaps in the drain):
    ``(p - 1) f_c / ((p - 1) f_c + m (f + b + w))``, e.g. 3/51 = 0.059 at p = 4, m = 8."""

    name = "zb-v"
    splits_backward = True
    flushes = True
    chunks = 2

    def closed_form_bubble(self, p: int, m: int, times: StageTimes) -> float | None:
        if m < 2 * p - 1 or times.f != times.b or not times.f / 2 <= times.w <= times.f:
            return None  # a deeper drain or start-up; simulate it
        idle = (p - 1) * times.f / self.chunks
        return idle / (idle + m * (times.f + times.b + times.w))

    def _stage_plan(self, s: int, p: int, m: int, steps: int) -> list[Action]:
        acts: list[Action] = []
        for k in range(steps):
            acts.append(Action(op=Op.PULL, stage=s, step=k, version=k))
            for op, c, mb in self._rank_order(s, p, range(k * m, (k + 1) * m)):
                acts.extend(_with_comm(op, s, p, mb, step=k, version=k, chunk=c,
                                       chunks=self.chunks))
            acts.append(Action(op=Op.PUSH, stage=s, step=k, version=k))
        return acts

    def _rank_order(self, r: int, p: int, mbs: range) -> Iterator[ChunkSlot]:
        n = len(mbs)
        f, b, w = [0, 0], [0, 0], [0, 0]  # next micro-batch (index into mbs) per op, chunk

        def fwd(c: int) -> Iterator[ChunkSlot]:
            if f[c] < n:
                yield Op.F, c, mbs[f[c]]
                f[c] += 1

        def bwd(c: int, weight: bool) -> Iterator[ChunkSlot]:
            if b[c] < f[c]:
                yield Op.B, c, mbs[b[c]]
                b[c] += 1
            if weight and w[c] < b[c]:
                yield Op.W, c, mbs[w[c]]
                w[c] += 1

        for _ in range(2 * (p - r) - 1):
            yield from fwd(0)
        for _ in range(r):
            yield from fwd(1)
            yield from fwd(0)
        for _ in range(p - r):
            yield from fwd(1)
            yield from bwd(1, weight=True)
        while f[1] < n:
            yield from fwd(0)
            yield from bwd(0, weight=True)
            yield from fwd(1)
            yield from bwd(1, weight=True)
        for _ in range(r):
            yield from bwd(0, weight=False)
            yield from bwd(1, weight=False)
        for _ in range(p - r):
            yield from bwd(0, weight=True)
        for c in (1, 0):  # whatever backward is left, in micro-batch order
            while b[c] < n:
                yield from bwd(c, weight=False)
            while w[c] < n:
                yield from bwd(c, weight=True)
