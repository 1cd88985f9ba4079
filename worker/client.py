"""``PSClient``: a worker's connection to every shard.

``push``, ``pull`` and ``push_pull`` return a :class:`Handle` at once; ``Handle.wait()`` blocks
until every shard involved has answered, with a deadline. One communication thread owns the
ZeroMQ DEALER sockets (one per shard; ZeroMQ sockets are not thread-safe): callers enqueue a
request and wake it through an inproc socket. Payloads go out zero-copy, so the arrays passed to
``push``/``push_pull`` must stay unchanged until the handle completes (the handle keeps them
alive); pulled values are copied straight from the received frame into the caller's ``outs``.

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
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import zmq

from proto import bitps_pb2 as pb
from proto import bitps_pb2_grpc as pb_grpc
from proto.keyplan import KeyPlan
from proto.wire import PROTOCOL, PSError, parse_header
from worker.config import ClientConfig
from worker.metrics import WorkerMetrics

__all__ = ["Handle", "PSClient", "PSTimeoutError"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
_ERROR_METADATA_KEY = "bitps-error-code"


class PSTimeoutError(PSError, TimeoutError):
    """A wait outlived its deadline; the message names worker, shard, keys and clock."""

    def __init__(self, message: str, *, shard: int | None = None) -> None:
        super().__init__(pb.DEADLINE, message, shard=shard)


class Handle:
    """Completion of one push / pull / push_pull across shards."""

    def __init__(self, parts: int, what: str, keep: tuple = ()) -> None:
        self._left = parts
        self._error: PSError | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._keep = keep  # buffers ZeroMQ may still be sending from
        self.what = what
        self.started = time.perf_counter()
        if parts == 0:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise the first shard's :class:`PSError`, or
        :class:`PSTimeoutError` after ``timeout`` seconds (default: the client's deadline)."""
        if not self._event.wait(timeout):
            raise PSTimeoutError(f"{self.what}: no answer after {timeout:.1f} s")
        self._keep = ()
        if self._error is not None:
            raise self._error

    def _part_done(self, error: PSError | None = None) -> bool:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._event.set()
        return finished


@dataclass
class _Request:
    shard: int
    request_id: int
    frames: list
    outs: Sequence[np.ndarray]
    handle: Handle
    deadline: float
    op: int
    nbytes: int


class PSClient:
    """One worker rank's client for all shards of a cluster."""

    def __init__(self, cfg: ClientConfig, *, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        self.num_shards = len(cfg.servers)
        opts = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)]
        self._channels = [grpc.insecure_channel(s, options=opts) for s in cfg.servers]
        self._stubs = [pb_grpc.ControlStub(c) for c in self._channels]
        self.plan: KeyPlan | None = None
        self.versions: dict[int, int] = {}
        self.start_clock = 0
        self.clock = 0
        self.min_clock = 0
        self._ids = itertools.count(1)
        self._outbox: deque[_Request] = deque()
        self._inflight: dict[int, _Request] = {}
        self._ctx = zmq.Context()
        self._wake_lock = threading.Lock()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._dealers: list[zmq.Socket] = []

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
        self._connect(endpoints)

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
                    self.min_clock = reply.min_clock
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
        plan = self.plan
        if plan is None:
            raise RuntimeError("register() before push/pull")
        if grads and len(grads) != len(keys) or outs and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(grads)} grads and {len(outs)} outs")
        groups = self._group(keys, grads, outs)
        what = (f"worker {self.cfg.rank} {pb.Op.Name(op)} clock {clock} keys "
                f"{list(keys[:8])}{'...' if len(keys) > 8 else ''}")
        handle = Handle(len(groups), what, keep=(grads,))
        deadline = time.monotonic() + self.cfg.deadline_s
        requests = []
        for shard, idx in groups:
            ks = [keys[i] for i in idx]
            header = pb.DataHeader(op=op, protocol=PROTOCOL, worker=self.cfg.rank,
                                   request_id=next(self._ids), clock=clock, keys=ks,
                                   dtype=pb.FLOAT32, deadline_s=self.cfg.deadline_s,
                                   token=self.cfg.token)
            frames = [header.SerializeToString()]
            nbytes = 0
            if grads:
                header.versions.extend(self.versions[k] for k in ks)
                frames[0] = header.SerializeToString()
                frames += [grads[i] for i in idx]
                nbytes = sum(grads[i].nbytes for i in idx)
            requests.append(_Request(shard, header.request_id, frames,
                                     [outs[i] for i in idx] if outs else (), handle, deadline,
                                     op, nbytes))
        self._outbox.extend(requests)
        self._wake()
        return handle

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

    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_tx.send(b"", copy=True)

    def _connect(self, endpoints: list[str]) -> None:
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://wake-{id(self)}")
        for ep in endpoints:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(ep)
            self._dealers.append(d)
        for target, name in ((self._comm_loop, "bitps-comm"),
                             (self._heartbeat_loop, "bitps-heartbeat")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _comm_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for d in self._dealers:
            poller.register(d, zmq.POLLIN)
        next_check = time.monotonic() + 0.1
        while not self._closing.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self._outbox:
                req = self._outbox.popleft()
                self._inflight[req.request_id] = req
                self._dealers[req.shard].send_multipart(req.frames, copy=False)
            for shard, d in enumerate(self._dealers):
                if d in events:
                    while True:
                        try:
                            frames = d.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._complete(shard, frames)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.1
                self._expire(now)

    def _complete(self, shard: int, frames: list[zmq.Frame]) -> None:
        try:
            header = parse_header(frames[0].bytes)
        except PSError as err:
            log.error("shard %d sent an unreadable reply: %s", shard, err)
            return
        req = self._inflight.pop(header.request_id, None)
        if req is None:
            return  # answered after its deadline expired
        m = self.metrics
        if header.op == pb.ERROR:
            req.handle._part_done(PSError(header.error, header.message, shard=shard))
            return
        nbytes = 0
        for key, out, frame, version in zip(header.keys, req.outs, frames[1:], header.versions):
            buf = frame.buffer
            if len(buf) != out.nbytes:
                req.handle._part_done(PSError(
                    pb.BAD_LENGTH, f"reply for key {key} is {len(buf)} bytes; expected "
                    f"{out.nbytes}", shard=shard))
                return
            np.copyto(out, np.frombuffer(buf, _F32))
            self.versions[key] = version
            nbytes += out.nbytes
        self.min_clock = header.min_clock
        elapsed = time.perf_counter() - req.handle.started
        if req.nbytes:
            m.push_bytes.inc(req.nbytes)
            m.push_latency.observe(elapsed)
        if req.op != pb.PUSH:
            m.pull_bytes.inc(nbytes)
            m.pull_latency.observe(elapsed)
        m.min_clock.set(header.min_clock)
        req.handle._part_done()

    def _expire(self, now: float) -> None:
        late = [r for r in self._inflight.values() if now > r.deadline]
        for r in late:
            del self._inflight[r.request_id]
            r.handle._part_done(PSTimeoutError(
                f"{r.handle.what}: shard {r.shard} ({self.cfg.servers[r.shard]}) did not answer "
                f"within {self.cfg.deadline_s:.1f} s", shard=r.shard))

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
        for t in self._threads:
            t.join(timeout=5)
        for d in self._dealers:
            d.close(linger=0)
        if self._dealers:
            self._wake_rx.close(linger=0)
            self._wake_tx.close(linger=0)
        self._ctx.term()
        for c in self._channels:
            c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
