"""``PSModel``: train any ``torch.nn.Module`` through the shards by adding about five lines.

    client = PSClient(ClientConfig(servers=servers, rank=rank, world_size=world_size))
    ps_model = PSModel(model, client)          # plan, register, pull rank 0's initial values
    for x, y in data:
        loss_fn(model(x), y).backward()
        ps_model.step()                        # push grads, pull updated params, zero grads
    ps_model.close()

The optimizer runs on the shards (``bitps-server --optimizer ...``); the worker holds no optimizer
state. Each trainable parameter is flattened and cut into keys by ``proto.keyplan``; on CPU the
pushes read ``param.grad`` in place and pulls write ``param.data`` in place (zero copies beyond
the socket). On CUDA, gradients are staged through pinned host buffers on a separate stream and
parameters copied back after the pull; with a sign1 or bf16 push codec they are compressed on the
GPU first (``worker.training.codec_torch``, the same bytes as the CPU kernels) and only the packed
bytes cross to the host. A parameter without a gradient in a step is pushed as zeros, as DDP reduces
unused parameters.

**Overlap** (``OverlapConfig``, default ``auto``). With overlap on, parameters are grouped into
buckets (``worker.training.buckets``); a post-accumulate-grad hook hands each bucket to the
communication thread (``worker.training.comm``) as soon as all its gradients exist, so pushes run
during the rest of backward; the forward pre-hook of every module whose forward reads a parameter
(watched in the first step: ``worker.training.readers``) waits for its bucket's answer, so pulls
overlap the end of backward and the early layers of the next forward. Clipped compressed pushes
overlap too, with per-bucket clip factors corrected through error feedback
(``worker.training.clip``). On CUDA the thread waits on an event recorded on the compute stream,
compresses or downloads on its own stream into pinned memory, and uploads the pulled values on that
stream; the compute stream only waits (on an event) where a module needs its parameters. ``step()``
then only pushes what no hook pushed, and returns without waiting. Contracts under overlap:
gradients are read when backward produces them (change them in a hook, not between ``backward()``
and ``step()``); accumulate over several backwards inside :meth:`PSModel.no_sync`; read parameters
outside a forward only after :meth:`PSModel.synchronize`. ``auto`` runs the first steps with overlap
off, measures communication against compute, and turns overlap on above ``min_ratio`` (logged, and
exported as ``bitps_worker_overlap_enabled`` / ``bitps_worker_comm_compute_ratio``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from bitps.proto.keyplan import Key, KeyPlan, ParamSpec, make_plan
from bitps.worker.config import OverlapConfig
from bitps.worker.training import codec_torch
from bitps.worker.training.buckets import Bucket, make_buckets
from bitps.worker.training.clip import StepClip
from bitps.worker.training.comm import CommThread, Job, Payload
from bitps.worker.training.readers import ReadTrace
from bitps.worker.training.utilization import Decision, StepStats, StepTimer, decide
from bitps.worker.transport.client import PSClient

__all__ = ["PSModel"]

log = logging.getLogger(__name__)


class PSModel:
    """Binds ``model``'s trainable parameters to the shards behind ``client``."""

    def __init__(self, model: torch.nn.Module, client: PSClient, *,
                 device_codec: bool | None = None,
                 overlap: OverlapConfig | None = None) -> None:
        self.model = model
        self.client = client
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {name!r} is {p.dtype}; bitps stores float32")
        self.plan: KeyPlan = make_plan(
            [ParamSpec(n, tuple(p.shape)) for n, p in self.params],
            num_shards=client.num_shards, partition_bytes=client.cfg.partition_bytes)
        self.cuda = any(p.is_cuda for _, p in self.params)
        self._index = {n: i for i, (n, _) in enumerate(self.params)}
        self._host = [self._host_buffer(p) for _, p in self.params]
        self._grad_host = [self._host_buffer(p) for _, p in self.params] if self.cuda else None
        self._stream = torch.cuda.Stream() if self.cuda else None  # the comm stream
        self.keys = [k.key for k in self.plan.keys]
        self._outs = self._key_views(self._host)
        if self.cuda:
            for (_, p), host in zip(self.params, self._host):
                host[:] = p.detach().reshape(-1).cpu().numpy()
        # the host copies hold the model's values now: rank 0 sends them, and every rank's
        # digests let the shards say which copies are current (one seed, one model)
        copies = dict(zip(self.keys, self._outs))
        client.register(self.plan, copies if client.cfg.rank == 0 else None, copies=copies)
        self.clock = client.start_clock
        self.device_codec = self._wants_device_codec(device_codec)
        self._residuals: dict[int, torch.Tensor] = {}  # device EF per key (device_codec)
        self._staged: dict[int, torch.Tensor] = {}  # pinned host payloads per key (CUDA)
        stale = [i for i, k in enumerate(self.keys) if k not in client.versions]
        if stale:
            client.pull([self.keys[i] for i in stale], [self._outs[i] for i in stale],
                        clock=self.clock).wait()
        self._copy_in()
        self._init_overlap(overlap or OverlapConfig())

    # -- codecs and staging ---------------------------------------------------------------------
    def _wants_device_codec(self, asked: bool | None) -> bool:
        """Compress where the gradients are (CUDA) with ``worker.training.codec_torch``: sign1 and
        bf16 pushes, outside 1-bit Adam (whose sync mode pushes momenta). ``True`` on CPU runs the
        same torch path on CPU tensors (it produces the bytes of the numba kernels)."""
        name = self.client.cfg.push_codec.name
        possible = name in codec_torch.ENCODERS and not self.client.freeze_step
        if asked and not possible:
            raise ValueError(f"device_codec needs a push codec with a device encoder "
                             f"({' or '.join(sorted(codec_torch.ENCODERS))}) and a shard "
                             f"without onebit_adam; push codec is {name!r}")
        return possible and (self.cuda if asked is None else asked)

    def _payload(self, keys: Sequence[Key], flat: Sequence[torch.Tensor], clock: int, *,
                 last: bool = True, whole: bool = True) -> Payload:
        """The push of ``keys`` for ``clock`` from the flat gradients ``flat`` (by parameter).
        On CUDA it must run with the comm stream current, after that stream has waited for the
        gradients; compressed keys are encoded on it (device codec) and everything else is
        downloaded to pinned memory, then the stream is synchronized. On CPU gradients are
        read in place. With clipping the payload carries its clip factor (``worker.training.clip``),
        found from the gradients' sum of squares, which is also their NaN/Inf check: exact
        when the payload is ``whole`` (every gradient of the step), else predicted and
        corrected once the step's ``last`` payload is prepared."""
        codec = self.client.push_codec_at(clock)
        coded = {k.key for k in keys if self.device_codec and self.client.compresses(k.key, clock)}
        scale = None
        if self._clip_pending and self._clip_pending[0][0] != clock:
            # a refused step never pushed its last payload: forget its factors
            self._clip_pending.clear()
            self._clip.reset()
        if self.device_codec and (coded or self._clip is not None):
            sum_squares = self._check_device(keys, coded, flat)
            if self._clip is not None:
                scale = self._clip.factor(sum_squares, whole=whole)
        encoded: dict[int, torch.Tensor] = {}
        grads: list[np.ndarray] = []
        for k in keys:
            g = self._slice(flat, k)
            if k.key in coded:
                encoded[k.key] = self._encode(k.key, g, codec, 1.0 if scale is None else scale)
                grads.append(self._grad_view(k) if self.cuda else g.detach().numpy())
                continue
            if self.cuda:
                host = self._grad_view(k)
                torch.from_numpy(host).copy_(g, non_blocking=True)
                grads.append(host)
            else:
                grads.append(g.detach().numpy())
        if self.cuda:
            self._stream.synchronize()
        if self._clip is not None and not self.device_codec:
            scale = self._clip.factor(self.client.sum_squares([k.key for k in keys], grads),
                                      whole=whole)
        if self._clip is not None:
            self._clip_pending.append((clock, keys, grads, flat, coded, scale))
        return Payload(keys=[k.key for k in keys], grads=grads,
                       outs=[self._outs[k.key] for k in keys],
                       encoded={key: code.numpy() for key, code in encoded.items()} or None,
                       scale=scale, then=self._end_clipped_step if self._clip is not None
                       and last else None)

    def _check_device(self, keys: Sequence[Key], coded: set[int],
                      flat: Sequence[torch.Tensor]) -> float:
        """The device codec folds each gradient into a residual kept next to it: refuse NaN/Inf
        before encoding (``NON_FINITE``, counted; residuals unchanged), as ``PSClient`` does for
        host codecs: one fused max-|g| per coded key (``torch._foreach_norm``, as
        ``clip_grad_norm_`` uses; the max cannot overflow). With clipping, also every key's
        L2 norm; returns their sum of squares. One device-to-host sync for all of it."""
        checked = [self._slice(flat, k) for k in keys if k.key in coded]
        peaks = torch._foreach_norm(checked, float("inf")) if checked else []
        norms = (torch._foreach_norm([self._slice(flat, k) for k in keys], 2.0)
                 if self._clip is not None else [])
        values = torch.stack([*peaks, *norms]).double().cpu()
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            first = int(torch.nonzero(~finite)[0])
            bad = [k for k in keys if k.key in coded] + list(keys)
            raise self.client.refuse_nonfinite(bad[first].key)
        return float(values[len(peaks):].square().sum())

    def _end_clipped_step(self) -> None:
        """Once the step's last payload is pushed (its error feedback encoded): the exact clip
        factor is known, and every payload of the step gets ``(exact - used) * g`` folded into
        its error feedback (``worker.training.clip``): device residuals here (on the comm stream),
        the client's for the rest."""
        exact = self._clip.end()
        pending, self._clip_pending = self._clip_pending, []
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext():
            for clock, keys, grads, flat, coded, used in pending:
                if used == exact:
                    continue
                alpha = float(np.float32(exact - used))
                for k in keys:
                    if k.key in coded:
                        self._residuals[k.key].add_(self._slice(flat, k) * alpha)
                host = [(k.key, g) for k, g in zip(keys, grads) if k.key not in coded]
                if host:
                    self.client.clip_correct([key for key, _ in host], [g for _, g in host],
                                             clock=clock, used=used, exact=exact)

    def _slice(self, flats: Sequence, k: Key):
        """Key ``k``'s slice of its parameter's flat array (``flats`` by parameter: gradients,
        host buffers)."""
        return flats[self._index[k.name]][k.offset:k.offset + k.length]

    def _grad_view(self, k: Key) -> np.ndarray:
        return self._slice(self._grad_host, k)

    def _encode(self, key: int, g: torch.Tensor, codec, scale: float) -> torch.Tensor:
        """One key's compressed push of ``g * scale`` with its error feedback kept next to the
        gradient; on CUDA the packed bytes are copied to a pinned buffer (not yet
        synchronized)."""
        r = self._residuals.get(key)
        if r is None:
            r = self._residuals[key] = torch.zeros_like(g)
        code = codec_torch.encode(g, r, codec, scale)
        if not self.cuda:
            return code
        host = self._staged.get(key)
        if host is None:
            host = self._staged[key] = torch.empty(code.numel(), dtype=torch.uint8,
                                                   pin_memory=True)
        host.copy_(code, non_blocking=True)
        return host

    def _host_buffer(self, p: torch.Tensor) -> np.ndarray:
        if p.is_cuda:
            return torch.empty(p.numel(), dtype=torch.float32, pin_memory=True).numpy()
        # CPU: the flat parameter itself, so pulls land in the model with no extra copy.
        if not p.data.is_contiguous():
            raise ValueError("bitps needs contiguous parameters")
        return p.data.view(-1).numpy()

    def _key_views(self, flats: list[np.ndarray]) -> list[np.ndarray]:
        return [self._slice(flats, k) for k in self.plan.keys]

    def _copy_in(self) -> None:
        """Upload every pulled value on the comm stream, which the compute stream then waits
        for (CUDA; on CPU pulls wrote the parameters in place)."""
        if not self.cuda:
            return
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for (_, p), host in zip(self.params, self._host):
                p.data.view(-1).copy_(torch.from_numpy(host), non_blocking=True)
        torch.cuda.current_stream().wait_stream(self._stream)

    # -- step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Push this step's gradients, pull the parameters the shards computed, zero the grads.
        With overlap on, only what backward's hooks did not push goes now, and the pulls are
        waited for where the next forward needs them."""
        self._install_waits()
        if self._comm is not None:
            with self._timer.exposed():
                self._flush()
            comm_s = self._comm.busy_seconds()
            comm_s, self._comm_seen = comm_s - self._comm_seen, comm_s
        else:
            comm_s = self._step_blocking()
        self._advance()
        stats = self._timer.end_step(comm_s=comm_s, overlapped=self._comm is not None)
        self._record(stats)

    def _step_blocking(self) -> float:
        """Overlap off: push (clipped: one payload, so with the exact factor) and pull
        everything, wait; return the communication time."""
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = [p.grad.reshape(-1) for _, p in self.params]
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # compute ends here, not in the timer
        t0 = time.perf_counter()
        with self._timer.exposed():
            if self.cuda:
                self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    payload = self._payload(self.plan.keys, flat, self.clock)
            else:
                payload = self._payload(self.plan.keys, flat, self.clock)
            handle = self.client.push_pull(payload.keys, payload.grads, payload.outs,
                                           clock=self.clock, encoded=payload.encoded,
                                           scale=payload.scale)
            if payload.then is not None:
                payload.then()
            handle.wait()
            self._copy_in()
        return time.perf_counter() - t0

    def _advance(self) -> None:
        self.clock += 1
        self.client.clock = self.clock
        with self.client.metrics.lock:
            self.client.metrics.clock.set(self.clock)
        for _, p in self.params:
            p.grad = None

    def _record(self, stats: StepStats) -> None:
        self.last_stats = stats
        m = self.client.metrics
        with m.lock:
            m.compute_utilization.set(stats.utilization)
            m.exposed_comm.observe(stats.exposed_s)
            m.comm_time.observe(stats.comm_s)
            m.overlap_ratio.set(stats.overlap_ratio)
        if self.decision is None:
            self._probe.append(stats)
            if len(self._probe) > self.overlap.probe_steps:  # the first step warms up
                self._decide(decide(self._probe[1:], self.overlap.min_ratio))

    # -- overlap ------------------------------------------------------------------------------
    def _init_overlap(self, cfg: OverlapConfig) -> None:
        self.overlap = cfg
        self.buckets: list[Bucket] = make_buckets(self.plan, [n for n, _ in self.params],
                                                  cfg.bucket_bytes)
        self._bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self._lock = threading.Lock()
        self._reset_bucket_state()
        self._jobs: list[Job | None] = [None] * len(self.buckets)
        self._ready_events: list[torch.cuda.Event | None] = [None] * len(self.buckets)
        self._comm: CommThread | None = None
        self._comm_seen = 0.0
        self._no_sync = False
        self._timer = StepTimer()
        self.last_stats: StepStats | None = None
        self._probe: list[StepStats] = []
        self.decision: Decision | None = None
        clip_norm = self.client.cfg.clip_norm
        # Clip the raw local gradient before error feedback adds the residual (DGC's local
        # clipping): clipping the compensated vector would eat the mass EF is carrying.
        clips = clip_norm > 0 and (not self.client.push_codec_at(self.clock).is_raw
                                   or bool(self.client.freeze_step))
        self._clip = StepClip(clip_norm) if clips else None
        self._clip_pending: list = []
        self._prepared = 0  # this step's buckets prepared so far (communication thread)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                       for i, (_, p) in enumerate(self.params)]
        # Which module's forward reads each parameter, watched in the first step (nothing is in
        # flight then); the pre-hooks that wait for pulls go in before anything is pushed.
        self._trace: ReadTrace | None = ReadTrace(self.model, [p for _, p in self.params])
        if cfg.mode != "auto":
            self._decide(Decision(enabled=cfg.mode == "on", ratio=math.nan,
                                  min_ratio=cfg.min_ratio, reason=f"overlap mode {cfg.mode!r}"))

    def _decide(self, decision: Decision) -> None:
        self.decision = decision
        log.info("rank %d: %s", self.client.cfg.rank, decision.describe())
        m = self.client.metrics
        with m.lock:
            m.overlap_enabled.set(int(decision.enabled))
            if not math.isnan(decision.ratio):
                m.comm_compute_ratio.set(decision.ratio)
        if decision.enabled:
            self._comm = CommThread(self.client, inflight_bytes=self.overlap.inflight_bytes,
                                    hold_pulls=self.client.holds_pulls,
                                    on_inflight=self._inflight_metric)
            self._comm_seen = 0.0

    def _inflight_metric(self, nbytes: int) -> None:
        with self.client.metrics.lock:
            self.client.metrics.inflight_bytes.set(nbytes)

    def _reset_bucket_state(self) -> None:
        self._fired = [False] * len(self.params)
        self._grads: dict[int, torch.Tensor] = {}
        self._left = [len(b.params) for b in self.buckets]

    def _hook_for(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self._comm is None or self._no_sync:
                return
            with self._lock:
                if self._fired[i]:
                    raise RuntimeError(
                        f"parameter {self.params[i][0]!r} got a second gradient in step "
                        f"{self.clock} after it was pushed; accumulate inside "
                        f"PSModel.no_sync() and call step() once per step")
                self._fired[i] = True
                self._grads[i] = p.grad
                b = self._bucket_of[i]
                self._left[b] -= 1
                ready = self._left[b] == 0
            if ready:
                self._submit(self.buckets[b])
        return hook

    def _install_waits(self) -> None:
        """End the read trace: every module whose forward reads a parameter
        (``worker.training.readers``) waits in its forward pre-hook for that parameter's bucket."""
        if self._trace is None:
            return
        waits, self._trace = self._trace.finish(), None
        for module, indices in waits.items():
            buckets = sorted({self._bucket_of[i] for i in indices})
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook_for(buckets)))

    def _pre_hook_for(self, buckets: list[int]):
        def pre_hook(module, args) -> None:
            for b in buckets:
                self._await(b)
        return pre_hook

    def _await(self, b: int) -> None:
        job = self._jobs[b]
        if job is None:
            return
        if not job.done.is_set():
            with self._timer.exposed():
                job.wait(self.client.cfg.deadline_s)
        elif job.error is not None:
            job.wait(0)
        if self.cuda and self._ready_events[b] is not None:
            torch.cuda.current_stream().wait_event(self._ready_events[b])
            self._ready_events[b] = None

    def _flush(self) -> None:
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
            self._submit(self.buckets[b])
        self._reset_bucket_state()

    def _submit(self, bucket: Bucket) -> None:
        """Hand ``bucket``'s gradients for this step to the communication thread."""
        self._install_waits()
        prev = self._jobs[bucket.index]
        if prev is not None and not prev.done.is_set():
            prev.wait(self.client.cfg.deadline_s)  # its buffers are about to be reused
        grads = {i: self._grads[i] for i in bucket.params}
        clock = self.clock
        keys = [self.plan.keys[k] for k in bucket.keys]
        produced = ready = None
        if self.cuda:
            produced = torch.cuda.Event()
            produced.record()  # on the compute stream, after backward made these gradients
            ready = torch.cuda.Event()

        def prepare() -> Payload:
            # the thread prepares one step's buckets before the next step's (worker.training.comm)
            self._prepared += 1
            last = self._prepared == len(self.buckets)
            if last:
                self._prepared = 0
            whole = len(self.buckets) == 1  # one bucket holds the step: its factor is exact
            flat: list[torch.Tensor | None] = [None] * len(self.params)
            for i, g in grads.items():
                flat[i] = g.reshape(-1)
            if not self.cuda:
                return self._payload(keys, flat, clock, last=last, whole=whole)
            self._stream.wait_event(produced)
            for g in grads.values():
                g.record_stream(self._stream)  # freed grads are not reused under our reads
            with torch.cuda.stream(self._stream):
                return self._payload(keys, flat, clock, last=last, whole=whole)

        def finish() -> None:
            with torch.no_grad(), torch.cuda.stream(self._stream):
                for i in bucket.params:
                    self.params[i][1].data.view(-1).copy_(torch.from_numpy(self._host[i]),
                                                          non_blocking=True)
                ready.record()

        job = Job(priority=bucket.priority, clock=clock, nbytes=bucket.nbytes, prepare=prepare,
                  finish=finish if self.cuda else None, label=f"bucket {bucket.index}")
        self._jobs[bucket.index] = job
        self._ready_events[bucket.index] = ready
        self._comm.submit(job)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not push (gradient accumulation); the next backward
        outside pushes the accumulated gradients. Without overlap this changes nothing."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def synchronize(self) -> None:
        """Wait until every bucket in flight has its parameters back (overlap on): after this
        the module's parameters are the shards' values for :attr:`clock`."""
        for b in range(len(self.buckets)):
            self._await(b)
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Finish what is in flight, leave the shards and stop the client."""
        try:
            self.synchronize()
        finally:
            if self._comm is not None:
                self._comm.close()
            for h in self._hooks:
                h.remove()
            self.client.close()
