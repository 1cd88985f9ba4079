"""``PSClient``: a worker's connection to every shard.

``push``, ``pull`` and ``push_pull`` send at once from the calling thread and return a
:class:`~worker.channel.Handle`; ``Handle.wait()`` blocks until every shard involved has answered,
with a deadline. Each submitting thread gets its own :class:`~worker.channel.Channel` (DEALER
sockets; ZeroMQ sockets are not thread-safe), so no thread hand-off sits on the latency path.
Payloads go out zero-copy: arrays passed to ``push``/``push_pull`` must stay unchanged until the
handle completes (the handle keeps them alive); pulled values are copied straight from the
received frame into the caller's ``outs``.

    client = PSClient(ClientConfig(servers=("127.0.0.1:50051",), rank=0, world_size=1))
    client.register(plan, values)                       # rank 0 sends initial values
    client.push_pull(keys, grads, outs, clock=0).wait()
    client.close()
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import grpc
import numpy as np
import zmq

from proto import bitps_pb2 as pb
from proto import bitps_pb2_grpc as pb_grpc
from proto.keyplan import KeyPlan
from proto.wire import PROTOCOL, PSError
from worker.channel import Channel, Handle, PSTimeoutError, Request
from worker.config import ClientConfig
from worker.metrics import WorkerMetrics

__all__ = ["Handle", "PSClient", "PSTimeoutError"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
_ERROR_METADATA_KEY = "bitps-error-code"


class PSClient:
    """One worker rank's client for all shards of a cluster."""

    def __init__(self, cfg: ClientConfig, *, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        self.num_shards = len(cfg.servers)
        opts = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]
        self._grpc = [grpc.insecure_channel(s, options=opts) for s in cfg.servers]
        self._stubs = [pb_grpc.ControlStub(c) for c in self._grpc]
        self.plan: KeyPlan | None = None
        self.versions: dict[int, int] = {}
        self.start_clock = 0
        self.clock = 0
        self._heartbeat_min_clock = 0
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._endpoints: list[str] = []
        self._local = threading.local()
        self._channels: list[Channel] = []  # one per submitting thread
        self._channels_lock = threading.Lock()
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- control plane ------------------------------------------------------------------------
    def register(self, plan: KeyPlan, values: Mapping[int, np.ndarray] | None = None) -> None:
        """Join every shard with ``plan``; ``values`` (rank 0) are the initial parameters by key.
        Other ranks block until rank 0's values have landed."""
        if plan.num_shards != self.num_shards:
            raise ValueError(f"plan is cut for {plan.num_shards} shards; the client has "
                             f"{self.num_shards} servers")
        if (values is not None) != (self.cfg.rank == 0):
            raise ValueError("rank 0, and only rank 0, must pass initial values")
        self.plan = plan
        endpoints = []
        for shard, stub in enumerate(self._stubs):
            reply = self._call(stub.Register, iter(self._register_stream(plan, shard, values)),
                               shard, timeout=self.cfg.register_timeout_s)
            if reply.shard_id != shard:
                raise PSError(pb.BAD_HEADER, f"server {self.cfg.servers[shard]} is shard "
                              f"{reply.shard_id}; expected shard {shard} (list servers in order)")
            host = self.cfg.servers[shard].rsplit(":", 1)[0]
            endpoints.append(f"tcp://{host}:{reply.data_port}")
            self.start_clock = max(self.start_clock, reply.start_clock)
        self.clock = self.start_clock
        self.versions = {k.key: 0 for k in plan.keys}
        self._endpoints = endpoints
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="bitps-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _register_stream(self, plan: KeyPlan, shard: int, values):
        keys = plan.for_shard(shard)
        req = pb.RegisterRequest(
            protocol=PROTOCOL, rank=self.cfg.rank, world_size=self.cfg.world_size,
            signature=plan.signature, num_shards=plan.num_shards, shard_id=shard,
            sends_values=values is not None, token=self.cfg.token,
            keys=[pb.KeySpec(key=k.key, name=k.name, offset=k.offset, length=k.length,
                             dtype=pb.FLOAT32) for k in keys])
        yield pb.RegisterMessage(request=req)
        if values is not None:
            for k in keys:
                data = np.ascontiguousarray(values[k.key], dtype=_F32).tobytes()
                yield pb.RegisterMessage(values=pb.KeyValues(key=k.key, data=data))

    def _call(self, method, request, shard: int, timeout: float):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as err:
            code = dict(err.trailing_metadata() or ()).get(_ERROR_METADATA_KEY)
            detail = err.details() or str(err.code())
            if code is not None:
                raise PSError(int(code), detail.split(": ", 1)[-1], shard=shard) from None
            raise PSError(pb.DEADLINE if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                          else pb.NOT_REGISTERED,
                          f"{self.cfg.servers[shard]}: {err.code().name}: {detail}",
                          shard=shard) from None

    def status(self, shard: int) -> pb.StatusReply:
        """The shard's view of clocks, live workers and held pulls."""
        return self._call(self._stubs[shard].Status, pb.StatusRequest(token=self.cfg.token),
                          shard, timeout=10)

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(self.cfg.heartbeat_s):
            for shard, stub in enumerate(self._stubs):
                try:
                    reply = stub.Heartbeat(pb.HeartbeatRequest(
                        rank=self.cfg.rank, clock=self.clock, token=self.cfg.token),
                        timeout=max(self.cfg.heartbeat_s, 1.0))
                    self._heartbeat_min_clock = reply.min_clock
                except grpc.RpcError as err:
                    log.warning("heartbeat to shard %d failed: %s", shard, err.code().name)

    # -- data plane ---------------------------------------------------------------------------
    def push(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Send gradients of ``keys`` for step ``clock``."""
        return self._submit(pb.PUSH, keys, grads, (), clock)

    def pull(self, keys: Sequence[int], outs: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Fetch parameters of ``keys`` for step ``clock`` into ``outs``."""
        return self._submit(pb.PULL, keys, (), outs, clock)

    def push_pull(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                  outs: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Push gradients for step ``clock`` and pull parameters for ``clock + 1``."""
        return self._submit(pb.PUSH_PULL, keys, grads, outs, clock)

    def _submit(self, op, keys, grads, outs, clock) -> Handle:
        if self.plan is None:
            raise RuntimeError("register() before push/pull")
        if self._closing.is_set():
            raise RuntimeError("the client is closed")
        if grads and len(grads) != len(keys) or outs and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(grads)} grads and {len(outs)} outs")
        groups = self._group(keys, grads, outs)
        channel = self._channel()
        handle = Handle(channel, len(groups), (self.cfg.rank, op, clock, keys),
                        self.cfg.deadline_s, keep=(grads,))
        deadline = time.monotonic() + self.cfg.deadline_s
        requests = []
        for shard, idx in groups:
            ks = [keys[i] for i in idx]
            header = pb.DataHeader(op=op, protocol=PROTOCOL, worker=self.cfg.rank,
                                   request_id=next(self._ids), clock=clock, keys=ks,
                                   dtype=pb.FLOAT32, deadline_s=self.cfg.deadline_s,
                                   token=self.cfg.token)
            nbytes = 0
            if grads:
                header.versions.extend(self.versions[k] for k in ks)
                nbytes = sum(grads[i].nbytes for i in idx)
            frames = [header.SerializeToString(), *(grads[i] for i in idx)] if grads else \
                [header.SerializeToString()]
            requests.append(Request(shard, header.request_id, ks, frames,
                                    [outs[i] for i in idx] if outs else (), handle, deadline,
                                    op, nbytes))
        channel.send(requests)
        return handle

    def _channel(self) -> Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = Channel(self._ctx, self._endpoints, servers=self.cfg.servers,
                              metrics=self.metrics, versions=self.versions)
            self._local.channel = channel
            with self._channels_lock:
                self._channels.append(channel)
        return channel

    @property
    def min_clock(self) -> int:
        """Smallest live clock the shards last reported to this thread."""
        channel = getattr(self._local, "channel", None)
        return channel.min_clock if channel is not None else self._heartbeat_min_clock

    def _group(self, keys, grads, outs) -> list[tuple[int, list[int]]]:
        """Split the request per shard, then into messages of at most ``message_bytes``."""
        plan_keys, limit = self.plan.keys, self.cfg.message_bytes
        by_shard: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            if not 0 <= k < len(plan_keys):
                raise PSError(pb.UNKNOWN_KEY, f"key {k} is not in the plan "
                              f"(0 .. {len(plan_keys) - 1})")
            spec = plan_keys[k]
            for arrays, kind in ((grads, "gradient"), (outs, "output")):
                if arrays and (arrays[i].dtype != _F32 or arrays[i].size != spec.length):
                    raise ValueError(f"key {k}: {kind} is {arrays[i].dtype}[{arrays[i].size}]; "
                                     f"expected float32[{spec.length}]")
            if outs and not (outs[i].flags.c_contiguous and outs[i].flags.writeable):
                raise ValueError(f"key {k}: output must be a writable contiguous array")
            by_shard.setdefault(spec.shard, []).append(i)
        groups = []
        for shard, idx in by_shard.items():
            batch, size = [], 0
            for i in idx:
                n = plan_keys[keys[i]].nbytes
                if batch and size + n > limit:
                    groups.append((shard, batch))
                    batch, size = [], 0
                batch.append(i)
                size += n
            groups.append((shard, batch))
        return groups

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, leave: bool = True) -> None:
        """Leave every shard (so peers stop waiting for this rank) and stop the threads."""
        if self._closing.is_set():
            return
        if leave and self.plan is not None:
            for shard, stub in enumerate(self._stubs):
                try:
                    stub.Leave(pb.LeaveRequest(rank=self.cfg.rank, token=self.cfg.token),
                               timeout=5)
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
