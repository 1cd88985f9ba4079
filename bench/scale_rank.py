"""One worker of ``bitps-bench scale``'s measured points, run on an emulated node:
``python -m bitps.bench.scale_rank '<json>'``.

A synthetic step with no model compute: ``Encoder.push_pull`` of every key of a flat float32
key set (``keys`` keys of ``n`` elements, the default key plan cut for the run's shards) at the
next clock, then ``wait()``; the same gradients every step (their values do not change what a
step costs). The settings (JSON): ``servers`` (gRPC ``host:port`` of every shard, in order),
``rank``, ``world``, ``keys``, ``n``, ``codec`` (the push codec; 1-bit Adam's shards choose
their own) and ``steps``.

It prints ``{"event": "step", "end": <wall clock>, "sent_s": <seconds in push_pull: the
encode and the sends>, "cpu": <process CPU s>}`` per step and a ``done`` line with the payload
bytes it pushed and pulled. No clipping (the encoder's ``clip_norm`` 0: clipping needs the
step's global norm, which ``PSModel`` computes).

With ``"echo": true`` it is the wire's probe instead: a ZeroMQ DEALER against the sync echo
peer (``servers[0]``, ``host:port``) sends ``keys`` messages of ``4 n`` bytes each step,
zero-copy, and receives as many back (without copying them out): the same bytes in the same
messages as a raw push_pull, with no PS work on either side. Its step lines also give the time
the first answer came back (``first``). With ``"serve": true`` it is that peer: a ROUTER on
``host`` (announced as ``{"event": "ready", "port": N}``) that answers the ``i``-th message of
every one of ``peers`` clients once all of them have sent their ``i``-th, as a sync shard
answers a key once every worker pushed it, with as many bytes from a preallocated buffer.
"""

from __future__ import annotations

import json
import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from bitps.proto.codecs import CodecConfig
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker.config import ClientConfig, EncoderConfig
    from bitps.worker.training.encoder import Encoder
    from bitps.worker.transport.client import PSClient

    s = json.loads((argv or sys.argv[1:])[0])
    if s.get("echo"):
        return _echo(s)
    if s.get("serve"):
        return _serve(s)
    n, keys, servers = s["n"], s["keys"], tuple(s["servers"])
    plan = make_plan([ParamSpec("w", (keys * n,))], num_shards=len(servers),
                     partition_bytes=4 * n)
    client = PSClient(ClientConfig(servers=servers, rank=s["rank"], world_size=s["world"],
                                   partition_bytes=4 * n, deadline_s=300.0))
    encoder = Encoder(EncoderConfig(push_codec=CodecConfig(name=s["codec"]), clip_norm=0.0),
                      client)
    rng = np.random.default_rng(s["rank"])
    params = (rng.standard_normal(keys * n) * 0.02).astype(np.float32)
    outs = [params[k.offset:k.offset + k.length] for k in plan.keys]
    ids = [k.key for k in plan.keys]
    encoder.register(plan, dict(zip(ids, outs)) if client.initializes else None)
    flat = (rng.standard_normal(keys * n) * 1e-3).astype(np.float32)
    grads = [flat[k.offset:k.offset + k.length] for k in plan.keys]
    clock, cpu0 = client.clock, time.process_time()
    try:
        for _ in range(s["steps"]):
            start = time.time()
            handle = encoder.push_pull(ids, grads, outs, clock=clock)
            sent = time.time()
            handle.wait()
            clock += 1
            client.clock = clock
            print(json.dumps({"event": "step", "end": time.time(), "sent_s": sent - start,
                              "cpu": time.process_time() - cpu0}), flush=True)
        m = client.metrics
        print(json.dumps({"event": "done", "push_wire_bytes": m.push_wire_bytes.value,
                          "pull_bytes": m.pull_bytes.value}), flush=True)
    finally:
        client.close()
    return 0


def _echo(s: dict) -> int:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{s['servers'][0]}")
    frame = np.ones(4 * s["n"], np.uint8)
    cpu0 = time.process_time()
    try:
        for _ in range(s["steps"]):
            for _ in range(s["keys"]):
                sock.send(frame, copy=False)
            sock.recv(copy=False)
            first = time.time()
            for _ in range(s["keys"] - 1):
                sock.recv(copy=False)
            print(json.dumps({"event": "step", "end": time.time(), "first": first,
                              "cpu": time.process_time() - cpu0}), flush=True)
        print(json.dumps({"event": "done"}), flush=True)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


def _serve(s: dict) -> int:
    import numpy as np

    from bitps.bench.proc import ready_router

    sock = ready_router(s["host"])
    sent: dict[bytes, int] = {}
    waiting: dict[int, list[bytes]] = {}
    replies: dict[int, np.ndarray] = {}
    while True:
        ident, frame = sock.recv_multipart(copy=False)
        ident = ident.bytes
        i = sent[ident] = sent.get(ident, 0) + 1
        senders = waiting.setdefault(i, [])
        senders.append(ident)
        if len(senders) < s["peers"]:
            continue
        size = len(frame.buffer)
        reply = replies.setdefault(size, np.ones(size, np.uint8))
        for peer in waiting.pop(i):
            sock.send_multipart([peer, reply], copy=False)


if __name__ == "__main__":
    sys.exit(main())
