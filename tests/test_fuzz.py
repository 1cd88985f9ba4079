"""Fuzzing a live ``bitps-server``: 10,000+ random and mutated data-plane messages and 1,000+
malformed gRPC calls, with a fixed seed.

The shard runs in sync mode for a world of 2 in which only rank 0 registered (and rank 1's slot
stays live: ``--heartbeat-timeout 600``), so no step can complete: a fuzzed message that happens
to be a valid push is accumulated, never applied, and the parameters must come out bit for bit
as they went in. Held pulls end in ``DEADLINE`` after 0.3 s, so every message gets its answer.
Checked: the process stays alive and SERVING, every data message is answered (a typed ``ERROR``
or a ``REPLY``) or dropped where the protocol says so (a frame over ``MAXMSGSIZE`` closes the
connection), no update is applied, the parameters' digest is unchanged, and RSS stays bounded.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2

from bitps.bench.faults import start_server
from bitps.proto import bitps_pb2 as pb
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PROTOCOL
from bitps.worker import ClientConfig, PSClient

TOKEN = "fuzz-token-17"
N = 4096
DATA_MESSAGES = 10_240
GRPC_CALLS = 1_200
SOCKETS, BATCH = 8, 64  # a batch per socket in flight at once
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
ERROR_CODES = set(pb.ErrorCode.values()) - {pb.OK}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    log = (tmp_path_factory.mktemp("fuzz") / "shard.log").open("w")
    proc = start_server("--mode", "sync", "--token", TOKEN, "--heartbeat-timeout", "600",
                        "--pull-deadline", "0.3", "--max-pull-deadline", "0.3",
                        "--optimizer", "sgd", "--lr", "0.5", stderr=log)
    plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=4096)
    keys = [k.key for k in plan.keys]
    client = PSClient(ClientConfig(servers=(proc.grpc_address,), rank=0, world_size=2,
                                   token=TOKEN, deadline_s=10))
    start = np.linspace(-3, 3, N, dtype=np.float32)
    client.register(plan, {k.key: start[k.offset:k.offset + k.length] for k in plan.keys})
    yield proc, client, keys
    client.close(leave=False)
    proc.kill()
    log.close()


def _digest(client: PSClient, keys: list[int]) -> str:
    outs = [np.empty(client.plan.keys[k].length, np.float32) for k in keys]
    client.pull(keys, outs, clock=0).wait()
    return hashlib.blake2b(b"".join(o.tobytes() for o in outs), digest_size=16).hexdigest()


# -- data plane ------------------------------------------------------------------------------------
def _valid(rng: random.Random, keys: list[int]) -> tuple[pb.DataHeader, list[bytes]]:
    op = rng.choice([pb.PUSH, pb.PULL, pb.PUSH_PULL])
    ks = rng.sample(keys, rng.randint(1, len(keys)))
    header = pb.DataHeader(op=op, protocol=PROTOCOL, worker=0, request_id=rng.getrandbits(64),
                           clock=rng.choice([0, 0, 1, 2]), keys=ks, dtype=pb.FLOAT32,
                           token=TOKEN, incarnation=rng.getrandbits(64))
    grad = np.full(1024, 0.5, np.float32).tobytes()
    return header, [] if op == pb.PULL else [grad] * len(ks)


def _hostile_fields(rng: random.Random, header: pb.DataHeader) -> None:
    """Set one or more fields to an impossible value (in the field's own range)."""
    choices = [
        lambda: setattr(header, "clock", rng.choice([1025, 1 << 40, (1 << 63) - 1, 1 << 63,
                                                     U64])),
        lambda: setattr(header, "op", rng.choice([0, 4, 5, 6, 99, -1, (1 << 31) - 1])),
        lambda: setattr(header, "dtype", rng.choice([0, 2, 3, 7, -5, (1 << 31) - 1])),
        lambda: setattr(header, "codec", rng.choice([1, 2, 3, 4, 5, 77, -1])),
        lambda: setattr(header, "codec_chunk", rng.choice([0, 1, 63, 64, 65, 1 << 20, U32])),
        lambda: setattr(header, "codec_flags", rng.choice([1, 2, 3, 255, U32])),
        lambda: setattr(header, "protocol", rng.choice([0, 2, U32])),
        lambda: setattr(header, "worker", rng.choice([1, 2, 4095, 4096, U32])),
        lambda: setattr(header, "token", rng.choice(["", "wrong", TOKEN + "x", "\u2603" * 40])),
        lambda: setattr(header, "deadline_s", rng.choice([math.nan, math.inf, -1.0, 1e300,
                                                          -0.0, 5e-324])),
        lambda: header.keys.extend(rng.choices([0, 1, 2, 3, 4, U32], k=rng.randint(1, 40))),
        lambda: header.versions.extend(rng.getrandbits(64) for _ in range(rng.randint(1, 9))),
        lambda: header.frame_codecs.extend([3, 4]),
        lambda: setattr(header, "pad", bytes(rng.randint(0, 300))),
        lambda: setattr(header, "incarnation", 0),  # a push without one: BAD_HEADER
    ]
    for _ in range(rng.randint(1, 3)):
        rng.choice(choices)()


def _payload(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """Frames of wrong number, length or content (NaN, random codes)."""
    kind = rng.randrange(5)
    if kind == 0:
        return frames[:-1] if frames else [b"x"]
    if kind == 1:
        return [*frames, rng.randbytes(rng.randint(0, 64))]
    if kind == 2:
        return [f[:rng.randint(0, len(f))] for f in frames]
    if kind == 3:
        nan = np.full(1024, np.nan, np.float32)
        nan[1:] = 0.25
        return [nan.tobytes() for _ in frames]
    return [rng.randbytes(rng.choice([0, 1, 16, 136, 264, 2048, 4096])) for _ in frames]


def _bit_flips(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def data_messages(rng: random.Random, keys: list[int], n: int):
    """``n`` fuzzed multipart messages: random bytes, bit-flipped or truncated valid headers,
    impossible field values, wrong frames, huge key lists."""
    for i in range(n):
        header, frames = _valid(rng, keys)
        kind = rng.randrange(6)
        if kind == 0:
            yield [rng.randbytes(rng.randint(0, 200)),
                   *(rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 3)))]
        elif kind == 1:
            yield [_bit_flips(rng, header.SerializeToString()), *frames]
        elif kind == 2:
            data = header.SerializeToString()
            yield [data[:rng.randrange(len(data))], *frames]
        elif kind == 3:
            _hostile_fields(rng, header)
            yield [header.SerializeToString(), *frames]
        elif kind == 4:
            yield [header.SerializeToString(), *_payload(rng, frames)]
        elif i % 50 == 0:  # huge counts: over max_message_keys, or 10k keys and no frames
            header.ClearField("keys")
            header.keys.extend(rng.choice([range(70_000), [1] * 10_000]))
            yield [header.SerializeToString()]
        else:
            _hostile_fields(rng, header)
            yield [header.SerializeToString(), *_payload(rng, frames)]


def _classify(first: bytes, counts: Counter) -> None:
    reply = pb.DataHeader()
    reply.ParseFromString(first)  # a reply that does not parse fails the test
    if reply.op == pb.ERROR:
        assert reply.error in ERROR_CODES and reply.message, reply
        counts[pb.ErrorCode.Name(reply.error)] += 1
    else:
        assert reply.op == pb.REPLY, reply
        counts["REPLY"] += 1


def _exchange(socks: list[zmq.Socket], batches: list[list[list[bytes]]], counts: Counter) -> None:
    """Send one batch on every socket, then read every answer (held pulls: at most 0.3 s)."""
    for sock, batch in zip(socks, batches):
        for msg in batch:
            sock.send_multipart(msg)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    left = {sock: len(batch) for sock, batch in zip(socks, batches)}
    end = time.monotonic() + 10
    while any(left.values()):
        assert time.monotonic() < end, f"{sum(left.values())} messages never answered"
        for sock, _ in poller.poll(200):
            _classify(sock.recv_multipart()[0], counts)
            left[sock] -= 1


def _oversized(port: int, counts: Counter) -> None:
    """A frame over the shard's MAXMSGSIZE (max_frame_bytes + 1 MiB) drops the connection: no
    answer, by design. One just under it is read and refused TOO_LARGE."""
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=0, clock=0, keys=[0],
                           dtype=pb.FLOAT32, token=TOKEN, incarnation=0x51).SerializeToString()
    for size, expect in (((18 << 20), None), ((16 << 20) + 1, pb.TOO_LARGE)):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([header, bytes(size)])
        if expect is None:
            assert not sock.poll(1500), "an oversized frame was answered"
            counts["dropped (MAXMSGSIZE)"] += 1
        else:
            assert sock.poll(5000)
            _classify(sock.recv_multipart()[0], counts)
            assert counts["TOO_LARGE"] == 1
        sock.close()


