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
import time
from collections.abc import Iterator

import numpy as np
import torch

from bitps.proto.keyplan import KeyPlan, ParamSpec, make_plan
from bitps.worker.config import EncoderConfig, OverlapConfig
from bitps.worker.training import codec_torch
from bitps.worker.training.buckets import Bucket
from bitps.worker.training.clip import StepClip
from bitps.worker.training.encoder import Encoder
from bitps.worker.training.overlap import Overlap
from bitps.worker.training.staging import Staging
from bitps.worker.training.utilization import Decision, StepStats
from bitps.worker.transport.client import PSClient

__all__ = ["STATE_VERSION", "PSModel"]

STATE_VERSION = 1
"""Version of :meth:`PSModel.state_dict`'s layout."""


class PSModel:
    """Binds ``model``'s trainable parameters to the shards behind ``client``."""

    def __init__(self, model: torch.nn.Module, client: PSClient, *,
                 plan: KeyPlan | None = None,
                 device_codec: bool | None = None,
                 overlap: OverlapConfig | None = None,
                 encoder: EncoderConfig | None = None,
                 pushers: int | None = None) -> None:
        """``plan``: the whole model's plan (``make_plan`` over every pipeline stage's
        parameter names, in one agreed order), of which ``model`` holds some parameters (one
        stage): they are bound to its keys by name (``KeyPlan.bind``: a name the plan lacks is
        ``UnknownParametersError``, another shape ``PlanMismatchError``) and only their keys
        are registered, pushed and pulled. ``None``: ``model`` is the whole model, planned
        here.

        ``encoder``: how gradients are pushed (codec, error feedback, clipping:
        ``worker.training.encoder``); ``None``: raw float32 pushes, unless the client's
        (deprecated) ``ClientConfig`` compression fields say otherwise.

        ``pushers``: how many workers push each of this model's keys, for weight prediction
        (``worker.training.prediction``: async/ssp shards whose pulls are exact ask for it) and
        the push policy (1-bit Adam's momentum window); ``None``: the client's world size for a
        whole model, and neither for a part of one (a pipeline stage, whose keys its
        data-parallel replicas push)."""
        self.model = model
        self.client = client
        self.encoder = Encoder(encoder or EncoderConfig.from_client(client.cfg), client)
        """Turns this model's gradients into pushes."""
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {name!r} is {p.dtype}; bitps stores float32")
        specs = [ParamSpec(n, tuple(p.shape)) for n, p in self.params]
        if plan is None:
            plan = make_plan(specs, num_shards=client.num_shards,
                             partition_bytes=client.cfg.partition_bytes)
        else:
            if plan.num_shards != client.num_shards:
                raise ValueError(f"plan is cut for {plan.num_shards} shards; the client has "
                                 f"{client.num_shards} servers")
            plan = plan.bind(specs)
        self.plan: KeyPlan = plan
        """The keys this model registers: the whole plan, or a stage's part of it."""
        self.keys = [k.key for k in self.plan.keys]
        self._staging = Staging(self.params, self.plan, metrics=client.metrics)
        self.cuda = self._staging.cuda
        # the host copies hold the model's values now: the initializing worker (rank 0, or
        # replica 0 of a stage) sends them, and every rank's digests let the shards say which
        # copies are current (one seed, one model)
        outs = self._staging.outs
        copies = self._copies = dict(zip(self.keys, outs))
        replies = self.encoder.register(self.plan, copies if client.initializes else None,
                                        copies=copies, pushers=pushers)
        pushers = self.encoder.pushers  # the world size for a whole model
        predicted = [k for k in self.plan.keys if replies[k.shard].worker_lookahead]
        if predicted and pushers is not None and pushers > 1:
            self._staging.predict(predicted, ahead=pushers - 1, versions=client.versions)
            copies.update(zip(self.keys, outs))  # the exact copies: recovery rewrites them
        self.clock = client.start_clock
        if self._wants_device_codec(device_codec):  # the codec is the push codec throughout
            self._staging.device_codec = self.encoder.codec_at(self.clock)
            self._staging.device_keys = frozenset(
                k for k in self.keys if self.encoder.compresses(k, self.clock))
        stale = [i for i, k in enumerate(self.keys) if k not in client.versions]
        if stale:
            client.pull([self.keys[i] for i in stale], [outs[i] for i in stale],
                        clock=self.clock).wait()
        self._staging.copy_in()
        clip_norm = self.encoder.cfg.clip_norm_for(
            compressed=self.encoder.compressing(self.clock))
        # Clip the raw local gradient before error feedback adds the residual (DGC's local
        # clipping): clipping the compensated vector would eat the mass EF is carrying.
        if clip_norm > 0:
            self._staging.clip = StepClip(clip_norm)
        self._overlap = Overlap(model, self.params, self.plan, self.encoder, self._staging,
                                overlap or OverlapConfig(), clock=lambda: self.clock,
                                copies=copies)

    def _wants_device_codec(self, asked: bool | None) -> bool:
        """Compress where the gradients are (CUDA) with ``worker.training.codec_torch``: sign1
        and bf16 pushes, outside 1-bit Adam (whose sync mode pushes momenta). ``True`` on CPU
        runs the same torch path on CPU tensors (it produces the bytes of the numba kernels)."""
        name = self.encoder.cfg.push_codec.name
        possible = name in codec_torch.ENCODERS and not self.encoder.chooses_codecs
        if asked and not possible:
            raise ValueError(f"device_codec needs a push codec with a device encoder "
                             f"({' or '.join(sorted(codec_torch.ENCODERS))}) and shards whose "
                             f"rule leaves the codecs to the worker (the push policy is "
                             f"{type(self.encoder.policy).__name__}); push codec is {name!r}")
        return possible and (self.cuda if asked is None else asked)

    # -- what the parts decided -----------------------------------------------------------------
    @property
    def device_codec(self) -> bool:
        """Whether compressed pushes are encoded where the gradients are."""
        return self._staging.device_codec is not None

    @property
    def overlap(self) -> OverlapConfig:
        return self._overlap.cfg

    @property
    def overlapping(self) -> bool:
        """Whether pushes go from backward's hooks now (overlap on, or ``auto`` decided on):
        the communication thread may still read gradients after :meth:`step` returns."""
        return self._overlap.comm is not None

    @property
    def buckets(self) -> list[Bucket]:
        return self._overlap.buckets

    @property
    def decision(self) -> Decision | None:
        """Whether overlap is on and why; ``None`` while ``auto`` is still measuring."""
        return self._overlap.decision

    @property
    def last_stats(self) -> StepStats | None:
        """The last step's timing (compute, exposed and total communication)."""
        return self._overlap.last_stats

    # -- step ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Push this step's gradients, pull the parameters the shards computed, zero the grads.
        With overlap on, only what backward's hooks did not push goes now, and the pulls are
        waited for where the next forward needs them.

        A shard lost during the exchange (it timed out or restarted) is re-registered with and
        its part of the exchange redone (``PSClient.complete``; on the communication thread
        under overlap); a shard that came back from an older checkpoint hands out its
        parameters and its clock, and the steps it lost are counted. Past
        ``reconnect_timeout_s``, ``ShardLostError`` names the shard."""
        ov = self._overlap
        ov.install_waits()
        overlapped = ov.comm is not None and not ov.holding()
        if overlapped:
            with ov.timer.exposed():
                ov.flush()
            comm_s = ov.comm_seconds()
        else:  # overlap off, or a step held for its exact clip factor (Overlap.holding)
            comm_s = self._step_blocking()
            if ov.comm is not None:
                ov.end_held_step()
        self._advance()
        ov.record(ov.timer.end_step(comm_s=comm_s, overlapped=overlapped))

    def _step_blocking(self) -> float:
        """Overlap off: push (clipped: one payload, so with the exact factor) and pull
        everything, wait; return the communication time."""
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = [p.grad.reshape(-1) for _, p in self.params]
        staging = self._staging
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # compute ends here, not in the timer
        t0 = time.perf_counter()
        with self._overlap.timer.exposed():
            if self.cuda:
                staging.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(staging.stream):
                    payload = staging.payload(self.plan.keys, flat, self.clock)
            else:
                payload = staging.payload(self.plan.keys, flat, self.clock)
            handle = self.encoder.push_pull(payload.keys, payload.grads, payload.outs,
                                            clock=self.clock, encoded=payload.encoded,
                                            scale=payload.scale,
                                            corrections=payload.corrections,
                                            exact=payload.exact)
            # a lost shard is recovered here, and its part of the exchange redone
            self.client.complete(handle, self._copies)
            staging.copy_in()
        return time.perf_counter() - t0

    def _advance(self) -> None:
        self.clock += 1
        self.client.clock = self.clock
        with self.client.metrics.lock:
            self.client.metrics.clock.set(self.clock)
        for _, p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not push (gradient accumulation); the next backward
        outside pushes the accumulated gradients. Without overlap this changes nothing."""
        with self._overlap.no_sync():
            yield

    def synchronize(self) -> None:
        """Wait until every bucket in flight has its parameters back (overlap on): after this
        the module's parameters are the shards' values for :attr:`clock`."""
        self._overlap.synchronize()

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What this worker keeps beyond the parameters (which are the shards'), to resume it
        where it stopped: ``{"version": 1, "clock": int, "encoder": Encoder.state_dict(),
        "clip_factor": float, "device_residuals": {key: float32[length]}}``; the clip factor is
        the last step's exact one (predictions under overlap start from it), the device
        residuals the error feedback the device codec keeps. Call between steps (after
        :meth:`synchronize` under overlap); arrays are copies."""
        self.synchronize()
        clip = self._staging.clip
        return {"version": STATE_VERSION, "clock": self.clock,
                "encoder": self.encoder.state_dict(clock=self.clock),
                "clip_factor": clip.last_factor if clip is not None else 1.0,
                "device_residuals": {k: r.detach().cpu().numpy().copy()
                                     for k, r in self._staging.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` of the same model and settings (checked whole before
        anything changes: version, keys and shapes)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"PSModel state of version {state.get('version')!r}; expected "
                             f"{STATE_VERSION}")
        for key, r in state["device_residuals"].items():
            n = self.plan.key(key).length if key in self.plan else None
            if r.shape != (n,) or r.dtype != np.float32:
                raise ValueError(f"device residual of key {key} is {r.dtype}{r.shape}; "
                                 f"expected float32[{n}] (a key of this model's plan)")
        self.synchronize()
        self.encoder.load_state_dict(state["encoder"], clock=state["clock"])
        if self._staging.clip is not None:
            self._staging.clip.last_factor = float(state["clip_factor"])
        for key, r in state["device_residuals"].items():
            device = self.params[self._staging.index[self.plan.key(key).name]][1].device
            self._staging.residuals[key] = torch.from_numpy(r.copy()).to(device)

    def close(self) -> None:
        """Finish what is in flight, leave the shards and stop the client. Under weight
        prediction the module's parameters become the exact (pulled) ones."""
        try:
            self.synchronize()
            self._staging.show_exact()
        finally:
            self._overlap.close()
            self.encoder.close()
            self.client.close()
