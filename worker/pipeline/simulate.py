"""An event simulator for pipeline plans, and the checker of the action-list contract.

:func:`simulate` runs a plan (``list[list[Action]]``, see ``actions``) against per-stage op times:
each stage executes its list in order; a compute action (``F``, ``B``, ``W``, ``BW``) takes its
time; a ``SEND_*`` posts at once and makes its message available to the peer ``comm_s`` later; a
``RECV_*`` waits until its message is available; ``PULL`` waits for the stage's previous ``PUSH``
to have reached the shards, then takes ``pull``; ``PUSH`` posts (it runs on the communication
thread) and completes ``push`` later. When no stage can progress before the plan is done it
raises :class:`DeadlockError` naming a stage and the action it waits at forever.

**Per-action overhead** (``action_overhead_s``, default 0): the time a real stage spends between
its compute actions (the runtime's Python, a wake-up after a wait): each compute action starts
that much after the stage is ready for it. It is not busy time, so it shows in the bubble, as it
does in a measured one; a plan with more actions (two chunks per rank) pays it more often.

**Chunks** (V-shaped plans, see ``actions``): the plan's lists are then ranks. A transfer's peer
is :func:`~bitps.worker.pipeline.actions.peer` of (rank, chunk, op); a local hand-off (the peer
chunk on the same rank) arrives at once, without ``comm_s``. ``times`` stays per rank, for the
rank's whole share of the model: with ``C`` chunks per rank each chunk's compute action takes
``1 / C`` of it (a chunk holds ``1 / C`` of the rank's layers), so a 2-chunk plan and a 1-chunk
plan over the same ``StageTimes`` model the same model on the same ranks.

:func:`check` verifies the contracts of ``actions`` statically (every ``RECV`` has its ``SEND``,
receives before and sends after their compute, ``W`` after ``B``, pulls before use, at most two
weight versions live per stage) and raises :class:`PlanError` naming the first broken rule.

Example::

    plan = get_schedule("1f1b").generate(4, 8)
    r = simulate(plan, StageTimes(f=1.0, b=1.0, w=1.0))
    r.bubble_max    # 3/11: (p-1)/(m+p-1)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from bitps.worker.pipeline.actions import COMPUTE, Action, Op, chunks_of, peer, virtual_stage
from bitps.worker.pipeline.errors import DeadlockError, PlanError

__all__ = ["SimResult", "StageTimes", "check", "simulate"]

Plan = Sequence[Sequence[Action]]


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """One stage's op times in seconds for one micro-batch: ``f`` forward, ``b`` input backward,
    ``w`` weight backward (``BW`` takes ``b + w``), ``pull``/``push`` a PS round trip. In a
    plan with chunks, one *rank's* times, for its whole share of the model (each chunk's action
    takes ``1 / C`` of them; see the module docstring)."""

    f: float
    b: float
    w: float
    pull: float = 0.0
    push: float = 0.0

    def compute(self, op: Op) -> float:
        """The time of one compute action (0 for any other op)."""
        # Identity tests, not a dict: Enum hashing dominates the simulator's run time otherwise.
        if op is Op.F:
            return self.f
        if op is Op.B:
            return self.b
        if op is Op.W:
            return self.w
        if op is Op.BW:
            return self.b + self.w
        return 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    """What :func:`simulate` found. Per-stage tuples are indexed by stage.

    ``makespan`` is the end of the last action or the last push's arrival at the shards,
    whichever is later; ``busy[s]`` the compute time (F, B, W, BW) of stage ``s``;
    ``timeline[s][i]`` is the (start, end) of action ``i`` of stage ``s``; ``peak_inflight[s]``
    the most micro-batches whose ``F`` has run and whose last backward (``W`` or ``BW``) has not
    (counted per chunk: in a 2-chunk plan each is half a stage's activations, so ``2p`` chunks
    in flight hold what ``p`` micro-batches of 1F1B's first stage hold);
    ``max_live_versions[s]`` the most weight versions the stage holds at once (the last pulled
    one and those of its in-flight micro-batches).
    """

    plan: tuple[tuple[Action, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    max_live_versions: tuple[int, ...]
    timeline: tuple[tuple[tuple[float, float], ...], ...]

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per stage, the idle fraction ``1 - busy / makespan``."""
        return tuple(1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy)

    @property
    def bubble_max(self) -> float:
        return max(self.bubble)

    @property
    def bubble_mean(self) -> float:
        return sum(self.bubble) / len(self.bubble)

    def steady_bubble(self, first_step: int, last_step: int) -> float:
        """The largest per-stage idle fraction over the window from the first compute start of
        step ``first_step`` (any stage) to the last compute end of step ``last_step``; compute
        of other steps inside the window counts as busy (a flush-free schedule overlaps steps)."""
        spans = [(a, t) for acts, times in zip(self.plan, self.timeline)
                 for a, t in zip(acts, times) if a.op in COMPUTE]
        inside = [t for a, t in spans if first_step <= a.step <= last_step]
        if not inside:
            raise ValueError(f"no compute in steps {first_step}..{last_step} of this plan")
        t0, t1 = min(t[0] for t in inside), max(t[1] for t in inside)
        worst = 0.0
        for acts, times in zip(self.plan, self.timeline):
            busy = sum(max(0.0, min(e, t1) - max(s, t0))
                       for a, (s, e) in zip(acts, times) if a.op in COMPUTE)
            worst = max(worst, 1.0 - busy / (t1 - t0))
        return worst


def simulate(plan: Plan, times: StageTimes | Sequence[StageTimes], comm_s: float = 0.0, *,
             action_overhead_s: float = 0.0, schedule: str = "plan",
             m: int | None = None) -> SimResult:
    """Run ``plan`` against ``times`` (one for every stage, or one per stage); see the module
    docstring for the model. ``schedule`` and ``m`` only label errors (``m`` defaults to the
    number of micro-batches of step 0)."""
    if not (comm_s >= 0 and action_overhead_s >= 0):
        raise ValueError(f"simulate: comm_s and action_overhead_s must be >= 0 seconds, got "
                         f"{comm_s} and {action_overhead_s}")
    p = len(plan)
    chunks = chunks_of(plan)
    per_stage = _per_stage(times, p)
    clock = [0.0] * p
    push_done = [0.0] * p
    ptr = [0] * p
    # (forward?, receiver rank, receiver chunk, mb) -> arrival time; and who waits for it
    arrival: dict[tuple[bool, int, int, int | None], float] = {}
    waiting: dict[tuple[bool, int, int, int | None], int] = {}
    timeline: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    # A worklist: a stage runs until a receive finds no message, then waits for that send.
    # Each action's times depend only on its stage's clock and on arrival times fixed when the
    # send ran, so the order stages are visited in does not change the result.
    ready = collections.deque(range(p))
    while ready:
        s = ready.popleft()
        acts, t, spans = plan[s], per_stage[s], timeline[s]
        while ptr[s] < len(acts):
            a = acts[ptr[s]]
            op = a.op
            start = clock[s]
            if op is Op.RECV_F or op is Op.RECV_B:
                key = (op is Op.RECV_F, s, a.chunk, a.mb)
                if key not in arrival:
                    waiting[key] = s
                    break
                start = max(start, arrival[key])
            elif action_overhead_s and (op is Op.F or op is Op.B or op is Op.W or op is Op.BW):
                start += action_overhead_s
            end = start + t.compute(op) / chunks
            if op is Op.SEND_F or op is Op.SEND_B:
                to = peer(s, a.chunk, op, p, chunks)
                if to is None:
                    raise PlanError(f"stage {s}, action {ptr[s]} ({a}): no peer for it",
                                    schedule=schedule, p=p, m=_m_of(plan, m))
                key = (op is Op.SEND_F, to[0], to[1], a.mb)
                arrival[key] = start + (0.0 if to[0] == s else comm_s)  # local: at once
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif op is Op.PULL:
                start = max(start, push_done[s])
                end = start + t.pull
            elif op is Op.PUSH:
                push_done[s] = start + t.push
            spans.append((start, end))
            clock[s] = end
            ptr[s] += 1
    if any(ptr[s] < len(plan[s]) for s in range(p)):
        _raise_deadlock(plan, ptr, schedule, _m_of(plan, m))
    inflight, versions = zip(*(_occupancy(acts) for acts in plan)) if p else ((), ())
    return SimResult(
        plan=tuple(tuple(acts) for acts in plan),
        makespan=max([*clock, *push_done], default=0.0),
        busy=tuple(sum(per_stage[s].compute(a.op) for a in plan[s]) / chunks for s in range(p)),
        peak_inflight=tuple(inflight), max_live_versions=tuple(versions),
        timeline=tuple(tuple(t) for t in timeline))


def check(plan: Plan, *, schedule: str = "plan", m: int | None = None) -> None:
    """Verify the contracts of ``actions`` on ``plan``; :class:`PlanError` names the first rule
    broken (stage, action and why). Completion (no deadlock) is :func:`simulate`'s to check."""
    p, m_ = len(plan), _m_of(plan, m)

    def fail(s: int, i: int, why: str) -> None:
        raise PlanError(f"stage {s}, action {i} ({plan[s][i]}): {why}", schedule=schedule,
                        p=p, m=m_)

    chunks = chunks_of(plan)
    mbs0 = None
    for s, acts in enumerate(plan):
        runs = _check_stage(s, p, acts, fail, chunks)
        per_chunk = [{mb for c, mb in runs if c == k} for k in range(chunks)]
        if any(mbs != per_chunk[0] for mbs in per_chunk):
            raise PlanError(f"stage {s}'s chunks run different micro-batches: "
                            f"{[sorted(mbs) for mbs in per_chunk]}", schedule=schedule, p=p,
                            m=m_)
        mbs = per_chunk[0]
        if mbs0 is not None and mbs != mbs0:
            raise PlanError(f"stage {s} runs micro-batches {sorted(mbs)}, stage 0 runs "
                            f"{sorted(mbs0)}", schedule=schedule, p=p, m=m_)
        mbs0 = mbs


def _per_stage(times: StageTimes | Sequence[StageTimes], p: int) -> list[StageTimes]:
    if isinstance(times, StageTimes):
        return [times] * p
    if len(times) != p:
        raise ValueError(f"simulate: {len(times)} StageTimes for a plan of {p} stages; expected "
                         f"one StageTimes or {p}")
    return list(times)


def _m_of(plan: Plan, m: int | None) -> int:
    if m is not None:
        return m
    return sum(1 for a in (plan[0] if plan else ())
               if a.op is Op.F and a.step == 0 and a.chunk == 0)


def _raise_deadlock(plan: Plan, ptr: list[int], schedule: str, m: int) -> None:
    blocked = [s for s in range(len(plan)) if ptr[s] < len(plan[s])]
    p, chunks = len(plan), chunks_of(plan)
    waits = []
    for s in blocked:
        a = plan[s][ptr[s]]
        sent = "SEND_F" if a.op is Op.RECV_F else "SEND_B"
        try:
            to = peer(s, a.chunk, a.op, p, chunks)
        except ValueError:  # a plan whose lists are not all ranks of one V
            to = None
        other = -1 if to is None else to[0]
        at = (f"blocked at {plan[other][ptr[other]]}" if 0 <= other < p
              and ptr[other] < len(plan[other]) else "finished or absent")
        chunk = f" chunk {to[1]}" if to is not None and chunks > 1 else ""
        waits.append(f"stage {s} waits at {a} for {sent}{a.mb} of stage {other}{chunk} ({at})")
    s = blocked[0]
    raise DeadlockError("; ".join(waits), schedule=schedule, p=len(plan), m=m, stage=s,
                        action=str(plan[s][ptr[s]]), index=ptr[s])


def _occupancy(acts: Sequence[Action]) -> tuple[int, int]:
    """(peak in-flight micro-batches, most live weight versions) over one stage's list."""
    inflight: dict[tuple[int, int | None], int] = {}  # (chunk, mb) -> its version
    uses: dict[int, int] = {}  # version -> in-flight micro-batches using it
    latest: int | None = None
    peak = live = 0
    for a in acts:
        op = a.op
        if op is Op.PULL:
            latest = a.version
        elif op is Op.F:
            inflight[a.chunk, a.mb] = a.version
            uses[a.version] = uses.get(a.version, 0) + 1
        elif (op is Op.W or op is Op.BW) and (a.chunk, a.mb) in inflight:
            v = inflight.pop((a.chunk, a.mb))
            uses[v] -= 1
            if not uses[v]:
                del uses[v]
        peak = max(peak, len(inflight))
        live = max(live, len(uses) + (latest is not None and latest not in uses))
    return peak, live


def _check_stage(s: int, p: int, acts: Sequence[Action], fail, chunks: int = 1
                 ) -> set[tuple[int, int | None]]:
    """Check one stage's (rank's) list; returns the (chunk, micro-batch) pairs it runs. The
    rules are those of ``actions``, per virtual stage: the first has no ``RECV_F``/``SEND_B``,
    the last no ``SEND_F``/``RECV_B``."""
    n = chunks * p
    seen: dict[tuple[Op, int, int | None], int] = {}
    done: dict[tuple[int, int | None], set[Op]] = {}
    fwd_version: dict[tuple[int, int | None], int] = {}
    pulled: set[int] = set()
    pushed: set[int] = set()
    for i, a in enumerate(acts):
        if a.stage != s:
            fail(s, i, f"carries stage={a.stage}")
        if not 0 <= a.chunk < chunks:
            fail(s, i, f"carries chunk={a.chunk}; expected 0..{chunks - 1}")
        v = virtual_stage(s, a.chunk, p)
        forbidden = ({Op.RECV_F, Op.SEND_B} if v == 0 else set()) | (
            {Op.SEND_F, Op.RECV_B} if v == n - 1 else set())
        if a.op in forbidden:
            where = f"stage {s} of {p}" if chunks == 1 else f"virtual stage {v} of {n}"
            fail(s, i, f"{where} has no peer for {a.op.value}")
        key = (a.chunk, a.mb)
        if (a.op, *key) in seen and a.op not in (Op.PULL, Op.PUSH):
            fail(s, i, f"repeats {a} (first at action {seen[(a.op, *key)]})")
        seen.setdefault((a.op, *key), i)
        before = set(done.get(key, ()))
        done.setdefault(key, set()).add(a.op)
        if a.op is Op.F:
            if v > 0 and Op.RECV_F not in before:
                fail(s, i, "F before its RECV_F")
            if a.version not in pulled:
                fail(s, i, f"uses weight version {a.version}, not pulled before")
            fwd_version[key] = a.version
        elif a.op in (Op.B, Op.BW, Op.W):
            if Op.F not in before:
                fail(s, i, f"{a.op.value} before its F")
            if a.version != fwd_version.get(key):
                fail(s, i, f"backward with version {a.version}, forward used "
                     f"{fwd_version.get(key)} (weight stashing)")
            if a.op is Op.W and Op.B not in before:
                fail(s, i, "W before its B")
            if a.op is not Op.W and v < n - 1 and Op.RECV_B not in before:
                fail(s, i, f"{a.op.value} before its RECV_B")
            if a.step in pushed:
                fail(s, i, f"backward of step {a.step} after that step's PUSH")
        elif a.op is Op.SEND_F and Op.F not in before:
            fail(s, i, "SEND_F before its F")
        elif a.op is Op.SEND_B and not before & {Op.B, Op.BW}:
            fail(s, i, "SEND_B before its B/BW")
        elif a.op is Op.PULL:
            pulled.add(a.version)
        elif a.op is Op.PUSH:
            pushed.add(a.step)
    _check_complete(s, p, acts, seen, done, fail, chunks)
    return {(c, mb) for op, c, mb in seen if op is Op.F}


def _check_complete(s: int, p: int, acts, seen, done, fail, chunks: int = 1) -> None:
    """Every F has its backward (BW, or B and W), its sends, and its step's PUSH; every
    receive is for a micro-batch this stage runs."""
    steps_pushed = {a.step for a in acts if a.op is Op.PUSH}
    n = chunks * p
    for (op, c, mb), i in seen.items():
        if op in (Op.RECV_F, Op.RECV_B) and Op.F not in done[c, mb]:
            fail(s, i, f"receives for micro-batch {mb}, which this stage never runs")
        if op is not Op.F:
            continue
        has, v = done[c, mb], virtual_stage(s, c, p)
        if not (Op.BW in has) ^ (Op.B in has and Op.W in has):
            fail(s, i, "needs exactly one backward: BW, or B and W")
        if v < n - 1 and Op.SEND_F not in has:
            fail(s, i, "its output is never sent (no SEND_F)")
        if v > 0 and Op.SEND_B not in has:
            fail(s, i, "its input gradient is never sent (no SEND_B)")
        if acts[i].step not in steps_pushed:
            fail(s, i, f"step {acts[i].step} has no PUSH")
    if _peak_versions(acts) > 2:
        raise_at = next(i for i in range(len(acts)) if _peak_versions(acts[:i + 1]) > 2)
        fail(s, raise_at, "more than 2 weight versions live on this stage")


def _peak_versions(acts: Sequence[Action]) -> int:
    return _occupancy(acts)[1]
