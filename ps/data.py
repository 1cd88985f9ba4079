"""The shard's ZeroMQ data plane: one ROUTER socket served by one thread.

Payload frames are received zero-copy (``copy=False``) and read in place by the update kernels;
replies send parameter buffers zero-copy with a ``MessageTracker``, so the store never writes a
buffer ZeroMQ is still sending (``ps.store``). A worker sends one message per group of keys, so
the shard applies key i while the bytes of key i+1 are still arriving (libzmq's I/O thread
receives in the background): receive and update are pipelined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from bitps.proto.wire import encode_header
from bitps.ps.shard import Reply, ShardCore

__all__ = ["DataLoop"]

_TICK_S = 0.02
_FAREWELL_MS = 500  # how long SHUTTING_DOWN replies may take to leave at stop
_HEADER_ROOM = 1 << 20  # frame 0 may name max_message_keys keys and their versions
# Plain ints: pyzmq's enum flags cost microseconds per operation on this path.
_EVENTS, _POLLIN, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


class DataLoop:
    """Binds a ROUTER on ``host:port`` (0 = any free port) and serves ``core`` until stopped."""

    def __init__(self, core: ShardCore, *, host: str, port: int,
                 context: zmq.Context | None = None,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 after_request: Callable[[], object] | None = None) -> None:
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
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, int(_TICK_S * 1000))
        # A frame beyond the limit (and its header's room) drops the connection as it arrives
        # instead of being buffered whole: libzmq delivers a multipart message only once every
        # frame is in, so the token in frame 0 cannot be read before the rest is received.
        self.socket.setsockopt(zmq.MAXMSGSIZE, core.cfg.max_frame_bytes + _HEADER_ROOM)
        addr = f"tcp://{host}"
        if port:
            self.socket.bind(f"{addr}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(addr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
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