# -- control plane ---------------------------------------------------------------------------------
_UNARY = ["/bitps.Control/Heartbeat", "/bitps.Control/Status", "/bitps.Control/Leave",
          "/grpc.health.v1.Health/Check"]


def _hostile_register(rng: random.Random, signature: str) -> list[bytes]:
    """A registration that is well formed and wrong in one way (never one that would admit
    rank 1: that would let a step complete)."""
    req = pb.RegisterRequest(protocol=PROTOCOL, rank=0, world_size=2, signature=signature,
                             num_shards=1, shard_id=0, token=TOKEN,
                             keys=[pb.KeySpec(key=k, length=1024, dtype=pb.FLOAT32)
                                   for k in range(4)])
    defect = rng.randrange(8)
    if defect == 0:
        req.signature = "f" * rng.choice([0, 32, 5000])
    elif defect == 1:
        req.world_size, req.rank = rng.choice([(0, 0), (2, 2), (U32, 1), (3, 1)])
    elif defect == 2:
        req.num_shards, req.shard_id = rng.choice([(7, 0), (1, 3), (0, 0)])
    elif defect == 3:
        req.protocol = rng.choice([0, 2, U32])
    elif defect == 4:
        req.ClearField("keys")
        req.keys.extend(pb.KeySpec(key=k, length=U64 >> 8) for k in range(rng.choice([1, 3])))
        req.rank = 1
    elif defect == 5:
        req.token = "wrong"
    elif defect == 6:
        req.value_digests.extend([b"\x00" * rng.choice([0, 3, 16])] * rng.choice([1, 4, 9]))
        req.signature = "0" * 32
    else:
        req.rank, req.sends_values = 1, True
        req.signature = "1" * 32
    msgs = [pb.RegisterMessage(request=req).SerializeToString()]
    for _ in range(rng.randint(0, 3)):
        msgs.append(pb.RegisterMessage(values=pb.KeyValues(
            key=rng.choice([0, 9, U32]), data=rng.randbytes(rng.choice([0, 4, 4096])))
        ).SerializeToString())
    if rng.random() < 0.2:
        msgs.reverse()  # values first
    return msgs


