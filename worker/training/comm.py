"""``CommThread``: the worker thread that sends buckets and receives their parameters.

``PSModel`` (overlap on) hands it one :class:`Job` per bucket from a backward hook, and waits on
the job in the forward pre-hook of the module that owns the bucket. The thread:

1. takes the waiting job of the earliest clock with the lowest ``priority`` (front layers
   first: the next forward needs them first; one step's jobs all go before the next step's),
   unless ``inflight_bytes`` of gradients are already in flight (the credit window; one job
   may always go);
2. runs ``job.prepare()`` (on CUDA: wait for the compute stream's event, compress or download
   on the comm stream into pinned memory) and sends the bucket's keys: one ``push_pull``, or,
   when the shards may hold pulls for other workers' pushes (``hold_pulls``: sync with more
   than one worker), a ``push`` and then a ``pull`` for the next clock;
3. while jobs are in flight, waits for replies *or* a new job at once (a pipe it polls beside
   the sockets), so neither a reply nor a new bucket waits for the other;
4. returns a job's credit when its push is answered, and once its parameters have arrived runs
   ``job.finish()`` (on CUDA: upload them on the comm stream) and marks the job done; a failure
   is kept on the job and raised by ``Job.wait`` on the waiting thread. Given ``copies``, a
   push or pull that failed because its shard was lost is recovered first, on this thread
   (``PSClient.complete``: re-register, redo), and only a shard that stays lost fails the job.

Why the credit is held by the push alone: a sync shard answers a bucket's pull only when every
worker has pushed that bucket. Were the pull's answer to hold the credit, worker A could wait
for bucket X with its window full while worker B waited for bucket Y, B's X and A's Y queued
behind those windows: a circular wait. A shard answers a push on arrival, whatever the other
workers do, so a window of pushes always drains and every worker gets every bucket out. (An ssp
pull waits for clocks instead, which every worker's first push of a step advances: the slowest
worker's pulls are always admitted, so a ``push_pull`` there cannot wedge, and it saves one
message per bucket: 3.5 % of the step at communication = compute, measured with one worker.)

Torch-free: what is CUDA-specific lives in the ``prepare``/``finish`` callables. The thread owns
its ZeroMQ channel (``PSClient`` keeps channels per thread), so no socket is shared.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from bitps.proto.wire import PSError
from bitps.worker.training.encoder import Encoder
from bitps.worker.training.payload import Payload
from bitps.worker.transport.channel import Handle, PSTimeoutError

__all__ = ["CommThread", "Job"]

log = logging.getLogger(__name__)
_SLICE_S = 0.05  # longest wait with jobs in flight; the loop re-checks for closing between


@dataclass(eq=False)
class Job:
    """One bucket's push_pull for one step."""

    priority: int
    """Lower is sent first."""
    clock: int
    """The step the gradients belong to."""
    nbytes: int
    """Float32 gradient bytes (what the credit window counts)."""
    prepare: Callable[[], Payload]
    """Runs on the communication thread right before sending."""
    finish: Callable[[], None] | None = None
    """Runs on the communication thread once the parameters have arrived."""
    label: str = ""
    """Names the job in errors (``bucket 3``)."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    handle: Handle | None = None
    """Completes when the parameters have arrived (the ``push_pull``, or the ``pull``)."""
    credit: Handle | None = None
    """Completes when the push is answered: the job then gives its credit back."""
    submitted: float = 0.0
    """``time.perf_counter()`` when handed to the thread, when sent, and when done."""
    sent: float = 0.0
    finished: float = 0.0

    def wait(self, timeout_s: float) -> None:
        """Block until the job is done; re-raise its failure here, or raise
        :class:`PSTimeoutError` after ``timeout_s``."""
        if not self.done.wait(timeout_s):
            raise PSTimeoutError(f"{self.label} of clock {self.clock}: not done after "
                                 f"{timeout_s:.1f} s")
        if self.error is not None:
            raise self.error


class CommThread:
    """Sends queued jobs by priority under a credit window and completes them."""

    def __init__(self, encoder: Encoder, *, inflight_bytes: int, hold_pulls: bool = False,
                 on_inflight: Callable[[int], None] | None = None,
                 copies: Mapping[int, np.ndarray] | None = None) -> None:
        self.encoder = encoder
        """Encodes and pushes each bucket's gradients (``worker.training.encoder``)."""
        self.client = encoder.client
        """Pulls, receives and recovers (``worker.transport.client``)."""
        self.copies = copies
        """The worker's copies by key (``PSClient.complete``); ``None``: no recovery."""
        self.inflight_bytes = inflight_bytes
        self.hold_pulls = hold_pulls
        """The shards may hold pulls (``PSClient.holds_pulls``): push and pull apart."""
        self._on_inflight = on_inflight or (lambda nbytes: None)
        self._lock = threading.Lock()
        self._ready: list[tuple[int, int, int, Job]] = []  # heap of (clock, priority, seq, job)
        self._seq = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._busy_since: float | None = None
        self.busy_s = 0.0
        """Seconds during which at least one job was being prepared or in flight (the union
        of their intervals): the communication time, overlapped or not."""
        self._thread = threading.Thread(target=self._run, name="bitps-comm", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (any thread)."""
        job.submitted = time.perf_counter()
        with self._lock:
            if self._closing:
                raise RuntimeError("the communication thread is closed")
            heapq.heappush(self._ready, (job.clock, job.priority, next(self._seq), job))
        os.write(self._wake_w, b"\0")

    def busy_seconds(self) -> float:
        """:attr:`busy_s` including the interval still open."""
        with self._lock:
            since = self._busy_since
            return self.busy_s + (time.perf_counter() - since if since is not None else 0.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the jobs already queued or in flight are done (or ``timeout_s``)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        os.write(self._wake_w, b"\0")
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck on a dead shard: it ends at the jobs' deadlines
            log.warning("communication thread still busy after %.0f s; leaving it", timeout_s)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        inflight: list[Job] = []  # pushes not yet answered: they hold credit
        waiting: list[Job] = []  # pushes answered, parameters not yet arrived
        used = 0
        while True:
            self._drain_wake()
            used = self._launch(inflight, used)
            used = self._complete(inflight, waiting, used)
            with self._lock:
                idle = not inflight and not waiting and not self._ready
                if idle and self._busy_since is not None:
                    self.busy_s += time.perf_counter() - self._busy_since
                    self._busy_since = None
                if idle and self._closing:
                    return
            if inflight or waiting:
                try:
                    self.client.progress(_SLICE_S, wake_fd=self._wake_r)
                except Exception:  # a broken channel: fail what waits on it, keep serving
                    log.exception("communication thread: receive failed")
                    for job in inflight + waiting:
                        self._fail(job, RuntimeError(f"{job.label}: receive failed"))
                    inflight.clear()
                    waiting.clear()
                    used = 0
                    self._on_inflight(0)
            elif idle:
                # nothing queued or in flight: only submit() or close() has anything for this
                # thread, and both write to the pipe. A timed wait woke 20 times a second for
                # nothing, 0.1-0.25 ms of CPU each on a small VM (docs/benchmarks.md).
                select.select([self._wake_r], [], [])

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _launch(self, inflight: list[Job], used: int) -> int:
        while True:
            with self._lock:
                if not self._ready:
                    return used
                job = self._ready[0][-1]
                if inflight and used + job.nbytes > self.inflight_bytes:
                    return used
                heapq.heappop(self._ready)
                if self._busy_since is None:
                    self._busy_since = time.perf_counter()
            try:
                p = job.prepare()
                job.sent = time.perf_counter()
                if self.hold_pulls:
                    job.credit = self.encoder.push(p.keys, p.grads, clock=job.clock,
                                                   encoded=p.encoded, scale=p.scale,
                                                   corrections=p.corrections, exact=p.exact)
                    job.handle = self.client.pull(p.keys, p.outs, clock=job.clock + 1)
                else:
                    job.credit = job.handle = self.encoder.push_pull(
                        p.keys, p.grads, p.outs, clock=job.clock, encoded=p.encoded,
                        scale=p.scale, corrections=p.corrections, exact=p.exact)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                self._fail(job, err)
                continue
            inflight.append(job)
            used += job.nbytes
            self._on_inflight(used)

    def _complete(self, inflight: list[Job], waiting: list[Job], used: int) -> int:
        pushed = [j for j in inflight if j.credit.done()]
        for job in pushed:
            inflight.remove(job)
            used -= job.nbytes
            try:
                self._settle(job, "credit")  # raises the shard's error, if any
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                self._fail(job, err)  # its pull, if any, ends unread at its deadline
                continue
            waiting.append(job)
        if pushed:
            self._on_inflight(used)
        for job in [j for j in waiting if j.handle.done()]:
            waiting.remove(job)
            try:
                self._settle(job, "handle")
                if job.finish is not None:
                    job.finish()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                self._fail(job, err)
                continue
            job.finished = time.perf_counter()
            job.done.set()
        return used

    def _settle(self, job: Job, which: str) -> None:
        """Raise the failure of ``job``'s completed ``credit`` or ``handle``, after recovering
        a lost shard and redoing its part when this thread has ``copies`` (blocking: the other
        jobs wait, and their replies are received meanwhile)."""
        handle = getattr(job, which)
        try:
            handle.wait(0.0)  # completed: this raises its failure, if any
            return
        except PSError:
            if self.copies is None:
                raise
        done = self.client.complete(handle, self.copies)
        if done is not handle:
            if job.handle is handle:  # a push_pull: its credit and its parameters
                job.handle = done
            if job.credit is handle:
                job.credit = done

    @staticmethod
    def _fail(job: Job, err: BaseException) -> None:
        if not isinstance(err, Exception):
            err = RuntimeError(f"{job.label}: {err!r}")
        job.error = err
        job.finished = time.perf_counter()
        job.done.set()

