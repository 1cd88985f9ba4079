"""One thread's data-plane connection to every shard: DEALER sockets, requests in flight, and the
progress routine that receives replies and completes handles.

ZeroMQ sockets are not thread-safe, so each thread that submits requests gets a channel of its
own (``PSClient`` keeps them thread-local) and sends on it directly: no hand-off to another
thread sits on the latency path. Replies are received by whichever thread waits on a handle of
the channel; the channel's lock makes that safe (a socket may move between threads across a full
memory barrier) and lets any thread wait on any handle. Ordering: one channel is one FIFO
connection per shard, so a worker's requests from one thread reach each shard in order.

With :class:`CurveClient` keys every DEALER is a CURVE client of its shard (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.sendbuffer import ZERO_COPY_MIN_BYTES
from bitps.proto.wire import PSError, encode_header, parse_header
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.messages import COPY

__all__ = ["Channel", "CurveClient", "Handle", "PSTimeoutError", "ShardLostError"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
_SLICE_S = 0.05  # longest a waiter holds the channel lock before letting others in
_EXPIRY_CHECK_S = 0.1  # granularity of request deadlines
# Plain ints: pyzmq's enum flags cost microseconds per operation on this path.
_EVENTS, _POLLIN, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


class PSTimeoutError(PSError, TimeoutError):
    """A wait outlived its deadline; the message names worker, shard, keys and clock."""

    def __init__(self, message: str, *, shard: int | None = None) -> None:
        super().__init__(pb.DEADLINE, message, shard=shard)


class ShardLostError(PSTimeoutError):
    """A shard stayed lost: re-registering with it and redoing the exchange did not succeed
    within ``ClientConfig.reconnect_timeout_s``. ``address`` is the shard's gRPC ``host:port``,
    ``waited_s`` how long the worker tried, ``last`` the last failure seen."""

    def __init__(self, shard: int, address: str, waited_s: float, last: BaseException | None,
                 *, rank: int) -> None:
        self.address, self.waited_s, self.last = address, waited_s, last
        super().__init__(f"worker {rank}: shard {shard} ({address}) lost; tried to re-register "
                         f"and redo the exchange for {waited_s:.1f} s (reconnect_timeout_s); "
                         f"last failure: {last}", shard=shard)


@dataclass(frozen=True)
class CurveClient:
    """A worker's CURVE keys, Z85: the shards' public key and this worker's own pair."""

    server: bytes
    public: bytes
    secret: bytes