def _hostile_unary(rng: random.Random, method: str) -> bytes:
    rank = rng.choice([2, 5, 4096, U32])  # never 0 or 1: their Leave is a real membership change
    if method.endswith("Heartbeat"):
        return pb.HeartbeatRequest(rank=rng.choice([0, rank]), clock=rng.getrandbits(64),
                                   token=TOKEN).SerializeToString()
    if method.endswith("Leave"):
        return pb.LeaveRequest(rank=rank, token=TOKEN).SerializeToString()
    if method.endswith("Check"):
        return health_pb2.HealthCheckRequest(service=rng.choice(
            ["", "bitps.Control", "nope", "\x00" * 100])).SerializeToString()
    return pb.StatusRequest(token=rng.choice([TOKEN, "", "x" * 10_000])).SerializeToString()


def grpc_calls(rng: random.Random, channel: grpc.Channel, signature: str, n: int, codes: Counter):
    """``n`` calls of random bytes, bit-flipped valid messages and hostile valid ones, with the
    right token in the metadata (mostly), a wrong one or none; 50 in flight at once."""
    pending = []
    for i in range(n):
        md = rng.choice([(("bitps-token", TOKEN),)] * 4 + [(("bitps-token", "no"),), None])
        kind = rng.randrange(3)
        method = rng.choice([*_UNARY, "/bitps.Control/Register", "/bitps.Control/RuleState"])
        if method.endswith("Register"):
            msgs = ([rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(0, 3))]
                    if kind == 0 else _hostile_register(rng, signature))
            if kind == 1:
                msgs = [_bit_flips(rng, m) for m in msgs]
            pending.append(channel.stream_unary(method).future(iter(msgs), timeout=10,
                                                               metadata=md))
        elif method.endswith("RuleState"):
            req = (rng.randbytes(rng.randint(0, 40)) if kind == 0 else pb.RuleStateRequest(
                rank=rng.choice([0, 1, 9]), token=TOKEN).SerializeToString())
            try:  # a stream: read it to its end here (OK, or a status)
                list(channel.unary_stream(method)(req, timeout=10, metadata=md))
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1
        else:
            req = rng.randbytes(rng.randint(0, 300)) if kind == 0 else _hostile_unary(rng, method)
            if kind == 1:
                req = _bit_flips(rng, req)
            pending.append(channel.unary_unary(method).future(req, timeout=10, metadata=md))
        if len(pending) >= 50 or i == n - 1:
            for fut in pending:
                try:
                    fut.result()
                    codes["OK"] += 1
                except grpc.RpcError as err:
                    codes[err.code().name] += 1
            pending = []


