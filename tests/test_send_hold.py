"""An encoder's payloads sent without a copy: the compressor writes no payload into a buffer a
send still reads (``Compressor.hold``), so the bytes a shard receives are the bytes encoded,
even when ZeroMQ reads them after the next encode (a message queued for a shard that is not
connected yet)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import zmq

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import CODECS, Codec, CodecConfig, Compressor
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PROTOCOL, parse_header
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.worker import ClientConfig
from bitps.worker.config import EncoderConfig
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport import channel as channel_module
from bitps.worker.transport.channel import Channel, Request
from bitps.worker.transport.messages import COPY
from tests.encoding import EncodingClient

N = 1 << 20  # a bf16 payload of 2 MiB: above the transport's zero-copy threshold


class Tracker:
    """A send's release as the transport reports it (pyzmq's ``MessageTracker``)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def test_a_held_buffer_is_not_written_until_its_send_is_done():
    comp = Compressor(Codec(CODECS["bf16"]), N)
    first = comp.encode(_grad(0))
    sent = bytes(first)
    tracker = Tracker()
    comp.hold(first, tracker)
    second = comp.encode(_grad(1))
    assert bytes(first) == sent  # the send still reads it: the next payload went elsewhere
    assert bytes(second) != sent and not comp.owns(first) and comp.owns(second)
    # once the send is done, the buffer is written again: no new buffer per step
    tracker2 = Tracker(done=True)
    comp.hold(second, tracker2)
    third = comp.encode(_grad(2))
    assert comp.owns(second) and comp.owns(third)
    # a hold on a buffer no longer written (a redo of an old payload) changes nothing
    comp.hold(first, Tracker())
    assert comp.owns(comp.encode(_grad(3)))


def test_a_payload_of_anything_else_is_neither_owned_nor_held():
    comp = Compressor(Codec(CODECS["bf16"]), N)
    payload = comp.encode(_grad(0))
    other = np.zeros(16, np.uint8)
    assert comp.owns(payload) and not comp.owns(memoryview(other))
    comp.hold(memoryview(other), Tracker())
    assert comp.owns(comp.encode(_grad(1))) and comp.owns(payload)


def _push_pulls(codec: str, *, clip: bool, steps: int = 3):
    """``steps`` push_pulls of 2 keys of ``N`` float32 through a real client and encoder to an
    in-process shard: the owners of the last push and the shard's parameters."""
    plan = make_plan([ParamSpec("w", (2 * N,))], num_shards=1, partition_bytes=4 * N)
    keys = [k.key for k in plan.keys]
    copy = (np.random.default_rng(7).standard_normal(2 * N) * 0.02).astype(np.float32)
    outs = [copy[k.offset:k.offset + k.length] for k in plan.keys]
    shard = create_server(ServerConfig(mode="sync", metrics_port=-1, threads=1,
                                       optimizer=OptimizerConfig(name="adam", lr=1e-3)))
    try:
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           partition_bytes=4 * N)
        enc = EncoderConfig(push_codec=CodecConfig(name=codec), compress_min_bytes=0)
        with EncodingClient(cfg, encoder=enc) as client:
            client.register(plan, dict(zip(keys, outs)))
            rng = np.random.default_rng(1)
            for step in range(steps):
                grads = [(rng.standard_normal(N) * 1e-2).astype(np.float32) for _ in keys]
                scale = 0.5 if clip else None
                sent = client.encode(keys, grads, clock=step, scale=scale)
                client.push_pull(keys, grads, outs, clock=step, scale=scale).wait()
        # raw and unclipped: the gradients themselves, no Encoded
        params = np.concatenate([shard.core.slots[k].param for k in keys])
        return getattr(sent, "owners", None), params
    finally:
        shard.stop(0)


@pytest.mark.parametrize("codec,clip", [("bf16", False), ("raw", True), ("raw", False)])
def test_pushes_held_zero_copy_land_as_pushes_sent_by_copy(codec, clip, monkeypatch):
    """A compressor's payloads (bf16; raw keys with clipping, whose raw compressor keeps the
    residual) are sent zero-copy and held by their compressor, a caller's own gradients
    zero-copy as they are; the shard ends bit for bit where it ends when every frame goes by
    copy."""
    owners, held = _push_pulls(codec, clip=clip)
    if codec == "raw" and not clip:
        assert owners is None
    else:
        assert all(isinstance(o, Compressor) for o in owners)
    monkeypatch.setattr(channel_module, "ZERO_COPY_MIN_BYTES", 1 << 62)  # every frame copied
    _, copied = _push_pulls(codec, clip=clip)
    np.testing.assert_array_equal(held.view(np.uint32), copied.view(np.uint32))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("held", [True, False])
def test_a_queued_zero_copy_push_arrives_as_encoded_after_the_next_encode(held):
    """The channel sends a compressor's payload zero-copy and the compressor holds it; the
    shard is not listening yet, so ZeroMQ keeps the message (and reads its buffer) until it
    connects, after the compressor encoded the next step. Without an owner (``COPY``) the
    payload goes by copy: the same bytes arrive either way."""
    context = zmq.Context()
    port = _free_port()
    channel = Channel(context, [f"tcp://127.0.0.1:{port}"], servers=["shard 0"],
                      metrics=WorkerMetrics(), versions={})
    router = context.socket(zmq.ROUTER)
    try:
        comp = Compressor(Codec(CODECS["bf16"]), N)
        payload = comp.encode(_grad(0))
        expected = bytes(payload)
        header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=0, request_id=1,
                               keys=[0], dtype=pb.FLOAT32)
        channel.send([Request(0, 1, [0], header, [payload], (), None,
                              time.monotonic() + 30, pb.PUSH, 4 * N,
                              owners=[comp if held else COPY])])
        comp.encode(_grad(1))  # the next step, before ZeroMQ has read the first
        assert comp.owns(payload) is not held  # held: the next payload went to a new buffer
        router.bind(f"tcp://127.0.0.1:{port}")
        assert router.poll(10_000), "the queued push never arrived"
        _, head, body = router.recv_multipart()
        assert parse_header(head).request_id == 1
        assert body == expected
    finally:
        router.close(0)
        for dealer in channel.dealers:
            dealer.close(0)
        context.term()
