"""``StageRuntime``: one pipeline stage's process executing its action list.

    ctx = StageContext(stage=s, num_stages=p, replica=r, prev_rank=..., next_rank=...,
                       device="cpu", timeout_s=30)
    rt = StageRuntime(ctx, stage_module, loss_fn=F.cross_entropy, ps_model=ps_model)
    plan = get_schedule("1f1b").generate(p, m)
    report = rt.run_step(plan[s], inputs=micro_batches, targets=micro_targets)
    report.bubble   # 1 - busy / wall of this stage in this step

``run_step`` executes the actions in order (``pipeline.actions`` states their contract):
compute through :class:`~bitps.worker.pipeline.stage.StageCompute`, transfers through
:class:`~bitps.worker.pipeline.p2p.StageLink` (every receive of the list is announced to its
chain at the start, so each is posted before it is awaited), and ``PULL``/``PUSH`` through the
stage's ``PSModel``:

- ``PUSH`` of a step is where its gradients are final. With a ``PSModel`` it is
  ``ps_model.step()``: under overlap the buckets were already handed to the communication thread
  by the post-accumulate-grad hooks of the step's last weight-backward (every earlier W/BW runs
  inside ``ps_model.no_sync()``), so ``step()`` only pushes what is left and returns; the pulls
  are awaited by the next forward's pre-hooks. Without a ``PSModel`` the gradients stay in
  ``.grad`` for the caller.
- ``PULL`` of a flushing schedule needs no work of its own (``step()`` pulled); with weight
  stashing it waits for the pulled values and keeps them as that version's tensors.

**Weight stashing** is on for a flush-free plan: one whose weight versions overlap in flight
(a micro-batch of version ``v + 1`` starts before the last backward of version ``v``) or whose
steps share a version (2BW's steps 0 and 1 both read version 0). Each version then gets its own
copy of the stage's parameters, made at its ``PULL`` (or at its first use), and each step its
own leaves aliasing that copy (no memory of their own, a ``.grad`` each): every micro-batch's
F, B and W compute on the version its step reads, and the W gradients accumulate per step. A
version's copy is dropped after the last compute that uses it, so at most 2 live in a 2BW plan.
At ``PUSH`` of step ``s`` the gradients computed for ``s`` become the module's ``.grad`` and are
pushed as one step's gradients (without a PS they stay there, replaced at the next ``PUSH``).
With a ``predictor`` (``prediction``) a version's copy is its predicted view, not the pulled
values; the module's parameters stay exact.

**Two chunks** (``zb-v``): ``module=[chunk0, chunk1]`` gives the rank the virtual stages
``r`` and ``2p - 1 - r`` of a V (``actions``); ``ctx.stage`` is then the rank. Each chunk has
its own :class:`StageCompute` and its own transfer chains (``p2p``: chunk 0 receives
activations from ``prev_rank``, chunk 1 from ``next_rank``; gradients the reverse); rank
``p - 1`` hands chunk 0's output to its chunk 1 (and the gradient back) in memory, its
``SEND``/``RECV`` pair moving no bytes. Rank 0 feeds ``inputs`` to chunk 0 and computes the loss
on chunk 1 (so it needs ``targets``). The ``PSModel`` is one over a module holding both chunks
(with a whole-model key plan, one that keeps the model's parameter names, e.g. an
``nn.Sequential`` of both chunks' children): ``PUSH`` pushes both chunks' gradients, the step's
last ``W`` (of either chunk) handing the buckets over. Not provided with two chunks yet:
weight stashing (flush-free plans), an ``ActivationPool``, and CUDA/NCCL (two chunks' chains
between one pair of ranks would need a communicator each).

**Timing.** Every compute action is timed (``time.perf_counter``; on CUDA, events on the
compute stream, read at the step's end); busy is their sum and bubble ``1 - busy / wall``, wall
from the start of ``run_step`` to the end of its last send.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bitps.worker.pipeline.actions import COMPUTE, Action, Op, peer, virtual_stage
from bitps.worker.pipeline.p2p import (
    Direction,
    Peer,
    StageFailedError,
    StageLink,
    direction_groups,
)
from bitps.worker.pipeline.simulate import StageTimes
from bitps.worker.pipeline.stage import StageCompute

__all__ = ["StageContext", "StageFailedError", "StageRuntime", "StepReport"]


@dataclass(frozen=True, kw_only=True)
class StageContext:
    """Where a stage sits: which stage of how many, in which replica, and its neighbours."""

    stage: int
    """This stage's index, ``0 .. num_stages - 1``."""
    num_stages: int
    """Pipeline stages per replica (p)."""
    replica: int = 0
    """The data-parallel replica this stage belongs to."""
    prev_rank: int | None = None
    """Global rank of stage ``stage - 1`` of this replica (None on the first stage)."""
    next_rank: int | None = None
    """Global rank of stage ``stage + 1`` of this replica (None on the last stage)."""
    group: Any = None
    """The ``torch.distributed`` group of the p2p transfers (None: the default group; the
    ranks above are global ranks either way)."""
    device: torch.device | str = "cpu"
    """Where the stage computes; CUDA uses NCCL and CUDA-event timing."""
    timeout_s: float = 60.0
    """Deadline of every wait on a peer; past it, ``StageFailedError``."""

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage must be in 0..{self.num_stages - 1}, got {self.stage}")
        if (self.stage > 0) != (self.prev_rank is not None):
            raise ValueError(f"stage {self.stage} of {self.num_stages}: prev_rank must be "
                             f"{'given' if self.stage > 0 else 'None'}, got {self.prev_rank}")
        last = self.stage == self.num_stages - 1
        if last == (self.next_rank is not None):
            raise ValueError(f"stage {self.stage} of {self.num_stages}: next_rank must be "
                             f"{'None' if last else 'given'}, got {self.next_rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one ``run_step`` measured on this stage."""

    step: int
    """The last step the actions belong to."""
    wall_s: float
    busy_s: float
    """Sum of the compute actions' intervals."""
    bubble: float
    """``1 - busy_s / wall_s``, over this stage's own wall (its ``run_step``, start to last
    send). The bubble protocol compared with the simulator takes one wall for every stage,
    from a common barrier to the last stage's end: a bench computes that from ``busy_s``."""
    losses: list[float]
    """Each micro-batch's loss (undivided), in forward order (the last stage; else empty)."""
    times: StageTimes
    """Mean seconds per micro-batch of F, B and W (a fused BW counts as B, W is then 0), and
    the mean PULL and PUSH. With 2 chunks, per micro-batch of the rank (both chunks' F, and
    so on): what ``simulate`` takes as the rank's ``StageTimes``."""
    p2p_bytes_sent: int
    p2p_bytes_received: int
    micro_batch_size: int
    """Samples in this step's first micro-batch (its input's first dimension)."""
    peak_inflight: int = 0
    """Most micro-batches whose graphs this stage held at once (with 2 chunks: summed over
    the chunks, each half a stage's activations, as the simulator counts them)."""


class _Timer:
    """Intervals of compute actions by op: perf_counter, or CUDA events on the compute stream
    (read once, at the step's end)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[Op, list] = {}

    @contextlib.contextmanager
    def time(self, op: Op):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.setdefault(op, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.setdefault(op, []).append(time.perf_counter() - t0)

    def seconds(self) -> dict[Op, list[float]]:
        if not self.cuda:
            return self.spans
        torch.cuda.synchronize()
        return {op: [s.elapsed_time(e) / 1000 for s, e in spans]
                for op, spans in self.spans.items()}


@dataclass
class _Plan:
    """What run_step derives from the action list before executing it."""

    m: dict[int, int]                 # micro-batches per step
    version_of_step: dict[int, int]   # the weight version each step's micro-batches use
    last_use: dict[int, int]          # version -> index of the last action that uses it
    last_backward: dict[int, int]     # step -> index of its last W or BW
    stash: bool                       # a flush-free plan: weight stashing on
    backward_order: list[int] = field(default_factory=list)


_RECV = {Op.RECV_F: Direction.FROM_PREV, Op.RECV_B: Direction.FROM_NEXT}
_SEND = {Op.SEND_F: Direction.TO_NEXT, Op.SEND_B: Direction.TO_PREV}


def _analyse(actions: Sequence[Action]) -> _Plan:
    m: dict[int, int] = {}
    version_of_step: dict[int, int] = {}
    first_f: dict[int, int] = {}
    last_compute: dict[int, int] = {}
    last_backward: dict[int, int] = {}
    order = []
    for i, a in enumerate(actions):
        if a.op is Op.F and a.chunk == 0:  # every chunk runs each micro-batch once
            m[a.step] = m.get(a.step, 0) + 1
            version_of_step.setdefault(a.step, a.version)
            first_f.setdefault(a.version, i)
        if a.op in COMPUTE:
            last_compute[a.version] = i
        if a.op in (Op.W, Op.BW):
            last_backward[a.step] = i
        if a.op in (Op.B, Op.BW):
            order.append(a.mb)
    # Stashing is a property of the plan, not of one stage's order: 2BW's last stage never
    # overlaps versions, but its steps 0 and 1 read one version and their gradients differ.
    shared = len(set(version_of_step.values())) < len(version_of_step)
    stash = shared or any(first_f[v] < last_compute[u] for u in first_f for v in first_f
                          if v > u)
    # a version's copy goes after its last compute: its steps' leaves alias it until PUSH
    return _Plan(m=m, version_of_step=version_of_step, last_use=last_compute,
                 last_backward=last_backward, stash=stash, backward_order=order)


class StageRuntime:
    """Executes one stage's action lists, step after step (see the module docstring).

    ``module`` is this stage's part of the model (an ``nn.Sequential`` splits W from B per
    child), or a list of two, the rank's chunks of a V plan (``zb-v``; module docstring);
    ``loss_fn(output, target)`` is needed on the stage (chunk) that ends the model;
    ``ps_model`` (a ``PSModel`` over ``module``, or over a module holding both chunks) or None;
    ``pool`` an ``ActivationPool`` the forwards save into, tagged by micro-batch with the
    plan's backward order; ``metrics`` anything with ``observe(report)``
    (``StageMetrics``); ``prefetcher`` (first stage) supplies the inputs
    when ``run_step`` gets none. ``p2p_groups``: a process group per direction
    (``p2p.direction_groups``); on CUDA without ``ctx.group`` they are made here, a collective
    call every rank makes when it builds its runtime (NCCL runs a pair's ops in the order posted
    on one stream, so an early-posted receive would hold back the sends behind it).
    ``predictor``: a ``prediction.WeightPredictor`` whose views the stashed versions compute
    on (flush-free plans; flushing plans stash nothing, so it changes nothing there)."""

    def __init__(self, ctx: StageContext, module: nn.Module | Sequence[nn.Module], *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 ps_model=None, pool=None, metrics=None, prefetcher=None,
                 p2p_groups: Mapping[Direction, Any] | None = None, predictor=None) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.device)
        chunks = [module] if isinstance(module, nn.Module) else list(module)
        if len(chunks) not in (1, 2) or not all(isinstance(c, nn.Module) for c in chunks):
            raise ValueError(f"module: an nn.Module, or a list of 2 (the chunks of a V plan), "
                             f"was expected; got {type(module).__name__} of {len(chunks)}")
        self.chunks = len(chunks)
        p, r = ctx.num_stages, ctx.stage
        self._first = [virtual_stage(r, c, p) == 0 for c in range(self.chunks)]
        self._last = [virtual_stage(r, c, p) == self.chunks * p - 1 for c in range(self.chunks)]
        self.module = module if self.chunks == 1 else nn.ModuleList(chunks)
        self.computes = [StageCompute(chunk, first=self._first[c], last=self._last[c],
                                      loss_fn=loss_fn) for c, chunk in enumerate(chunks)]
        self.compute = self.computes[0]
        self.ps_model, self.pool, self.predictor = ps_model, pool, predictor
        self.metrics, self.prefetcher = metrics, prefetcher
        if self.chunks > 1 and (pool is not None or self.device.type == "cuda"
                                or p2p_groups is not None):
            raise ValueError("a rank with 2 chunks runs on gloo (CPU) without an activation pool "
                             f"or per-direction groups for now; got device={self.device}, "
                             f"pool={pool is not None}, p2p_groups={p2p_groups is not None}")
        peers: dict[tuple[Direction, int], Peer] = {}
        self._local: set[tuple[Op, int]] = set()  # (SEND_*/RECV_*, chunk) handed off in memory
        for c in range(self.chunks):
            for op in (*_RECV, *_SEND):
                to = peer(r, c, op, p, self.chunks)
                if to is None:
                    continue
                if to[0] == r:
                    self._local.add((op, c))
                    continue
                rank = ctx.prev_rank if to[0] == r - 1 else ctx.next_rank
                direction = _RECV[op] if op in _RECV else _SEND[op]
                peers[direction, c] = Peer(stage=to[0], replica=ctx.replica, rank=rank)
        if p2p_groups is None and self.device.type == "cuda" and ctx.group is None and peers:
            p2p_groups = self._nccl_groups()
        self.link = StageLink(peers, device=self.device, timeout_s=ctx.timeout_s,
                              group=ctx.group, groups=p2p_groups)
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.max_live_versions = 0
        """The most weight versions whose copies were held at once (weight stashing)."""

    def _nccl_groups(self) -> dict[Direction, Any]:
        """NCCL needs a group per direction (``p2p.direction_groups``): made here, collectively,
        for the launcher's numbering (rank ``replica * num_stages + stage``)."""
        ctx = self.ctx
        rank = dist.get_rank()
        if (rank != ctx.replica * ctx.num_stages + ctx.stage
                or ctx.prev_rank not in (None, rank - 1) or ctx.next_rank not in (None, rank + 1)):
            raise ValueError(f"rank {rank} is not stage {ctx.stage} of replica {ctx.replica} in "
                             "the numbering rank = replica * num_stages + stage; pass p2p_groups "
                             "(one group per direction) or ctx.group")
        return direction_groups(stage=ctx.stage, num_stages=ctx.num_stages, replica=ctx.replica,
                                world_size=dist.get_world_size())

    @property
    def live_versions(self) -> int:
        """Weight versions whose copies are held now (weight stashing)."""
        return len(self._versions)

    def run_step(self, actions: Sequence[Action], inputs: Sequence[torch.Tensor] | None = None,
                 targets: Sequence[torch.Tensor] | None = None) -> StepReport:
        """Execute ``actions`` (this stage's list of a plan). ``inputs[mb]`` feeds micro-batch
        ``mb``'s F on the first stage (or the prefetcher, in F order); ``targets[mb]`` its loss
        on the last stage. Raises ``StageFailedError`` when a peer fails or misses the
        deadline; the pipeline cannot go on after that (transfers are half done on both sides),
        so the stage process should exit and the launcher restart the replica."""
        bad = [a for a in actions if a.stage != self.ctx.stage]
        if bad:
            raise ValueError(f"stage {self.ctx.stage} got actions of another stage: {bad[0]!r}")
        bad = [a for a in actions if not 0 <= a.chunk < self.chunks]
        if bad:
            raise ValueError(f"stage {self.ctx.stage} holds {self.chunks} chunk(s); got "
                             f"{bad[0]!r}")
        if any(self._last) and targets is None:
            raise ValueError("the last stage's run_step needs targets")
        if any(self._first) and inputs is None and self.prefetcher is None:
            raise ValueError("the first stage's run_step needs inputs or a prefetcher")
        plan = _analyse(actions)
        if plan.stash and self.chunks > 1:
            raise ValueError("a rank with 2 chunks runs flushing plans only (weight stashing "
                             "is not provided for chunks); got a flush-free plan")
        if self.pool is not None:
            self.pool.set_backward_order(plan.backward_order)
        sent0, recv0 = self.link.bytes_sent, self.link.bytes_received
        self.link.begin()
        for op, direction in _RECV.items():
            for c in range(self.chunks):
                if (op, c) in self._local:
                    continue
                mbs = [a.mb for a in actions if a.op is op and a.chunk == c]
                if mbs:
                    self.link.expect(direction, mbs, c)
        run = _Step(self, plan, inputs, targets)
        t0 = time.perf_counter()
        try:
            for i, a in enumerate(actions):
                self.link.poll()
                run.execute(i, a)
            self.link.finish()
        except BaseException:
            for compute in self.computes:
                compute.drop()
            self._versions.clear()
            self._leaves.clear()
            raise
        wall = time.perf_counter() - t0
        report = run.report(wall, max((a.step for a in actions), default=0),
                            self.link.bytes_sent - sent0, self.link.bytes_received - recv0)
        if self.metrics is not None:
            self.metrics.observe(report)
        return report

    # -- weight versions ----------------------------------------------------------------------
    def _params_of_step(self, step: int, version: int) -> dict[str, torch.Tensor]:
        """The leaves step ``step``'s micro-batches compute on: aliases of version
        ``version``'s copy (no memory of their own), each with its own ``.grad``, so two steps
        reading one version (2BW's steps 0 and 1) keep their gradients apart."""
        if step not in self._leaves:
            values = self._version(version)
            self._leaves[step] = {n: t.detach().requires_grad_(t.requires_grad)
                                  for n, t in values.items()}
        return self._leaves[step]

    def _version(self, v: int) -> dict[str, torch.Tensor]:
        """Version ``v``'s parameter values (copied from the module at its PULL, or at its
        first use)."""
        if v not in self._versions:
            values = self._values(v)
            self._versions[v] = {n: values[n].requires_grad_(p.requires_grad)
                                 for n, p in self.module.named_parameters()}
            self.max_live_versions = max(self.max_live_versions, len(self._versions))
        return self._versions[v]

    def _values(self, v: int) -> dict[str, torch.Tensor]:
        """New tensors of version ``v``'s values: the module's (exact, as pulled), or the
        predictor's view of them; the module's parameters are only read."""
        exact = {n: p.detach() for n, p in self.module.named_parameters()}
        if self.predictor is not None:
            return self.predictor.view(v, exact)
        return {n: t.clone() for n, t in exact.items()}

    def _pull(self, v: int, stash: bool) -> None:
        if not stash:
            return  # the PSModel's step() pulled; the next forward's pre-hooks wait for it
        if self.ps_model is not None:
            self.ps_model.synchronize()
        if v in self._versions:  # made at a first use before its PULL: refresh its values
            with torch.no_grad():
                for n, t in self._values(v).items():
                    self._versions[v][n].copy_(t)
        else:
            self._version(v)

    def _push(self, step: int, stash: bool) -> None:
        if stash:
            leaves = self._leaves.pop(step, {})
            for n, p in self.module.named_parameters():
                g = leaves[n].grad if n in leaves else None
                p.grad = None if g is None else g
        if self.ps_model is not None:
            self.ps_model.step()