def test_fuzzed_data_and_grpc_messages_leave_the_shard_alive_and_unchanged(shard):
    proc, client, keys = shard
    rng = random.Random(17)
    before = _digest(client, keys)
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(SOCKETS)]
    for sock in socks:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{proc.data_port}")
    counts: Counter = Counter()
    # Warm up: the first decode of each codec compiles its numba kernels (~50 MiB, once).
    warm = data_messages(rng, keys, SOCKETS * BATCH * 2)
    for _ in range(2):
        _exchange(socks, [[next(warm) for _ in range(BATCH)] for _ in socks], counts)
    rss0 = proc.rss_kib()
    counts.clear()
    messages = data_messages(rng, keys, DATA_MESSAGES)
    for _ in range(DATA_MESSAGES // (SOCKETS * BATCH)):
        _exchange(socks, [[next(messages) for _ in range(BATCH)] for _ in socks], counts)
    for sock in socks:
        sock.close()
    _oversized(proc.data_port, counts)
    codes: Counter = Counter()
    with grpc.insecure_channel(proc.grpc_address) as channel:
        grpc_calls(rng, channel, client.plan.signature, GRPC_CALLS, codes)
    rss1 = proc.rss_kib()
    print(f"\ndata plane: {sum(counts.values())} messages: {dict(counts)}")
    print(f"gRPC: {sum(codes.values())} calls: {dict(codes)}")
    print(f"shard VmRSS before {rss0} KiB, after {rss1} KiB")
    answered = sum(v for k, v in counts.items() if not k.startswith("dropped"))
    assert answered == DATA_MESSAGES + 1 and counts["dropped (MAXMSGSIZE)"] == 1
    assert sum(codes.values()) == GRPC_CALLS
    # Every call ended in a status the servicer chose; none timed out or hit a handler bug.
    assert not {"DEADLINE_EXCEEDED", "UNAVAILABLE", "UNKNOWN"} & set(codes), codes
    assert proc.alive() and proc.health() == health_pb2.HealthCheckResponse.SERVING
    assert proc.status(TOKEN).updates_applied == 0
    assert _digest(client, keys) == before
    assert rss1 - rss0 < 32 * 1024, (rss0, rss1)  # 40 MB of fuzz went through it
