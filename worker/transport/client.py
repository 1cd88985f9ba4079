"""``PSClient``: a worker's connection to every shard.

``push``, ``pull`` and ``push_pull`` send at once from the calling thread and return a
:class:`~bitps.worker.transport.channel.Handle`; ``Handle.wait()`` blocks until every shard involved
has answered, with a deadline. Each submitting thread gets its own
:class:`~bitps.worker.transport.channel.Channel` (DEALER sockets; ZeroMQ sockets are not
thread-safe), so no thread hand-off sits on the latency path.
Payloads go out zero-copy: arrays passed to ``push``/``push_pull`` must stay unchanged until the
handle completes (the handle keeps them alive); pulled values are copied straight from the
received frame into the caller's ``outs``.

    client = PSClient(ClientConfig(servers=("127.0.0.1:50051",), rank=0, world_size=1))
    client.register(plan, values)                       # rank 0 sends initial values
    client.push_pull(keys, grads, outs, clock=0).wait()
    client.close()

With ``curve_server_key`` and ``curve_client_key`` every DEALER is a CURVE client (encrypted,
and authenticated by the shards' ZAP handler), with ``tls_ca_file`` the gRPC channels take TLS
(docs/security.md). The files are read in the constructor; a bad one is a ``KeyFileError``
naming it. Registration checks that both sides agree on CURVE (``ps.control``), so a key
configured on one side only is an ``UNAUTHENTICATED`` error there, not a data plane that never
answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np
import zmq

from bitps import native
from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.codecs import RAW, Codec, Compressor
from bitps.proto.keyplan import KeyPlan, value_digest
from bitps.proto.keys import load_key_pair, load_public_key, read_pem
from bitps.proto.wire import PROTOCOL, PSError
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import CodecSnapshot, WorkerMetrics
from bitps.worker.transport.channel import (
    Channel,
    CurveClient,
    Handle,
    PSTimeoutError,
    Request,
    ShardLostError,
)
from bitps.worker.transport.push_policy import CODEC_PUSH, PushPolicy, for_registration

__all__ = ["Handle", "PSClient", "PSTimeoutError", "RECOVERABLE", "ShardLostError"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
_ERROR_METADATA_KEY = "bitps-error-code"
_TOKEN_METADATA_KEY = "bitps-token"  # checked by the shard before it reads a request
_CURVE_KEY_METADATA_KEY = "bitps-curve-key"  # ps.control: what the data plane will refuse
_CURVE_SERVER_KEY_METADATA_KEY = "bitps-curve-server-key"
_REGISTER_RETRY_S = (0.02, 0.5)  # first and longest pause between Register calls
_U64 = (1 << 64) - 1
RECOVERABLE = frozenset({pb.DEADLINE, pb.NOT_REGISTERED, pb.NOT_INITIALIZED, pb.BAD_CLOCK})
"""Failures of one shard that :meth:`PSClient.complete` recovers from: no answer in time (the
shard died, or the connection dropped), a shard that does not know this worker or is not
initialized (it restarted), and a clock it does not take (it restarted from an older
checkpoint). Anything else is the caller's or the shard's bug and is raised as it is."""


class PSClient:
    """One worker rank's client for all shards of a cluster."""

    def __init__(self, cfg: ClientConfig, *, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        self.num_shards = len(cfg.servers)
        self.curve = _curve_keys(cfg)
        """This worker's CURVE keys for the data plane, or ``None``: plain ZeroMQ."""
        self.on_slow_wait: Callable[[int, float], object] | None = None
        """Called by ``Handle.wait`` as ``on_slow_wait(shard, waited_s)`` once per shard still
        owing an answer when half the wait's limit has passed (``bitps-worker`` logs
        ``describe_wait`` of the shard's Status). It runs on the waiting thread, so it must
        return quickly; what it raises is logged, never raised. Read when a handle is
        created."""
        # gRPC's own reconnect backoff (1 s growing to 120 s by default) would hide a shard
        # that is back: bound it by the worker's reconnect backoff.
        backoff = (int(cfg.reconnect_backoff_s * 1000), int(cfg.reconnect_backoff_max_s * 1000))
        opts = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", max(backoff[0], 1)),
                ("grpc.min_reconnect_backoff_ms", max(backoff[0], 1)),
                ("grpc.max_reconnect_backoff_ms", max(backoff[1], 1))]
        tls = _tls_credentials(cfg)
        self._grpc = [grpc.insecure_channel(s, options=opts) if tls is None
                      else grpc.secure_channel(s, tls, options=opts) for s in cfg.servers]
        self._stubs = [pb_grpc.ControlStub(c) for c in self._grpc]
        self.plan: KeyPlan | None = None
        self._large: dict[int, bool] = {}
        self._large_for: KeyPlan | None = None
        self.versions: dict[int, int] = {}
        self.start_clock = 0
        self.clock = 0
        self.holds_pulls = False
        """Set at registration: the shards may hold a pull until other workers push the same
        keys (sync, more than one worker), so a pull must never hold back this worker's own
        pushes (``worker.training.comm``)."""
        self._heartbeat_min_clock = 0
        self.shift = [0] * self.num_shards
        """Per shard: what its clock is ahead of this worker's (negative: behind). Requests to
        shard ``s`` for step ``c`` carry clock ``c + shift[s]``; nonzero once a shard came back
        from a checkpoint older than this worker's clock (:meth:`recover`)."""
        self._ids = itertools.count(1)
        self.incarnation = secrets.randbits(63) | 1
        """Names this client's life on the wire: with the request id, it makes every push
        unique, so a shard applies a replayed push once (``ServerConfig.dedup_window``)."""
        self._ctx = zmq.Context()
        self._endpoints: list[str] = []
        self._local = threading.local()
        self._channels: list[Channel] = []  # one per submitting thread
        self._channels_lock = threading.Lock()
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._push_codec = Codec.from_config(cfg.push_codec)
        self.pull_codec = Codec.from_config(cfg.pull_codec or cfg.push_codec)
        """What the shards publish for this worker's pulls (registered; ``ps.publish``)."""
        self._compressors: dict[tuple[int, int], Compressor] = {}
        self.policy: PushPolicy = CODEC_PUSH
        """What pushes carry (``worker.transport.push_policy``), set at registration: the gradients
        through the push codec, unless the shards' rule calls for another (1-bit Adam)."""
        self.metrics.watch_codecs(self._codec_snapshot)

    @property
    def _metadata(self) -> tuple | None:
        """The token as call metadata: shards check it before they read a request; and this
        worker's CURVE public key, which a CURVE shard checks at Register."""
        md = ((_TOKEN_METADATA_KEY, self.cfg.token),) if self.cfg.token else ()
        if self.curve is not None:
            md += ((_CURVE_KEY_METADATA_KEY, self.curve.public.decode()),)
        return md or None

    @property
    def stubs(self) -> tuple[pb_grpc.ControlStub, ...]:
        """The gRPC ``Control`` stubs, by shard (read-only: for diagnosis, e.g.
        ``describe_wait``; calls must carry the token metadata)."""
        return tuple(self._stubs)

    @property
    def initializes(self) -> bool:
        """Whether this worker sends the initial values of its keys at registration (and to a
        shard that came back empty): ``ClientConfig.initializes``, by default rank 0's
        job."""
        init = self.cfg.initializes
        return self.cfg.rank == 0 if init is None else init

    @property
    def freeze_step(self) -> int:
        """The clock of the push policy's compression switch (1-bit Adam), or 0: none."""
        return self.policy.freeze_step

    # -- control plane ------------------------------------------------------------------------
    def register(self, plan: KeyPlan, values: Mapping[int, np.ndarray] | None = None, *,
                 copies: Mapping[int, np.ndarray] | None = None) -> None:
        """Join every shard with ``plan``; ``values`` (:attr:`initializes`: rank 0, or in a
        pipeline replica 0 of each stage) are the initial parameters by key. Other ranks block
        until the values of their keys have landed.

        ``plan`` may be partial (``KeyPlan.subset``: a pipeline stage's keys): the shards then
        count this worker, per key, only for the keys it registered.

        ``copies`` (any rank, every key): the values this worker holds now. Their digests go
        with the registration, and keys whose shard values match count as received
        (:attr:`versions`), so the first pull can skip them."""
        if plan.num_shards != self.num_shards:
            raise ValueError(f"plan is cut for {plan.num_shards} shards; the client has "
                             f"{self.num_shards} servers")
        if (values is not None) != self.initializes:
            raise ValueError(f"rank {self.cfg.rank} {'must' if self.initializes else 'must not'}"
                             f" pass initial values (ClientConfig.initializes "
                             f"{self.cfg.initializes})")
        if copies is not None and set(copies) != {k.key for k in plan.keys}:
            raise ValueError(f"copies name {len(copies)} keys; the plan has {len(plan.keys)}")
        self.plan = plan
        endpoints, current = [], {}
        for shard, stub in enumerate(self._stubs):
            reply = self._register_with(stub, shard, plan, values, copies)
            current.update(zip(reply.current_keys, reply.current_versions))
            if reply.shard_id != shard:
                raise PSError(pb.BAD_HEADER, f"server {self.cfg.servers[shard]} is shard "
                              f"{reply.shard_id}; expected shard {shard} (list servers in order)")
            host = self.cfg.servers[shard].rsplit(":", 1)[0]
            endpoints.append(f"tcp://{host}:{reply.data_port}")
            self.start_clock = max(self.start_clock, reply.start_clock)
            self.holds_pulls = self.holds_pulls or reply.holds_pulls
            fresh = for_registration(reply)
            if fresh is not None and not (type(fresh) is type(self.policy)
                                          and self.policy.survives_rejoin):
                self.policy = fresh
        self.clock = self.start_clock
        # Versions of the copies this worker holds, filled by replies: a request names versions
        # only for keys it has received (a shard sends codes only against a copy it sent).
        self.versions.clear()
        self.versions.update(current)
        self._endpoints = endpoints
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="bitps-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _register_with(self, stub, shard: int, plan: KeyPlan, values, copies):
        """Register with one shard, calling again with backoff while it answers
        ``NOT_INITIALIZED`` (the initial values of this worker's keys have not landed: a shard
        never holds a call for them long), until ``register_timeout_s``."""
        timeout = self.cfg.register_timeout_s
        end, pause = time.monotonic() + timeout, _REGISTER_RETRY_S[0]
        while True:
            try:
                return self._register_call(
                    shard, iter(self._register_stream(plan, shard, values, copies)),
                    timeout=max(end - time.monotonic(), 0.1))
            except PSError as err:
                if err.code != pb.NOT_INITIALIZED:
                    raise
                if time.monotonic() + pause > end:
                    raise PSTimeoutError(f"rank {self.cfg.rank}: shard {shard} still waits for "
                                         f"the initial values of this worker's keys after "
                                         f"{timeout:.0f} s", shard=shard) from None
            time.sleep(pause)
            pause = min(2 * pause, _REGISTER_RETRY_S[1])

    def _register_stream(self, plan: KeyPlan, shard: int, values, copies=None):
        keys = plan.for_shard(shard)
        pull = self.pull_codec
        large = self._large_keys()
        req = pb.RegisterRequest(
            protocol=PROTOCOL, rank=self.cfg.rank, world_size=self.cfg.world_size,
            signature=plan.signature, num_shards=plan.num_shards, shard_id=shard,
            model_keys=plan.model_keys,
            sends_values=values is not None, token=self.cfg.token,
            keys=[pb.KeySpec(key=k.key, name=k.name, offset=k.offset, length=k.length,
                             dtype=pb.FLOAT32, compressed_pull=not pull.is_raw and large[k.key],
                             shape=pb.TensorShape(dims=k.shape))
                  for k in keys])
        if not pull.is_raw:
            req.pull_codec, req.pull_codec_chunk, req.pull_codec_flags = pull.wire_fields()
        if copies is not None:
            req.value_digests.extend(
                value_digest(np.ascontiguousarray(copies[k.key], dtype=_F32)) for k in keys)
        yield pb.RegisterMessage(request=req)
        if values is not None:
            for k in keys:
                data = np.ascontiguousarray(values[k.key], dtype=_F32).tobytes()
                yield pb.RegisterMessage(values=pb.KeyValues(key=k.key, data=data))

    def _register_call(self, shard: int, stream, timeout: float) -> pb.RegisterReply:
        """One Register call, and the check that the shard's data plane and this worker agree
        on CURVE (the shard refuses a worker without a key or with one it does not allow)."""
        try:
            reply, call = self._stubs[shard].Register.with_call(stream, timeout=timeout,
                                                                metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._rpc_error(err, shard) from None
        said = dict(call.trailing_metadata() or ()).get(_CURVE_SERVER_KEY_METADATA_KEY, "")
        if self.curve is not None and not said:
            raise PSError(pb.UNAUTHENTICATED, f"shard {shard} ({self.cfg.servers[shard]}) "
                          f"serves plain ZeroMQ; this worker has curve_server_key "
                          f"{self.cfg.curve_server_key} (expected both sides with CURVE keys, "
                          f"or neither)", shard=shard)
        if self.curve is not None and said.encode() != self.curve.server:
            raise PSError(pb.UNAUTHENTICATED, f"shard {shard} ({self.cfg.servers[shard]})'s "
                          f"CURVE public key is {said}; curve_server_key "
                          f"{self.cfg.curve_server_key} holds "
                          f"{self.curve.server.decode()}", shard=shard)
        return reply

    def _call(self, method, request, shard: int, timeout: float):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._rpc_error(err, shard) from None

    def _rpc_error(self, err: grpc.RpcError, shard: int) -> PSError:
        """The shard's typed error carried by a failed call (or what the failure says)."""
        code = dict(err.trailing_metadata() or ()).get(_ERROR_METADATA_KEY)
        detail = err.details() or str(err.code())
        if code is not None:
            return PSError(int(code), detail.split(": ", 1)[-1], shard=shard)
        return PSError(pb.DEADLINE if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                       else pb.NOT_REGISTERED,
                       f"{self.cfg.servers[shard]}: {err.code().name}: {detail}", shard=shard)

    def status(self, shard: int, *, timeout_s: float = 10.0) -> pb.StatusReply:
        """The shard's view of clocks, live workers and held pulls, within ``timeout_s``."""
        return self._call(self._stubs[shard].Status, pb.StatusRequest(token=self.cfg.token),
                          shard, timeout=timeout_s)

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(self.cfg.heartbeat_s):
            for shard, stub in enumerate(self._stubs):
                try:
                    reply = stub.Heartbeat(pb.HeartbeatRequest(
                        rank=self.cfg.rank, clock=self.clock, token=self.cfg.token),
                        timeout=max(self.cfg.heartbeat_s, 1.0), metadata=self._metadata)
                    self._heartbeat_min_clock = reply.min_clock
                except grpc.RpcError as err:
                    log.warning("heartbeat to shard %d failed: %s", shard, err.code().name)

    # -- data plane ---------------------------------------------------------------------------
    def push(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
             encoded: Mapping[int, np.ndarray] | None = None,
             scale: float | None = None) -> Handle:
        """Send gradients of ``keys`` for step ``clock``. ``encoded`` maps keys to payloads
        already compressed with :meth:`push_codec_at` (``clock``) by the caller, who then keeps
        their error feedback (``PSModel``'s GPU path); those keys' ``grads`` are not read.

        ``scale``: a clip factor the gradients are multiplied by before error feedback. Every
        key then keeps error feedback, raw ones too, so that :meth:`clip_correct` can fold the
        difference to the step's exact factor into the next push (``worker.training.clip``). The
        caller has checked the gradients with :meth:`sum_squares`; they are not checked again."""
        return self._submit(pb.PUSH, keys, grads, (), clock, encoded, scale)

    def pull(self, keys: Sequence[int], outs: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Fetch parameters of ``keys`` for step ``clock`` into ``outs``."""
        return self._submit(pb.PULL, keys, (), outs, clock)

    def push_pull(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                  outs: Sequence[np.ndarray], *, clock: int,
                  encoded: Mapping[int, np.ndarray] | None = None,
                  scale: float | None = None) -> Handle:
        """Push gradients for step ``clock`` and pull parameters for ``clock + 1`` (``encoded``
        and ``scale`` as for :meth:`push`)."""
        return self._submit(pb.PUSH_PULL, keys, grads, outs, clock, encoded, scale)

    def sum_squares(self, keys: Sequence[int], grads: Sequence[np.ndarray]) -> float:
        """The sum of the squares of ``grads`` (float64; a clip norm's share) in one read,
        which is also the finiteness check: a NaN or Inf is refused here (``NON_FINITE``,
        counted; nothing sent, no state touched)."""
        total = 0.0
        for key, grad in zip(keys, grads):
            part = native.sum_squares(grad)
            if not np.isfinite(part):
                raise self.refuse_nonfinite(key)
            total += part
        return total

    def clip_correct(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
                     used: float, exact: float) -> None:
        """``grads`` of ``keys`` were pushed for ``clock`` with clip factor ``used`` and the
        step's exact factor is ``exact`` (``worker.training.clip``): add what those pushes missed,
        ``(exact - used) * grads`` in the units they carried, to the keys' error feedback (and,
        with worker moments, move Adam's moments to what ``exact`` gives), so the next push
        delivers it. Call before the keys are pushed again; ``grads`` unchanged since."""
        if used == exact:
            return
        for key, grad in zip(keys, grads):
            residual = self._push_compressor(key, clock, grad.shape[0]).residual
            self.policy.correct(key, grad, residual, clock=clock, used=used, exact=exact)

    def progress(self, timeout_s: float, *, wake_fd: int | None = None) -> None:
        """Receive replies to this thread's requests for up to ``timeout_s`` seconds, returning
        early when ``wake_fd`` is readable (``worker.training.comm.CommThread`` waits for replies
        and new buckets at once this way)."""
        self._channel().progress(timeout_s, wake_fd=wake_fd)

    def compresses(self, key: int, clock: int) -> bool:
        """Whether a push of ``key`` for ``clock`` goes compressed: a push codec is in force and
        the key's tensor (all its keys together) has at least ``compress_min_bytes``."""
        return not self.push_codec_at(clock).is_raw and self._large_keys()[key]

    def _large_keys(self) -> dict[int, bool]:
        """By key id, per key of the plan: its tensor has at least ``compress_min_bytes``. The
        problem statement's rule is about one communication's size, so every key of such a
        tensor is compressed, however the plan cut it."""
        if self._large_for is not self.plan:
            tensor_bytes: dict[str, int] = {}
            for k in self.plan.keys:
                tensor_bytes[k.name] = tensor_bytes.get(k.name, 0) + k.nbytes
            self._large = {k.key: tensor_bytes[k.name] >= self.cfg.compress_min_bytes
                           for k in self.plan.keys}
            self._large_for = self.plan
        return self._large

    def _submit(self, op, keys, grads, outs, clock, encoded=None, scale=None) -> Handle:
        if self.plan is None:
            raise RuntimeError("register() before push/pull")
        if self._closing.is_set():
            raise RuntimeError("the client is closed")
        if grads and len(grads) != len(keys) or outs and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(grads)} grads and {len(outs)} outs")
        codec = self.push_codec_at(clock)
        if encoded:
            self._check_encoded(encoded, codec, clock)
        if grads and scale is None and (not codec.is_raw or self.policy.keeps_state):
            self._check_finite(keys, grads, skip=encoded or {})
        grads, clip, own = self.policy.prepare(self, keys, grads, clock,
                                               1.0 if scale is None else scale)
        groups = self._group(keys, grads, outs, compress=bool(grads) and not codec.is_raw)
        channel = self._channel()
        handle = Handle(channel, len(groups), (self.cfg.rank, op, clock, keys),
                        self.cfg.deadline_s, keep=(grads,), on_slow=self.on_slow_wait)
        deadline = time.monotonic() + self.cfg.deadline_s
        requests = []
        for shard, compressed, idx in groups:
            ks = [keys[i] for i in idx]
            header = pb.DataHeader(op=op, protocol=PROTOCOL, worker=self.cfg.rank,
                                   request_id=next(self._ids), clock=clock + self.shift[shard],
                                   keys=ks,
                                   dtype=pb.FLOAT32, deadline_s=self.cfg.deadline_s,
                                   token=self.cfg.token, incarnation=self.incarnation)
            # The versions of this worker's copies: what a gradient was computed from, and
            # where the codes a shard publishes start (none before the first reply).
            if all(k in self.versions for k in ks):
                header.versions.extend(self.versions[k] for k in ks)
            payload, nbytes = [], 0
            if grads:
                nbytes = sum(grads[i].nbytes for i in idx)
                if compressed or scale is not None:
                    # clipped raw keys go through a raw compressor: it keeps their residual
                    payload = self._compress(codec if compressed else RAW, header, ks,
                                             [grads[i] for i in idx], clock, encoded, clip)
                else:
                    payload = [grads[i] for i in idx]
            requests.append(Request(shard, header.request_id, ks, header, payload,
                                    [outs[i] for i in idx] if outs else (), handle, deadline,
                                    op, nbytes, copy=compressed or own or scale is not None,
                                    clock=clock))
            handle.track(shard)
        handle.requests = requests
        channel.send(requests)
        return handle

    def _check_finite(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                      skip: Mapping[int, object]) -> None:
        """Refuse the push here when a gradient holds NaN or Inf: error feedback and 1-bit Adam
        moments would fold it into state that every later push carries (the shard refuses raw
        pushes itself, with the same code). Keys in ``skip`` arrive encoded (device codec):
        their host gradient is not read."""
        for key, grad in zip(keys, grads):
            if key in skip:
                continue
            if grad.dtype == _F32 and grad.flags.c_contiguous and not native.all_finite(grad):
                raise self.refuse_nonfinite(key)

    def refuse_nonfinite(self, key: int) -> PSError:
        """Count a push refused on this worker because ``key``'s gradient holds NaN or Inf, and
        return the error to raise (callers that keep their own error feedback, such as
        ``PSModel``'s device codec, use it too)."""
        with self.metrics.lock:
            self.metrics.nonfinite.inc()
        return PSError(pb.NON_FINITE, f"key {key}: gradient holds NaN or Inf; nothing sent, "
                       f"error feedback and moments unchanged")

    def load_optimizer_state(self, keys: Sequence[int], load) -> None:
        """Fetch the optimizer state of ``keys`` from their shards (the RuleState call,
        one stream per shard) and hand each key's message to ``load(state, length)``; a state
        of another version than this worker's copy is refused (``BAD_CLOCK``)."""
        for shard in sorted({self.plan.key(k).shard for k in keys}):
            # the update rule's state (the RuleState call): whatever its rule lays out
            stream = self._stubs[shard].RuleState(pb.RuleStateRequest(
                rank=self.cfg.rank, token=self.cfg.token), timeout=self.cfg.deadline_s,
                metadata=self._metadata)
            try:
                for state in stream:
                    if state.version != self.versions.get(state.key):
                        raise PSError(pb.BAD_CLOCK, f"shard {shard} key {state.key}: optimizer "
                                      f"state of version {state.version}, parameters of "
                                      f"version {self.versions.get(state.key)}", shard=shard)
                    load(state, self.plan.key(state.key).length)
            except grpc.RpcError as err:
                raise self._rpc_error(err, shard) from None

    def push_codec_at(self, clock: int) -> Codec:
        """The codec pushes for ``clock`` use: the configured push codec, or the push
        policy's (1-bit Adam: bf16 during warmup, then sign1)."""
        return self.policy.codec_at(clock, self._push_codec)

    def _check_encoded(self, encoded: Mapping[int, np.ndarray], codec: Codec,
                       clock: int) -> None:
        for key, data in encoded.items():
            if not self.compresses(key, clock):
                raise ValueError(f"key {key} is pushed raw at clock {clock}; only keys the "
                                 f"push codec compresses may come encoded")
            problem = codec.check(data, self.plan.key(key).length)
            if problem:
                raise ValueError(f"encoded key {key}: {problem}")

    def _compress(self, codec: Codec, header: pb.DataHeader, keys: list[int],
                  grads: list[np.ndarray], clock: int, encoded=None,
                  scale: float = 1.0) -> list[memoryview]:
        """Encode one message's gradients (times ``scale``) with ``codec`` (error feedback per
        key), or take the caller's ``encoded`` payloads."""
        if codec.is_raw:  # raw with error feedback (clipping): a plain raw message
            return [self._push_compressor(key, clock, grad.shape[0]).encode(grad, scale=scale)
                    for key, grad in zip(keys, grads)]
        header.codec, header.codec_chunk, header.codec_flags = codec.wire_fields()
        seed = (self.cfg.codec_seed * 1_000_003 + clock) * 65_537 + self.cfg.rank
        payload = []
        for key, grad in zip(keys, grads):
            if encoded and key in encoded:
                payload.append(memoryview(encoded[key]).cast("B"))
                continue
            comp = self._push_compressor(key, clock, grad.shape[0])
            payload.append(comp.encode(grad, seed=(seed * 131 + key) & _U64, scale=scale))
        wire = sum(p.nbytes for p in payload)
        with self.metrics.lock:
            self.metrics.codec_raw_bytes.labels(codec.name).inc(sum(g.nbytes for g in grads))
            self.metrics.codec_wire_bytes.labels(codec.name).inc(wire)
        return payload

    def _push_compressor(self, key: int, clock: int, n: int) -> Compressor:
        """The error feedback ``key``'s pushes for ``clock`` go through: the push codec's when
        it compresses the key, else a raw one (only clipping adds to its residual)."""
        codec = self.push_codec_at(clock) if self.compresses(key, clock) else RAW
        comp = self._compressors.get((key, codec.id))
        if comp is None or comp.codec != codec:
            comp = self._compressors[key, codec.id] = Compressor(codec, n)
        return comp

    def _codec_snapshot(self) -> CodecSnapshot:
        norms: dict[int, float] = {}
        if self.plan is not None:
            for (key, _), comp in list(self._compressors.items()):
                shard = self.plan.key(key).shard
                norms[shard] = float(np.hypot(norms.get(shard, 0.0), comp.residual_norm()))
        phase = self.policy.phase(self.clock)
        return CodecSnapshot(residual_norms=norms, onebit_phase=phase)

    def residuals(self, *, clock: int | None = None) -> dict[int, np.ndarray]:
        """Every key's error-feedback residual for the codec its pushes use at ``clock``
        (default: :attr:`clock`; raw keys' only when clipping gave them one): the state to
        save. Arrays owned by the client, updated by each push."""
        clock = self.clock if clock is None else clock
        codec = self.push_codec_at(clock)
        return {k: c.residual for (k, _), c in self._compressors.items()
                if c.codec == (codec if self.compresses(k, clock) else RAW)}

    def load_residuals(self, residuals: Mapping[int, np.ndarray], *,
                       clock: int | None = None) -> None:
        """Restore residuals saved by :meth:`residuals` (same plan, same codec at ``clock``)."""
        if self.plan is None:
            raise RuntimeError("register() before load_residuals()")
        clock = self.clock if clock is None else clock
        if self.push_codec_at(clock).is_raw:
            raise ValueError("raw pushes keep no residuals; set a push codec")
        for key, r in residuals.items():
            n = self.plan.key(key).length
            if r.shape != (n,) or r.dtype != _F32:
                raise ValueError(f"residual of key {key} is {r.dtype}{r.shape}; expected "
                                 f"float32[{n}]")
        for key, r in residuals.items():
            np.copyto(self._push_compressor(key, clock, r.shape[0]).residual, r)

    def policy_state(self) -> dict:
        """The state the push policy keeps on this worker (async/ssp 1-bit Adam with worker
        moments: every key's ``(step, m, v)`` pushed so far), to save beside
        :meth:`residuals`; empty for policies that keep none."""
        return self.policy.state()

    def load_policy_state(self, state) -> None:
        """Restore state saved by :meth:`policy_state` (same plan; after register()); a policy
        that keeps none, or state that does not fit the plan, is refused with nothing loaded."""
        if self.plan is None:
            raise RuntimeError("register() before load_policy_state()")
        self.policy.load_state(self.plan, state)

    def _channel(self) -> Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = Channel(self._ctx, self._endpoints, servers=self.cfg.servers,
                              metrics=self.metrics, versions=self.versions,
                              codes=self.policy.codes, curve=self.curve)
            self._local.channel = channel
            with self._channels_lock:
                self._channels.append(channel)
        return channel

    @property
    def min_clock(self) -> int:
        """Smallest live clock the shards last reported to this thread."""
        channel = getattr(self._local, "channel", None)
        return channel.min_clock if channel is not None else self._heartbeat_min_clock

    def _group(self, keys, grads, outs, *, compress: bool) -> list[tuple[int, bool, list[int]]]:
        """Split the request per shard and codec (compressed or raw), then into messages of at
        most ``message_bytes`` (counted in float32 bytes)."""
        plan, limit, large = self.plan, self.cfg.message_bytes, self._large_keys()
        by_shard: dict[tuple[int, bool], list[int]] = {}
        for i, k in enumerate(keys):
            if k not in plan:
                raise PSError(pb.UNKNOWN_KEY, f"key {k} is not in the plan ({len(plan.keys)} "
                              f"of the model's {plan.model_keys} keys)")
            spec = plan.key(k)
            for arrays, kind in ((grads, "gradient"), (outs, "output")):
                if arrays and (arrays[i].dtype != _F32 or arrays[i].size != spec.length):
                    raise ValueError(f"key {k}: {kind} is {arrays[i].dtype}[{arrays[i].size}]; "
                                     f"expected float32[{spec.length}]")
            if outs and not (outs[i].flags.c_contiguous and outs[i].flags.writeable):
                raise ValueError(f"key {k}: output must be a writable contiguous array")
            # One codec per message: keys the push codec compresses travel apart from raw ones.
            compressed = compress and large[k]
            by_shard.setdefault((spec.shard, compressed), []).append(i)
        groups = []
        for (shard, compressed), idx in by_shard.items():
            batch, size = [], 0
            for i in idx:
                n = plan.key(keys[i]).nbytes
                if batch and size + n > limit:
                    groups.append((shard, compressed, batch))
                    batch, size = [], 0
                batch.append(i)
                size += n
            groups.append((shard, compressed, batch))
        return groups

    # -- recovery -----------------------------------------------------------------------------
    @property
    def exchange_bound_s(self) -> float:
        """Longest :meth:`complete` may take: the first attempt's deadline, then up to
        ``reconnect_timeout_s`` of recovery, whose last redo may wait one more deadline."""
        return 2 * self.cfg.deadline_s + self.cfg.reconnect_timeout_s

    def complete(self, handle: Handle, copies: Mapping[int, np.ndarray]) -> Handle:
        """Wait for ``handle``; when shards were lost (:data:`RECOVERABLE` failures, or no
        answer), :meth:`recover` each and redo their part of the exchange, until it succeeds
        or ``reconnect_timeout_s`` has passed (then :class:`ShardLostError`). Returns the
        handle that completed (``handle``, or the redo's).

        ``copies`` (every key of the plan) are the values this worker holds: their digests
        tell a shard that is back which copies are still current, and a worker that
        :attr:`initializes` sends them as initial values to a shard that came back empty (a
        shard restored from a checkpoint is initialized and keeps its own). A redo sends the
        same bytes: the same request ids to a shard that kept this worker's clock (its
        exactly-once window answers a push it had applied with the original answer), new ids
        and the shard's clock to one that came back behind (:meth:`recover`)."""
        try:
            handle.wait()
            return handle
        except PSError as err:
            last: PSError = err
        since = time.monotonic()
        end = since + self.cfg.reconnect_timeout_s
        while True:
            failed = handle.failed_shards()
            if not failed or any(e is not None and e.code not in RECOVERABLE
                                 for e in failed.values()):
                raise last
            log.warning("rank %d: %s; recovering shards %s", self.cfg.rank, last,
                        sorted(failed))
            for shard in sorted(failed):
                self.recover(shard, copies, clock=handle.clock, since=since, end=end)
            handle = self._redo(handle, failed)
            try:
                handle.wait()
                return handle
            except PSError as err:
                last = err
            if time.monotonic() >= end:
                shard = last.shard if last.shard is not None else min(failed)
                raise ShardLostError(shard, self.cfg.servers[shard], time.monotonic() - since,
                                     last, rank=self.cfg.rank) from last

    def recover(self, shard: int, copies: Mapping[int, np.ndarray], *, clock: int,
                since: float | None = None, end: float | None = None) -> int:
        """Get ``shard`` back after it was lost while this worker was at step ``clock``:
        drop what its old connection still queues, re-register (the plan, digests of
        ``copies``, and ``copies`` as values when this worker :attr:`initializes`) with
        backoff until ``end`` (default: ``reconnect_timeout_s`` from now), then adopt what the
        shard says. Returns the steps of this shard's updates that were lost (it came back
        from an older checkpoint).

        Adopting: the shard's keys whose values differ from ``copies`` lose their versions (the
        next exchange pulls them whole). A shard that has this worker at a clock below
        ``clock`` (plus the shard's shift) lost that many steps; from now on this worker's
        requests to it carry the shard's clock (:attr:`shift`), and the loss is counted
        (``bitps_worker_lost_steps_total``) and logged. Raises :class:`ShardLostError` past
        ``end``, and other failures (another plan, a wrong token) as they are."""
        if self.plan is None:
            raise RuntimeError("register() before recover()")
        since = time.monotonic() if since is None else since
        end = since + self.cfg.reconnect_timeout_s if end is None else end
        # Requests still queued on the old connection would reach a restarted shard after this
        # worker re-registered, as pushes of the wrong step: drop them with the socket.
        self._reset_data(shard)
        keys = self.plan.for_shard(shard)
        values = {k.key: copies[k.key] for k in keys} if self.initializes else None
        pause, last = self.cfg.reconnect_backoff_s, None
        while True:
            try:
                stream = iter(self._register_stream(self.plan, shard, values, copies))
                left = min(end - time.monotonic(), self.cfg.deadline_s)
                reply = self._register_call(shard, stream, timeout=max(left, 0.1))
                return self._rejoin(shard, reply, clock)
            except PSError as err:
                if err.code not in RECOVERABLE:
                    raise
                last = err
            if time.monotonic() + pause > end:
                raise ShardLostError(shard, self.cfg.servers[shard], time.monotonic() - since,
                                     last, rank=self.cfg.rank)
            time.sleep(pause)
            pause = min(2 * pause, self.cfg.reconnect_backoff_max_s)

    def _rejoin(self, shard: int, reply: pb.RegisterReply, clock: int) -> int:
        """Take a re-registration's answer (:meth:`recover`); returns the steps lost."""
        if reply.shard_id != shard:
            raise PSError(pb.BAD_HEADER, f"server {self.cfg.servers[shard]} is now shard "
                          f"{reply.shard_id}; expected shard {shard}", shard=shard)
        host = self.cfg.servers[shard].rsplit(":", 1)[0]
        endpoint = f"tcp://{host}:{reply.data_port}"
        if endpoint != self._endpoints[shard]:  # restarted on another data port
            self._endpoints[shard] = endpoint
            self._reset_data(shard)
        for k in self.plan.for_shard(shard):
            self.versions.pop(k.key, None)
        self.versions.update(zip(reply.current_keys, reply.current_versions))
        expected = clock + self.shift[shard]
        lost = max(expected - reply.start_clock, 0)
        if lost:
            self.shift[shard] = reply.start_clock - clock
            log.warning("rank %d: shard %d (%s) came back at clock %d, %d steps behind this "
                        "worker's %d: those updates of its keys are lost; its keys are pulled "
                        "again and its clock adopted", self.cfg.rank, shard,
                        self.cfg.servers[shard], reply.start_clock, lost, expected)
        else:
            log.info("rank %d: shard %d (%s) is back at clock %d", self.cfg.rank, shard,
                     self.cfg.servers[shard], reply.start_clock)
        with self.metrics.lock:
            self.metrics.recoveries.inc()
            self.metrics.lost_steps.inc(lost)
        return lost

    def _reset_data(self, shard: int) -> None:
        """A fresh data connection to ``shard`` in every channel (``Channel.reset``)."""
        with self._channels_lock:
            channels = list(self._channels)
        for channel in channels:
            channel.reset(shard, self._endpoints[shard], self._ctx)

    def _redo(self, handle: Handle, failed: Mapping[int, PSError | None]) -> Handle:
        """Send ``handle``'s parts for the ``failed`` shards again, from this thread."""
        channel = self._channel()
        old = [r for r in handle.requests if r.shard in failed]
        redo = Handle(channel, len(old), handle._what, self.cfg.deadline_s,
                      on_slow=self.on_slow_wait)
        deadline = time.monotonic() + self.cfg.deadline_s
        for r in old:
            header = pb.DataHeader()
            header.CopyFrom(r.header)
            clock = r.clock + self.shift[r.shard]
            if header.clock != clock:
                # The shard came back behind: this is a push of another step there, and the
                # shard's exactly-once window does not know it.
                header.clock, header.request_id = clock, next(self._ids)
            del header.versions[:]
            if all(k in self.versions for k in r.keys):
                header.versions.extend(self.versions[k] for k in r.keys)
            redo.requests.append(dataclasses.replace(r, request_id=header.request_id,
                                                     header=header, handle=redo,
                                                     deadline=deadline))
            redo.track(r.shard)
        channel.send(redo.requests)
        return redo

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, leave: bool = True) -> None:
        """Leave every shard (so peers stop waiting for this rank) and stop the threads."""
        if self._closing.is_set():
            return
        if leave and self.plan is not None:
            for shard, stub in enumerate(self._stubs):
                try:
                    stub.Leave(pb.LeaveRequest(rank=self.cfg.rank, token=self.cfg.token),
                               timeout=5, metadata=self._metadata)
                except grpc.RpcError as err:
                    log.warning("leave shard %d failed: %s", shard, err.code().name)
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        with self._channels_lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
        self._ctx.term()
        for c in self._grpc:
            c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _curve_keys(cfg: ClientConfig) -> CurveClient | None:
    if not cfg.curve_server_key:
        return None
    public, secret = load_key_pair(cfg.curve_client_key)
    return CurveClient(server=load_public_key(cfg.curve_server_key), public=public,
                       secret=secret)


def _tls_credentials(cfg: ClientConfig) -> grpc.ChannelCredentials | None:
    if not cfg.tls_ca_file:
        return None
    ca = read_pem(cfg.tls_ca_file, "CA certificates")
    key = read_pem(cfg.tls_key_file, "a private key") if cfg.tls_key_file else None
    chain = read_pem(cfg.tls_cert_file, "a certificate chain") if cfg.tls_cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=chain)