class Handle:
    """Completion of one push / pull / push_pull across shards; :meth:`wait` blocks on it.

    It keeps its :attr:`requests` (and so their payloads) until it is dropped, so that
    ``PSClient.complete`` can send a lost shard's part again, byte for byte. ``on_slow``
    (``PSClient.on_slow_wait``) is told about each shard still silent at half a wait's
    limit."""

    def __init__(self, channel: Channel | None, parts: int, what: tuple, deadline_s: float,
                 keep: tuple = (),
                 on_slow: Callable[[int, float], object] | None = None) -> None:
        self._channel = channel
        self._on_slow = on_slow
        self._left = parts
        self._error: PSError | None = None
        self.requests: list[Request] = []
        """The data messages of this handle (set by the client once built)."""
        self.rejoins: tuple[int, ...] = ()
        """Per shard, the client's count of its re-registrations when this was sent (set by
        the client): ``PSClient.complete`` re-registers only a shard not re-registered since."""
        self._open: dict[int, int] = {}  # shard -> parts not yet answered
        self._failed: dict[int, PSError] = {}  # shard -> its first error
        # A plain flag, not an Event: every waiter drives the channel itself (blocking on its
        # socket or its lock), so nobody sleeps on the handle and nothing needs waking.
        self._complete = parts == 0
        self._keep = keep  # arrays ZeroMQ may still be sending from
        self._what = what  # (rank, op, clock, keys), formatted only for error messages
        self.deadline_s = deadline_s
        self.started = time.perf_counter()

    @property
    def what(self) -> str:
        """``worker R OP clock C keys [...]``: what this handle waits for."""
        rank, op, clock, keys = self._what
        more = "..." if len(keys) > 8 else ""
        return f"worker {rank} {pb.Op.Name(op)} clock {clock} keys {list(keys[:8])}{more}"

    @property
    def clock(self) -> int:
        """The worker's clock this exchange is for (before any per-shard shift)."""
        return self._what[2]

    def track(self, shard: int) -> None:
        """Count one part going to ``shard`` (the client, while building the requests)."""
        self._open[shard] = self._open.get(shard, 0) + 1

    def failed_shards(self) -> dict[int, PSError | None]:
        """The shards whose part failed (their first error) or has not been answered yet
        (``None``): what a redo must send again."""
        out: dict[int, PSError | None] = dict(self._failed)
        for shard, n in self._open.items():
            if n > 0:
                out.setdefault(shard, None)
        return out

    def done(self) -> bool:
        """True once every shard has answered (receives pending replies without blocking)."""
        if not self._complete and self._channel is not None:
            self._channel.progress(0.0, blocking=False)
        return self._complete

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise the first shard's :class:`PSError`, or
        :class:`PSTimeoutError` after ``timeout`` seconds (default: the client's deadline)."""
        limit = self.deadline_s if timeout is None else timeout
        start = time.monotonic()
        end, slow_at = start + limit, start + limit / 2
        while not self._complete:
            now = time.monotonic()
            if self._on_slow is not None and now >= slow_at:
                slow_at = float("inf")  # once per wait
                self._tell_slow(now - start)
            left = end - time.monotonic()
            if left <= 0:
                open_ = sorted(s for s, n in self._open.items() if n > 0)
                # a typed error another shard already sent says more than the silence: keep it
                also = f"; before that: {self._error}" if self._error is not None else ""
                raise PSTimeoutError(f"{self.what}: no answer after {limit:.1f} s"
                                     + (f" from shards {open_}" if open_ else "") + also,
                                     shard=open_[0] if open_ else None)
            self._channel.progress(min(left, _SLICE_S))
        self._keep = ()
        if self._error is not None:
            raise self._error

    def _tell_slow(self, waited_s: float) -> None:
        """Call ``on_slow`` for each shard still owing an answer; a diagnosis that fails is
        logged and must not fail the wait."""
        for shard in sorted(s for s, n in self._open.items() if n > 0):
            try:
                self._on_slow(shard, waited_s)
            except Exception:
                log.exception("%s: on_slow_wait(%d, %.1f) failed", self.what, shard, waited_s)

    def _part_done(self, error: PSError | None = None, shard: int | None = None) -> None:
        # Only called by the thread holding the channel lock: no lock of its own needed.
        if error is not None and self._error is None:
            self._error = error
        if shard is not None:
            self._open[shard] = self._open.get(shard, 0) - 1
            if error is not None:
                self._failed.setdefault(shard, error)
        self._left -= 1
        if self._left == 0:
            self._complete = True


@dataclass
class Request:
    """One data message in flight."""

    shard: int
    request_id: int
    keys: list[int]
    header: pb.DataHeader
    payload: list
    outs: Sequence[np.ndarray]
    handle: Handle | None
    """The handle this is part of; ``None`` once :meth:`settle` told it the outcome."""
    deadline: float
    op: int
    nbytes: int
    owners: Sequence = ()
    """How each payload frame is sent, where given (``messages.Encoded.owners``): ``None``
    zero-copy as it is, ``messages.COPY`` by copy, else zero-copy and held by its owner."""
    clock: int = 0
    """The worker's clock (``header.clock`` is this plus the shard's clock shift)."""

    def settle(self, error: PSError | None, shard: int) -> None:
        """Tell the handle this part is done (answered, refused or expired), then let go of
        it. The handle keeps its requests for a redo; a request that kept its handle as well
        would close a reference cycle, and the payloads (a raw push's gradients, sent
        zero-copy) would outlive the step until Python's cyclic collector ran: a worker's
        memory grew by a gradient per step between collections, every step's in fresh pages."""
        handle, self.handle = self.handle, None
        handle._part_done(error, shard)


class CodeApplier:
    """How a worker adds one code a shard published to its copy of a key: the decode, by
    default. An algorithm whose codes mean something else (sync 1-bit Adam's momenta,
    ``worker.algorithms.onebit.OneBitMomentum``) passes its own; the transport knows none of
    them."""

    def add(self, key: int, code, out: np.ndarray, codec: Codec, version: int) -> None:
        """Add ``code``, the update that made ``key``'s ``version``, to ``out``."""
        codec.decode_add(code, out.shape[0], out)


DECODE_ADD = CodeApplier()


class Channel:
    """DEALER sockets to every shard for one submitting thread."""

    def __init__(self, context: zmq.Context, endpoints: list[str], *, servers: Sequence[str],
                 metrics: WorkerMetrics, versions: dict[int, int],
                 codes: CodeApplier | None = None, curve: CurveClient | None = None,
                 heard: Callable[[int, int], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.heard = heard  # (shard, incarnation) of every reply: ControlClient.heard_from
        self.curve = curve
        self.codes = codes or DECODE_ADD
        self.servers = servers
        self.metrics = metrics
        self.versions = versions
        self.reply_bytes: dict[int, int] = {}
        """Each key's last coded reply's size: what its next pull is counted at when requests
        are cut into messages (``messages.messages``); a key never answered coded counts its
        float32 bytes."""
        self.inflight: dict[int, Request] = {}
        self.min_clock = 0
        self._next_expiry_check = 0.0
        self.dealers = []
        self.pending = [0] * len(endpoints)  # requests in flight per shard
        self.poller = zmq.Poller()
        self._wake_fd: int | None = None  # registered in the poller by progress(wake_fd=...)
        for ep in endpoints:
            d = self._dealer(context, ep)
            self.dealers.append(d)
            self.poller.register(d, zmq.POLLIN)

    def _dealer(self, context: zmq.Context, endpoint: str) -> zmq.Socket:
        d = context.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, int(_SLICE_S * 1000))
        if self.curve is not None:  # before connect: the handshake uses them
            d.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server)
            d.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public)
            d.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
        d.connect(endpoint)
        return d

    def send(self, requests: list[Request]) -> None:
        wire = sum(part.nbytes for req in requests for part in req.payload)
        with self.lock:
            for req in requests:
                old = self.inflight.get(req.request_id)
                if old is not None:  # sent again (PSClient.complete): one answer expected
                    self.pending[old.shard] -= 1
                    if old is not req:
                        old.handle = None  # the answer goes to the redo's handle
                self.inflight[req.request_id] = req
                self.pending[req.shard] += 1
                sock, payload = self.dealers[req.shard], req.payload
                owners = req.owners or [None] * len(payload)
                # Zero-copy for big payloads; below ZeroMQ's copy threshold a copying send is
                # cheaper than building a zero-copy frame that copies anyway.
                copies = [owner is COPY or part.nbytes < ZERO_COPY_MIN_BYTES
                          for part, owner in zip(payload, owners)]
                bulk = payload[0] if payload and not copies[0] else None
                sock.send(encode_header(req.header, bulk), _SNDMORE if payload else 0)
                last = len(payload) - 1
                for i, (part, copy, owner) in enumerate(zip(payload, copies, owners)):
                    flags = 0 if i == last else _SNDMORE
                    if copy or owner is None:
                        sock.send(part, flags, copy=copy)
                    else:  # the encoder's buffer: it writes another until ZeroMQ lets go
                        owner.hold(part, sock.send(part, flags, copy=False, track=True))
        if wire:
            with self.metrics.lock:
                self.metrics.push_wire_bytes.inc(wire)

    def progress(self, timeout_s: float, *, blocking: bool = True,
                 wake_fd: int | None = None) -> None:
        """Receive and dispatch replies for up to ``timeout_s``; expire overdue requests. With
        ``wake_fd`` the wait also ends as soon as that file descriptor is readable (the caller
        drains it): a thread that both sends and receives is woken by new work."""
        if not self.lock.acquire(blocking=blocking, timeout=timeout_s if blocking else -1):
            return
        try:
            self._receive(timeout_s if blocking else 0.0, wake_fd)
            now = time.monotonic()
            if self.inflight and now >= self._next_expiry_check:
                # Deadlines are seconds long: scanning every request per reply would make a
                # step with n messages cost O(n^2).
                self._next_expiry_check = now + _EXPIRY_CHECK_S
                self._expire(now)
        finally:
            self.lock.release()

    def _receive(self, timeout_s: float, wake_fd: int | None = None) -> None:
        busy = [s for s, n in enumerate(self.pending) if n]
        if not busy:
            return
        if wake_fd is not None:
            if wake_fd != self._wake_fd:
                if self._wake_fd is not None:
                    self.poller.unregister(self._wake_fd)
                self.poller.register(wake_fd, zmq.POLLIN)
                self._wake_fd = wake_fd
            for sock, _ in self.poller.poll(timeout_s * 1000):
                if sock != wake_fd:
                    self._drain(self.dealers.index(sock))
            return
        if len(busy) == 1 and timeout_s >= _SLICE_S:
            # One shard to hear from: a blocking receive (RCVTIMEO = one slice) is cheaper
            # than building a poll set.
            shard = busy[0]
            try:
                self._read_reply(shard, self.dealers[shard])
            except zmq.Again:
                return
            self._drain(shard)
            return
        for sock, _ in self.poller.poll(timeout_s * 1000):
            if sock != self._wake_fd:
                self._drain(self.dealers.index(sock))

    def _drain(self, shard: int) -> None:
        sock = self.dealers[shard]
        while sock.get(_EVENTS) & _POLLIN:
            self._read_reply(shard, sock)

    def _read_reply(self, shard: int, sock: zmq.Socket) -> None:
        """Receive one reply. The header comes first, so the payload frames are received
        straight into the request's ``outs`` (``recv_into``: one copy out of libzmq, no frame
        objects, the caller's buffers reused every step)."""
        first = sock.recv()  # raises zmq.Again when RCVTIMEO passes with nothing to read
        try:
            header = parse_header(first)
        except PSError as err:
            log.error("shard %d sent an unreadable reply: %s", shard, err)
            return self._discard(sock)
        req = self.inflight.pop(header.request_id, None)
        if req is None:
            return self._discard(sock)  # answered after its deadline expired
        self.pending[shard] -= 1
        if self.heard is not None:
            self.heard(shard, header.incarnation)
        if header.op == pb.ERROR:
            self._discard(sock)
            # A pull the shard held past its deadline is the same failure as a late answer.
            err = (PSTimeoutError(header.message, shard=shard) if header.error == pb.DEADLINE
                   else PSError(header.error, header.message, shard=shard))
            return req.settle(err, shard)
        error, nbytes, codecs = None, 0, header.frame_codecs
        published = None
        for i, (key, out) in enumerate(zip(req.keys, req.outs)):
            if not sock.get(_RCVMORE):
                error = PSError(pb.FRAME_COUNT, f"reply ends before key {key}", shard=shard)
                break
            if codecs and codecs[i] != pb.CODEC_RAW:
                frame = sock.recv(copy=False).buffer
                nbytes += frame.nbytes
                self.reply_bytes[key] = frame.nbytes
                try:
                    if published is None or published.id != codecs[i]:
                        published = Codec.from_header(pb.DataHeader(
                            codec=codecs[i], codec_chunk=header.codec_chunk,
                            codec_flags=header.codec_flags))
                except PSError as err:
                    error = error or PSError(err.code, err.message, shard=shard)
                    continue
                error = error or self._apply_updates(frame, out, key, header.versions[i],
                                                     published, shard)
                continue
            n = sock.recv_into(out)
            if n != out.nbytes and error is None:
                error = PSError(pb.BAD_LENGTH, f"reply for key {key} is {n} bytes; expected "
                                f"{out.nbytes}", shard=shard)
            nbytes += n
        self._discard(sock)
        if error is None and list(header.keys) != req.keys[:len(header.keys)]:
            error = PSError(pb.UNKNOWN_KEY, f"reply names keys {list(header.keys)[:8]}; asked "
                            f"for {req.keys[:8]}", shard=shard)
        if error is not None:
            return req.settle(error, shard)
        for key, version in zip(req.keys, header.versions):
            self.versions[key] = version
        self.min_clock = header.min_clock
        m, elapsed = self.metrics, time.perf_counter() - req.handle.started
        with m.lock:
            if req.nbytes:
                m.push_bytes.inc(req.nbytes)
                m.push_latency.observe(elapsed)
            if req.op != pb.PUSH:
                m.pull_bytes.inc(nbytes)
                m.pull_latency.observe(elapsed)
            m.min_clock.set(header.min_clock)
        req.settle(None, shard)

    def _apply_updates(self, frame: memoryview, out: np.ndarray, key: int, version: int,
                       codec: Codec, shard: int) -> PSError | None:
        """Add the codes a shard published (``ps.publish``: compressed pulls, or 1-bit Adam's
        updates) to this worker's copy ``out``, oldest first, exactly as the shard added them
        to its own; checked whole before anything is added, so a bad frame leaves the copy as
        it was. One pass per code, through :attr:`codes` (decode and add, unless the algorithm
        says otherwise: sync 1-bit Adam's codes after the warmup are momenta)."""
        n, base = out.shape[0], self.versions.get(key, 0)
        parts = codec.split(frame, n)
        if isinstance(parts, str) or len(parts) != version - base:
            what = parts if isinstance(parts, str) else f"{len(parts)} codes"
            return PSError(pb.BAD_LENGTH, f"key {key}: {what} of {codec.name} updates from "
                           f"version {base} to {version}; expected {version - base}",
                           shard=shard)
        for i, code in enumerate(parts):
            self.codes.add(key, code, out, codec, base + i + 1)
        return None

    @staticmethod
    def _discard(sock: zmq.Socket) -> None:
        """Drop the rest of a multipart message."""
        while sock.get(_RCVMORE):
            sock.recv(copy=False)

    def _expire(self, now: float) -> None:
        for r in [r for r in self.inflight.values() if now > r.deadline]:
            del self.inflight[r.request_id]
            self.pending[r.shard] -= 1
            r.settle(PSTimeoutError(
                f"{r.handle.what}: shard {r.shard} ({self.servers[r.shard]}) did not answer "
                f"within {r.handle.deadline_s:.1f} s", shard=r.shard), r.shard)

    def reset(self, shard: int, endpoint: str, context: zmq.Context) -> None:
        """Replace the socket to ``shard`` by a fresh one connected to ``endpoint``: messages
        still queued for a lost shard are dropped with the old socket (a restarted shard must
        not receive them after the worker has re-registered), and the requests in flight to it
        fail (``DEADLINE``: their waiters redo them)."""
        with self.lock:
            for r in [r for r in self.inflight.values() if r.shard == shard]:
                del self.inflight[r.request_id]
                r.settle(PSTimeoutError(
                    f"{r.handle.what}: shard {shard} ({self.servers[shard]}) was lost; the "
                    f"request was dropped with its connection", shard=shard), shard)
            self.pending[shard] = 0
            old = self.dealers[shard]
            self.poller.unregister(old)
            old.close(linger=0)
            d = self._dealer(context, endpoint)
            self.dealers[shard] = d
            self.poller.register(d, zmq.POLLIN)

    def close(self) -> None:
        with self.lock:
            for d in self.dealers:
                d.close(linger=0)
