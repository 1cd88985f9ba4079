"""Overlap: backward's hooks hand buckets to the communication thread as their gradients appear,
and the next forward waits only where a module needs its parameters back.

One :class:`Overlap` per ``PSModel``. Parameters are grouped into buckets
(``worker.training.buckets``); a post-accumulate-grad hook per parameter counts the bucket's
gradients and submits the bucket (:meth:`Overlap.submit`) to the
:class:`~bitps.worker.training.comm.CommThread` once all exist; the forward pre-hook of every
module whose forward reads a parameter (watched in the first step,
``worker.training.readers``) waits for that parameter's bucket (:meth:`Overlap.await_bucket`).
The first steps run without overlap and are timed (``worker.training.utilization``); ``auto``
then turns overlap on above ``min_ratio`` of communication to compute (:meth:`Overlap.decide`),
as soon as the median of its ``probe_steps`` is known to lie on one side.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from bitps.proto.keyplan import KeyPlan
from bitps.worker.config import OverlapConfig
from bitps.worker.training.buckets import Bucket, make_buckets
from bitps.worker.training.comm import CommThread, Job
from bitps.worker.training.encoder import Encoder
from bitps.worker.training.readers import ReadTrace
from bitps.worker.training.staging import Staging
from bitps.worker.training.utilization import Decision, StepStats, StepTimer, decide, settled

__all__ = ["Overlap"]

log = logging.getLogger(__name__)


class Overlap:
    """The buckets, hooks and communication thread of one ``PSModel`` (``model``'s trainable
    ``params`` cut into ``plan``'s keys; payloads from ``staging``); ``clock()`` is the model's
    current step."""

    def __init__(self, model: torch.nn.Module, params: Sequence[tuple[str, torch.Tensor]],
                 plan: KeyPlan, encoder: Encoder, staging: Staging, cfg: OverlapConfig, *,
                 clock: Callable[[], int],
                 copies: Mapping[int, np.ndarray] | None = None) -> None:
        self.cfg = cfg
        self.copies = copies
        """The worker's copies by key, for recovering a lost shard (``PSClient.complete``);
        ``None``: a lost shard fails the bucket."""
        self.params = params
        self.plan = plan
        self.encoder = encoder
        self.client = encoder.client
        self.staging = staging
        self.clock = clock
        self.buckets: list[Bucket] = make_buckets(plan, [n for n, _ in params], cfg.bucket_bytes)
        self._bucket_of = [0] * len(params)
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self._lock = threading.Lock()
        self._reset_bucket_state()
        self._jobs: list[Job | None] = [None] * len(self.buckets)
        self._ready_events: list[torch.cuda.Event | None] = [None] * len(self.buckets)
        self.comm: CommThread | None = None
        """The communication thread while overlap is on; ``None`` while it is off."""
        self._comm_seen = 0.0
        self._no_sync = False
        self.timer = StepTimer()
        """Times each step's compute and exposed communication (the overlap decision's
        input, and the utilization metrics)."""
        self.last_stats: StepStats | None = None
        self._probe: list[StepStats] = []
        self.decision: Decision | None = None
        """Whether overlap is on and why; ``None`` while ``auto`` is still measuring."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                       for i, (_, p) in enumerate(params)]
        # Which module's forward reads each parameter, watched in the first step (nothing is in
        # flight then); the pre-hooks that wait for pulls go in before anything is pushed.
        self._trace: ReadTrace | None = ReadTrace(model, [p for _, p in params])
        if cfg.mode != "auto":
            self.decide(Decision(enabled=cfg.mode == "on", ratio=math.nan,
                                 min_ratio=cfg.min_ratio, reason=f"overlap mode {cfg.mode!r}"))

    # -- the decision -------------------------------------------------------------------------
    def decide(self, decision: Decision) -> None:
        """Take ``decision``: log and export it, and start the communication thread if on."""
        self.decision = decision
        log.info("rank %d: %s", self.client.cfg.rank, decision.describe())
        m = self.client.metrics
        with m.lock:
            m.overlap_enabled.set(int(decision.enabled))
            if not math.isnan(decision.ratio):
                m.comm_compute_ratio.set(decision.ratio)
        if decision.enabled:
            self.comm = CommThread(self.encoder, inflight_bytes=self.cfg.inflight_bytes,
                                   hold_pulls=self.client.holds_pulls,
                                   on_inflight=self._inflight_metric, copies=self.copies)
            self._comm_seen = 0.0

    def record(self, stats: StepStats) -> None:
        """One step's timing: kept, exported, and while ``auto`` measures, part of the probe
        (the first step warms up and is left out)."""
        self.last_stats = stats
        m = self.client.metrics
        with m.lock:
            m.compute_utilization.set(stats.utilization)
            m.exposed_comm.observe(stats.exposed_s)
            m.comm_time.observe(stats.comm_s)
            m.overlap_ratio.set(stats.overlap_ratio)
        if self.decision is None:
            self._probe.append(stats)
            # each probe step runs without overlap: stop as soon as the median's side is known
            if settled(self._probe[1:], self.cfg.min_ratio, self.cfg.probe_steps):
                self.decide(decide(self._probe[1:], self.cfg.min_ratio))

    def comm_seconds(self) -> float:
        """The communication thread's busy time since the last call."""
        busy = self.comm.busy_seconds()
        busy, self._comm_seen = busy - self._comm_seen, busy
        return busy

    def _inflight_metric(self, nbytes: int) -> None:
        with self.client.metrics.lock:
            self.client.metrics.inflight_bytes.set(nbytes)

    # -- hooks --------------------------------------------------------------------------------
    def _reset_bucket_state(self) -> None:
        self._fired = [False] * len(self.params)
        self._grads: dict[int, torch.Tensor] = {}
        self._left = [len(b.params) for b in self.buckets]
        self._held: bool | None = None  # decided once per step, by holding()

    def holding(self) -> bool:
        """Whether this step is held: pushed whole by ``PSModel.step`` with the exact clip
        factor rather than bucket by bucket from the hooks (``OverlapConfig.hold_when_clipping``
        ``on``, or ``sync`` with shards that hold pulls and compressed pushes: the last step
        clipped, or no step has yet). Decided once per step, after every bucket of the last
        step is done (the factor it ended with is made as its last payload is)."""
        if self._held is None:
            clip, hold = self.staging.clip, self.cfg.hold_when_clipping
            if clip is None or hold == "off" or (hold == "sync" and not (
                    self.client.holds_pulls and self.encoder.compressing(self.clock()))):
                self._held = False
            else:
                for job in self._jobs:
                    if job is not None:
                        job.wait(self.client.exchange_bound_s)
                self._held = clip.expects_clipping
        return self._held

    def end_held_step(self) -> None:
        """``PSModel.step`` pushed and pulled a held step (no hook pushed anything in it): count
        it, and decide afresh for the next step."""
        self._held = None
        with self.client.metrics.lock:
            self.client.metrics.held_steps.inc()

    def _hook_for(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self.comm is None or self._no_sync:
                return
            with self._lock:
                if self.holding():
                    return
                if self._fired[i]:
                    raise RuntimeError(
                        f"parameter {self.params[i][0]!r} got a second gradient in step "
                        f"{self.clock()} after it was pushed; accumulate inside "
                        f"PSModel.no_sync() and call step() once per step")
                self._fired[i] = True
                self._grads[i] = p.grad
                b = self._bucket_of[i]
                self._left[b] -= 1
                ready = self._left[b] == 0
            if ready:
                self.submit(self.buckets[b])
        return hook

    def install_waits(self) -> None:
        """End the read trace: every module whose forward reads a parameter
        (``worker.training.readers``) waits in its forward pre-hook for that parameter's
        bucket."""
        if self._trace is None:
            return
        waits, self._trace = self._trace.finish(), None
        for module, indices in waits.items():
            buckets = sorted({self._bucket_of[i] for i in indices})
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook_for(buckets)))

    def _pre_hook_for(self, buckets: list[int]):
        def pre_hook(module, args) -> None:
            for b in buckets:
                self.await_bucket(b)
        return pre_hook

    def await_bucket(self, b: int) -> None:
        """Wait for bucket ``b``'s answer (exposed time), re-raise its error, and on CUDA make
        the compute stream wait for its upload."""
        job = self._jobs[b]
        if job is None:
            return
        if not job.done.is_set():
            with self.timer.exposed():
                job.wait(self.client.exchange_bound_s)  # a lost shard's recovery included
        elif job.error is not None:
            job.wait(0)
        if self.staging.cuda and self._ready_events[b] is not None:
            torch.cuda.current_stream().wait_event(self._ready_events[b])
            self._ready_events[b] = None

    # -- buckets ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Push every bucket no hook pushed this step (zeros for missing gradients); then the
        next step starts with empty buckets."""
        pending = []
        with self._lock:
            for i, (_, p) in enumerate(self.params):
                if not self._fired[i]:
                    self._fired[i] = True
                    self._grads[i] = p.grad if p.grad is not None else torch.zeros_like(p)
                    b = self._bucket_of[i]
                    self._left[b] -= 1
                    if self._left[b] == 0:
                        pending.append(b)
        for b in pending:
            self.submit(self.buckets[b])
        self._reset_bucket_state()

    def submit(self, bucket: Bucket) -> None:
        """Hand ``bucket``'s gradients for this step to the communication thread."""
        self.install_waits()
        prev = self._jobs[bucket.index]
        if prev is not None and not prev.done.is_set():
            prev.wait(self.client.exchange_bound_s)  # its buffers are about to be reused
        grads = {i: self._grads[i] for i in bucket.params}
        clock = self.clock()
        keys = [self.plan.key(k) for k in bucket.keys]
        staging, cuda = self.staging, self.staging.cuda
        produced = ready = None
        if cuda:
            produced = torch.cuda.Event()
            produced.record()  # on the compute stream, after backward made these gradients
            ready = torch.cuda.Event()
        # The thread calls staging directly (no code of this module runs there): the payload
        # before sending, the prediction and upload once the parameters are in.
        prepare = functools.partial(staging.bucket_payload, keys, grads, clock, produced,
                                    buckets=len(self.buckets))
        finish = functools.partial(staging.copy_bucket_in, bucket.params, ready, bucket.keys) \
            if cuda or staging.prediction is not None else None
        job = Job(priority=bucket.priority, clock=clock, nbytes=bucket.nbytes, prepare=prepare,
                  finish=finish, label=f"bucket {bucket.index}")
        self._jobs[bucket.index] = job
        self._ready_events[bucket.index] = ready
        self.comm.submit(job)

    # -- the step's edges ---------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not push (gradient accumulation)."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def synchronize(self) -> None:
        """Wait until every bucket in flight has its parameters back."""
        for b in range(len(self.buckets)):
            self.await_bucket(b)
        if self.staging.cuda:
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Stop the communication thread and remove every hook (after :meth:`synchronize`)."""
        if self.comm is not None:
            self.comm.close()
        for h in self._hooks:
            h.remove()
