"""The raw pyzmq peer: a ROUTER that answers every multipart with the same number of bytes in
frames of the same sizes, from preallocated buffers, zero-copy. What bitps' data plane is measured
against: the same bytes both ways over the same transport with no PS logic.

Run as ``python -m bitps.bench.rawzmq``; prints ``{"event": "ready", "port": N}`` then serves until
killed.
"""

from __future__ import annotations

import sys

import numpy as np

from bitps.bench.proc import ready_router

__all__ = ["serve"]


def serve(host: str = "127.0.0.1") -> None:
    sock = ready_router(host)
    replies: dict[int, np.ndarray] = {}
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, payload = frames[0], frames[1:]
        out = [ident]
        for f in payload:
            n = len(f.buffer)
            if n not in replies:
                replies[n] = np.ones(n, dtype=np.uint8)
            out.append(replies[n])
        sock.send_multipart(out, copy=False)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1")
