"""The shard's ZeroMQ data plane: one ROUTER socket served by one thread.

Payload frames are received zero-copy (``copy=False``) and read in place by the update kernels;
replies send parameter buffers zero-copy with a ``MessageTracker``, so the store never writes a
buffer ZeroMQ is still sending (``ps.store``). A worker sends one message per group of keys, so
the shard applies key i while the bytes of key i+1 are still arriving (libzmq's I/O thread
receives in the background): receive and update are pipelined.

With :class:`CurveServer` keys the ROUTER is a CURVE server (every connection encrypted and
authenticated) in a ZeroMQ context of its own, whose ZAP handler (:class:`ZapHandler`, a
thread) lets in only the allowed client public keys (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PROTOCOL, encode_header
from bitps.ps.shard import Reply, ShardCore

__all__ = ["CurveServer", "DataLoop", "ZAP_DOMAIN", "ZapHandler"]

log = logging.getLogger(__name__)
ZAP_DOMAIN = "bitps"
"""The ZAP domain of a shard's ROUTER (what its :class:`ZapHandler` is asked about)."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)

_TICK_S = 0.1
"""How often the data loop looks at time passing when no request wakes it (``ShardCore.tick``:
silent workers, held pulls' deadlines, membership changes that finish a sync step; the
checkpointer). Each wake-up of an idle thread costs about 0.15-0.26 ms of CPU on a small VM (a
timer and two context switches): ticking every 20 ms, an idle shard process used 11-14 ms of CPU
a second (on the LM's sync 1-bit Adam, some 15-20 ms of a step's 75), every 100 ms 3-4.4
(``docs/benchmarks.md``, the idle shard's wake-ups).
Deadlines and timeouts are 0.5 s and up; a Leave finishes the sync step it held up within a
tick."""
_ZAP_POLL_MS = 100  # the ZAP thread's wait: how soon it sees stop()
_FAREWELL_MS = 500  # how long SHUTTING_DOWN replies may take to leave at stop
_HEADER_ROOM = 1 << 20  # frame 0 may name max_message_keys keys and their versions
# Plain ints: pyzmq's enum flags cost microseconds per operation on this path.
_EVENTS, _POLLIN, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


@dataclass(frozen=True)
class CurveServer:
    """A shard's CURVE keys, Z85: its own pair and the public keys of the clients it lets in
    (``bitps.proto.keys`` reads them from files)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]


class ZapHandler:
    """ZeroMQ's authentication hook (ZAP, RFC 27) for one context: answers every CURVE
    handshake of the context's sockets with 200 when the client's public key is in
    ``allowed``, else 400 (the client's connection is closed before any message of it is
    read). Bound before the ROUTER is, on the constructing thread; served by a thread of its
    own, which calls ``on_failure`` (or re-raises) if it fails: a silent death would leave
    every new connection waiting for an answer.

    ``refused`` counts refusals by client key; each key is logged on its first refusal and
    every 100th (a refused client reconnects every 100 ms)."""

    def __init__(self, context: zmq.Context, allowed: frozenset[bytes], *,
                 on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        self.allowed = frozenset(z85.decode(k) for k in allowed)
        self.on_failure = on_failure
        self.refused: dict[bytes, int] = {}
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(_ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bitps-zap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_allowed(self, allowed: frozenset[bytes]) -> None:
        """Answer the next handshakes with ``allowed`` (Z85 public keys), as read again
        (``ServerShard.reload_keys``); connections already made stay: CURVE authenticates a
        connection once, at its handshake."""
        self.allowed = frozenset(z85.decode(k) for k in allowed)  # one assignment: atomic

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.socket.close(linger=0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.socket.poll(_ZAP_POLL_MS):
                    self.socket.send_multipart(self.answer(self.socket.recv_multipart()))
        except BaseException as exc:
            if self.on_failure is None:
                raise
            self.on_failure(threading.current_thread().name, exc)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request ``[version, id, domain, address, identity, mechanism,
        *credentials]``: 200 for an allowed CURVE key, 400 otherwise."""
        version, request_id, domain, address, _, mechanism, *credentials = request
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        if domain == ZAP_DOMAIN.encode() and key in self.allowed:
            return [version, request_id, b"200", b"OK", z85.encode(key), b""]
        n = self.refused[key] = self.refused.get(key, 0) + 1
        if n % 100 == 1:
            log.warning("data plane: refused %s client %s from %s (%d times): key not in "
                        "curve_allowed_keys", mechanism.decode(errors="replace"),
                        z85.encode(key).decode() if len(key) == 32 else "-",
                        address.decode(errors="replace"), n)
        return [version, request_id, b"400", b"client key not allowed", b"", b""]