class _Step:
    """The state of one ``run_step``: tensors between actions, losses and timings."""

    def __init__(self, rt: StageRuntime, plan: _Plan, inputs, targets) -> None:
        self.rt, self.plan, self.inputs, self.targets = rt, plan, inputs, targets
        self.timer = _Timer(rt.device)
        # keyed by (chunk, mb); a local hand-off's SEND puts into the peer chunk's dict
        self.received: dict[tuple[int, int], torch.Tensor] = {}   # RECV_F -> F
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}    # F -> SEND_F
        self.grads_in: dict[tuple[int, int], torch.Tensor] = {}   # RECV_B -> B/BW
        self.grads_out: dict[tuple[int, int], torch.Tensor] = {}  # B/BW -> SEND_B
        self.losses: list[float] = []
        self.io_s: dict[Op, list[float]] = {}
        self.micro_batch_size = 0
        self.peak = 0

    def execute(self, i: int, a: Action) -> None:
        rt, link = self.rt, self.rt.link
        key = (a.chunk, a.mb)
        if (a.op, a.chunk) in rt._local:
            self._hand_off(a)
        elif a.op is Op.RECV_F:
            self.received[key] = link.recv(Direction.FROM_PREV, a.mb, a.chunk)
        elif a.op is Op.RECV_B:
            self.grads_in[key] = link.recv(Direction.FROM_NEXT, a.mb, a.chunk)
        elif a.op is Op.SEND_F:
            link.send(Direction.TO_NEXT, a.mb, self.outputs.pop(key), a.chunk)
        elif a.op is Op.SEND_B:
            link.send(Direction.TO_PREV, a.mb, self.grads_out.pop(key), a.chunk)
        elif a.op in (Op.PULL, Op.PUSH):
            t0 = time.perf_counter()
            if a.op is Op.PULL:
                rt._pull(a.version, self.plan.stash)
            else:
                rt._push(a.step, self.plan.stash)
            self.io_s.setdefault(a.op, []).append(time.perf_counter() - t0)
        else:
            with self.timer.time(a.op):
                self._compute(i, a)
        if self.plan.stash:
            for v in [v for v, last in self.plan.last_use.items() if last == i]:
                rt._versions.pop(v, None)

    def _hand_off(self, a: Action) -> None:
        """A transfer between two chunks of this rank (the bottom of a V): the SEND moves the
        tensor into the other chunk's inbox; the RECV finds it there (the plan's order puts the
        SEND first, which the simulator checked)."""
        to = peer(self.rt.ctx.stage, a.chunk, a.op, self.rt.ctx.num_stages, self.rt.chunks)
        if a.op is Op.SEND_F:
            self.received[to[1], a.mb] = self.outputs.pop((a.chunk, a.mb)).detach()
        elif a.op is Op.SEND_B:
            self.grads_in[to[1], a.mb] = self.grads_out.pop((a.chunk, a.mb))
        else:
            box = self.received if a.op is Op.RECV_F else self.grads_in
            if (a.chunk, a.mb) not in box:
                raise ValueError(f"stage {self.rt.ctx.stage}: {a} before the local "
                                 f"{'SEND_F' if a.op is Op.RECV_F else 'SEND_B'} of chunk "
                                 f"{to[1]} (a plan the simulator would refuse)")

    def _compute(self, i: int, a: Action) -> None:
        rt = self.rt
        compute, c, key = rt.computes[a.chunk], a.chunk, (a.chunk, a.mb)
        params = rt._params_of_step(a.step, a.version) if self.plan.stash else None
        if a.op is Op.F:
            x = self._input(a)
            if not self.micro_batch_size and x.dim():
                self.micro_batch_size = int(x.shape[0])
            target = self.targets[a.mb] if rt._last[c] else None
            with self._pool_scope(a.mb):
                out = compute.forward(a.mb, x, target=target, m=self.plan.m[a.step],
                                      params=params)
            self.peak = max(self.peak, sum(cc.inflight for cc in rt.computes))
            if rt._last[c]:
                self.losses.append(out.item() * self.plan.m[a.step])
            else:
                self.outputs[key] = out
        elif a.op is Op.B:
            g = compute.backward_input(a.mb, self.grads_in.pop(key, None))
            if not rt._first[c]:
                self.grads_out[key] = g
        else:
            with self._sync_scope(i, a.step):
                if a.op is Op.W:
                    compute.backward_weight(a.mb)
                else:
                    g = compute.backward(a.mb, self.grads_in.pop(key, None))
                    if not rt._first[c]:
                        self.grads_out[key] = g

    def _input(self, a: Action) -> torch.Tensor:
        rt, mb = self.rt, a.mb
        if not rt._first[a.chunk]:
            return self.received.pop((a.chunk, mb))
        if self.inputs is not None:
            return self.inputs[mb].to(rt.device, non_blocking=True)
        return rt.prefetcher.get(timeout=rt.ctx.timeout_s)

    def _pool_scope(self, mb: int):
        pool = self.rt.pool
        if pool is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(pool.hooks())
        stack.enter_context(pool.microbatch(mb))
        return stack

    def _sync_scope(self, i: int, step: int):
        """Every weight-backward but the step's last runs without pushing (gradient
        accumulation); the last one's hooks hand the buckets to the communication thread."""
        ps = self.rt.ps_model
        if ps is None or self.plan.stash or self.plan.last_backward.get(step) == i:
            return contextlib.nullcontext()
        return ps.no_sync()

    def report(self, wall: float, step: int, sent: int, received: int) -> StepReport:
        spans = self.timer.seconds()
        busy = sum(sum(v) for v in spans.values())

        def mean(*ops: Op) -> float:
            xs = [x for op in ops for x in spans.get(op, self.io_s.get(op, []))]
            return sum(xs) / len(xs) if xs else 0.0

        # per micro-batch of the whole rank: with 2 chunks each op runs twice per micro-batch
        # (the simulator's StageTimes are per rank and split over the chunks the same way)
        k = self.rt.chunks
        times = StageTimes(f=k * mean(Op.F), b=k * mean(Op.B, Op.BW), w=k * mean(Op.W),
                           pull=mean(Op.PULL), push=mean(Op.PUSH))
        return StepReport(step=step, wall_s=wall, busy_s=busy,
                          bubble=1.0 - busy / wall if wall > 0 else 0.0, losses=self.losses,
                          times=times, p2p_bytes_sent=sent, p2p_bytes_received=received,
                          micro_batch_size=self.micro_batch_size, peak_inflight=self.peak)
