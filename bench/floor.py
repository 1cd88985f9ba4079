"""The floor for a Python parameter server on this machine: a shard and a client of a few lines
each that do only the work a push+pull of one key cannot skip, measured beside bitps and raw
pyzmq in ``bitps-bench pushpull``.

Per round trip it does what bitps does for one key, and nothing else:
- client: a protobuf ``DataHeader`` (padded as bitps pads it, ``proto.wire.encode_header``), the
  gradient sent zero-copy; the reply's header parsed and its payload received into the caller's
  buffer (``recv_into``, one copy);
- shard: the header parsed, the gradient received zero-copy, ``native.all_finite`` and
  ``native.sgd_step`` in place (waiting, if it must, until ZeroMQ has sent the previous reply
  from the same array), a reply header, the parameters sent zero-copy and tracked.
No validation, clocks, metrics, handles, deadlines or locks. Raw pyzmq moves the same bytes
and does none of this work; the gap between the floor and raw pyzmq is what the work itself
costs here, whatever the code around it.

Run as ``python -m bitps.bench.floor``; prints ``{"event": "ready", "port": N}`` then serves until
killed.
"""

from __future__ import annotations

import sys

import numpy as np
import zmq

from bitps import native
from bitps.bench.proc import ready_router
from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PROTOCOL, encode_header

__all__ = ["FloorClient", "serve"]

_SNDMORE = int(zmq.SNDMORE)
_INCARNATION = (0x5A5A5A5A << 32) | 1
"""The client's life id: a fixed odd 63-bit value, as many header bytes as a PSClient's random
one (a shard refuses a push without one while its exactly-once window is on)."""


def serve(host: str = "127.0.0.1") -> None:
    sock = ready_router(host)
    params: dict[int, np.ndarray] = {}  # by payload bytes: one key per size
    trackers: dict[int, zmq.MessageTracker] = {}
    lr, scale, wd = np.float32(1e-3), np.float32(1.0), np.float32(0.0)
    while True:
        ident = sock.recv()
        header = pb.DataHeader()
        header.ParseFromString(sock.recv())
        grad = np.frombuffer(sock.recv(copy=False).buffer, np.float32)
        n = grad.nbytes
        if n not in params:
            params[n] = np.zeros(grad.shape[0], np.float32)
        param, tracker = params[n], trackers.get(n)
        if tracker is not None and not tracker.done:
            tracker.wait()
        if native.all_finite(grad):
            native.sgd_step(param, grad, scale, lr, wd)
        reply = pb.DataHeader(op=pb.REPLY, protocol=PROTOCOL, worker=header.worker,
                              request_id=header.request_id, clock=header.clock + 1,
                              keys=header.keys, versions=[header.clock + 1], dtype=pb.FLOAT32)
        sock.send(ident, _SNDMORE)
        sock.send(encode_header(reply, param), _SNDMORE)
        trackers[n] = sock.send(param, 0, copy=False, track=True)


class FloorClient:
    """The client half: one key of ``grad.size`` float32 pushed and pulled per round trip."""

    def __init__(self, port: int, grad: np.ndarray) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.grad = grad
        self.out = np.empty_like(grad)
        self.clock = 0

    def round_trip(self) -> None:
        header = pb.DataHeader(op=pb.PUSH_PULL, protocol=PROTOCOL, worker=0,
                               request_id=self.clock, clock=self.clock, keys=[0],
                               versions=[self.clock], dtype=pb.FLOAT32, deadline_s=30.0,
                               incarnation=_INCARNATION)
        self.sock.send(encode_header(header, self.grad), _SNDMORE)
        self.sock.send(self.grad, 0, copy=False)
        reply = pb.DataHeader()
        reply.ParseFromString(self.sock.recv())
        self.sock.recv_into(self.out)
        self.clock += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1")