class DataLoop:
    """Binds a ROUTER on ``host:port`` (0 = any free port) and serves ``core`` until stopped;
    with ``curve``, a CURVE server whose clients :class:`ZapHandler` checks."""

    def __init__(self, core: ShardCore, *, host: str, port: int,
                 context: zmq.Context | None = None,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 after_request: Callable[[], object] | None = None,
                 curve: CurveServer | None = None) -> None:
        self.core = core
        self.after_request = after_request or (lambda: None)
        """Called on the loop's thread after each request and each tick is handled and BEFORE
        its replies are sent (the server's ``Checkpointer.maybe_save``): no request is in
        flight then, parameters are written by this thread alone, and a durable checkpoint
        is on disk before any worker sees the updates it holds acknowledged. Must be cheap
        when there is nothing to do."""
        self.on_failure = on_failure
        """Called with the thread's name and the error when :meth:`run` raises (a bug: bad
        requests get ERROR replies); ``None`` re-raises."""
        # A ZAP handler answers for every socket of its context, and a context has one: a
        # CURVE shard gets a context of its own (others may share the process's).
        self._own_context = curve is not None and context is None
        self.context = context or (zmq.Context() if curve else zmq.Context.instance())
        self.zap: ZapHandler | None = None
        """With ``curve``: the thread that checks client keys."""
        self.socket = self.context.socket(zmq.ROUTER)
        if curve is not None:
            # before bind: no connection may arrive before the keys and the ZAP handler
            self.zap = ZapHandler(self.context, curve.allowed, on_failure=on_failure)
            self.socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            self.socket.setsockopt(zmq.CURVE_SERVER, 1)
            self.socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
            self.socket.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, int(_TICK_S * 1000))
        # A frame beyond the limit (and its header's room) drops the connection as it arrives
        # instead of being buffered whole: libzmq delivers a multipart message only once every
        # frame is in, so the token in frame 0 cannot be read before the rest is received.
        self.socket.setsockopt(zmq.MAXMSGSIZE, core.cfg.max_frame_bytes + _HEADER_ROOM)
        self.connections = Connections(core.cfg.max_connections,
                                       idle_s=core.cfg.heartbeat_timeout_s)
        addr = f"tcp://{host}"
        if port:
            self.socket.bind(f"{addr}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(addr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.zap is not None:
            self.zap.start()
        self._thread = threading.Thread(target=self._run, name="bitps-data", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            if self.on_failure is None:
                raise
            self.on_failure(threading.current_thread().name, exc)

    def stop(self) -> None:
        """Stop serving: the loop answers the pulls it holds with ``SHUTTING_DOWN`` and ends;
        no request is handled after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        # a little linger: the SHUTTING_DOWN replies may still be on their way out
        self.socket.close(linger=_FAREWELL_MS)
        if self.zap is not None:
            self.zap.stop()
        if self._own_context:
            self.context.term()

    def run(self) -> None:
        sock, core, after = self.socket, self.core, self.after_request
        last_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                # Blocking receive with RCVTIMEO = one tick: no poll set to build per message.
                self._serve(self._receive(), after)
                while sock.get(_EVENTS) & _POLLIN:  # drain without raising zmq.Again
                    self._serve(self._receive(), after)
            except zmq.Again:
                pass
            now = time.monotonic()
            if now - last_tick >= _TICK_S:
                last_tick = now
                replies = core.tick()  # a membership change may finish a sync step
                after()
                for reply in replies:
                    self._send(reply)
        self._farewell()

    def _farewell(self) -> None:
        """Answer every held pull with ``SHUTTING_DOWN`` and wait (briefly) until ZeroMQ has
        taken the replies: the process may exit right after :meth:`stop`."""
        sock, trackers = self.socket, []
        for reply in self.core.shut_down():
            sock.send(reply.ident, _SNDMORE)
            trackers.append(sock.send(encode_header(reply.header, None), copy=False,
                                      track=True))
        end = time.monotonic() + _FAREWELL_MS / 1000
        for tracker in trackers:
            try:
                tracker.wait(max(end - time.monotonic(), 0.0))
            except zmq.NotDone:
                break  # a peer that does not read: its reply is dropped with the socket

    def _receive(self) -> list:
        """One message: routing id and header as bytes (small: a copy is cheapest), payload
        frames zero-copy as memoryviews over libzmq's buffers."""
        sock = self.socket
        parts = [sock.recv()]  # raises zmq.Again when RCVTIMEO passes with nothing to read
        if sock.get(_RCVMORE):
            parts.append(sock.recv())
        while sock.get(_RCVMORE):
            parts.append(sock.recv(copy=False).buffer)
        return parts

    def _serve(self, parts: list, after: Callable[[], object]) -> None:
        if len(parts) < 2:
            return  # a ROUTER always prefixes the routing id; an empty message has no header
        if not self.connections.admit(parts[0]):
            self._send(self.connections.refusal(parts[0]))
            return
        replies = self.core.handle(parts[0], parts[1:])
        after()  # a due checkpoint first: its updates are acknowledged only once saved
        for reply in replies:
            self._send(reply)

    def _send(self, reply: Reply) -> None:
        sock = self.socket
        sock.send(reply.ident, _SNDMORE)
        payload = reply.payload
        bulk = payload[0] if payload and reply.buffers[0] is not None else None
        sock.send(encode_header(reply.header, bulk), _SNDMORE if payload else 0)
        last = len(payload) - 1
        for i, (part, buf) in enumerate(zip(payload, reply.buffers)):
            flags = 0 if i == last else _SNDMORE
            if buf is None:
                sock.send(part, flags)  # small: one copy into the ZeroMQ message
            else:
                # This thread is the only writer of parameter buffers: track before any update.
                buf.track(sock.send(part, flags, copy=False, track=True))


class Connections:
    """The data-plane connections a shard serves, at most ``limit`` at once
    (``ServerConfig.max_connections``).

    A connection is its ROUTER routing id. It counts from its first message until it has
    been silent for ``idle_s`` (the heartbeat timeout): libzmq's connect and disconnect
    notifications (``ZMQ_ROUTER_NOTIFY``) are draft API, absent from pyzmq's libzmq, so a
    closed connection is known only by its silence. A message on a new connection while
    ``limit`` others are active is answered ``LIMIT`` (:meth:`refusal`) and not remembered;
    once enough of the others fall silent it is served."""

    def __init__(self, limit: int, *, idle_s: float,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.idle_s = idle_s
        self.now = now
        self.last_seen: dict[bytes, float] = {}

    def admit(self, ident: bytes) -> bool:
        """Whether a message on ``ident``'s connection is served (counting it if new)."""
        now = self.now()
        if ident not in self.last_seen and len(self.last_seen) >= self.limit:
            # only at the limit: forget the silent ones (a scan per refused message at most)
            self.last_seen = {i: t for i, t in self.last_seen.items()
                              if now - t < self.idle_s}
            if len(self.last_seen) >= self.limit:
                return False
        self.last_seen[ident] = now
        return True

    def refusal(self, ident: bytes) -> Reply:
        message = (f"{len(self.last_seen)} data-plane connections are active, the limit "
                   f"(max_connections {self.limit}); one is forgotten after "
                   f"{self.idle_s:g} s of silence")
        return Reply(ident, pb.DataHeader(op=pb.ERROR, protocol=PROTOCOL, error=pb.LIMIT,
                                          message=message), [], [])
