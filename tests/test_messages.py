"""How a request is cut into data messages (``worker.transport.messages.messages``): batched per
shard and codec up to ``message_bytes`` on the wire, each key counted at the larger of its
payload and its reply, so compressed keys share a message where their float32 size would send
each alone (every message costs both sides a receive, a header and Python per request)."""

from __future__ import annotations

import numpy as np

from bitps.native import sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import RAW, Codec
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.worker.transport.messages import messages

N = 1 << 16  # elements per key: 256 KiB of float32, the default message_bytes
LIMIT = 256 << 10
SIGN1 = Codec(pb.CODEC_SIGN1, sign1.DEFAULT_CHUNK, 0)


def _plan(keys: int = 8):
    return make_plan([ParamSpec(f"w{i}", (N,)) for i in range(keys)], num_shards=1,
                     partition_bytes=4 * N)


def test_raw_keys_of_the_limit_travel_alone():
    plan = _plan()
    keys = [k.key for k in plan.keys]
    grads = [np.zeros(N, np.float32) for _ in keys]
    groups = messages(plan, keys, grads, (), None, limit=LIMIT)
    assert [idx for _, _, idx in groups] == [[i] for i in range(len(keys))]


def test_compressed_pushes_share_messages_by_their_code_size():
    plan = _plan()
    keys = [k.key for k in plan.keys]
    groups = messages(plan, keys, (), (), [SIGN1] * len(keys), limit=LIMIT)
    # 8 codes of 8.2 KB: one message (counted in float32 bytes they went one by one)
    assert [(shard, codec, idx) for shard, codec, idx in groups] == \
        [(0, SIGN1, list(range(len(keys))))]
    # mixed codecs never share a message; each codec's keys are batched on their own
    codecs = [SIGN1, RAW] * (len(keys) // 2)
    coded = [i for i, c in enumerate(codecs) if c == SIGN1]
    raw = [i for i, c in enumerate(codecs) if c == RAW]
    groups = messages(plan, keys, (), (), codecs, limit=LIMIT)
    assert [idx for _, c, idx in groups if c == SIGN1] == [coded]
    assert [idx for _, c, idx in groups if c == RAW] == [[i] for i in raw]


def test_pulls_count_the_reply_they_last_had():
    plan = _plan()
    keys = [k.key for k in plan.keys]
    outs = [np.zeros(N, np.float32) for _ in keys]
    # never answered coded: float32 replies, a key each
    assert len(messages(plan, keys, (), outs, None, limit=LIMIT)) == len(keys)
    coded = {k: sign1.payload_bytes(N) for k in keys}
    groups = messages(plan, keys, (), outs, None, limit=LIMIT, reply_bytes=coded)
    assert [idx for _, _, idx in groups] == [list(range(len(keys)))]
    # a push_pull counts the larger side: raw payloads keep their keys apart
    grads = [np.zeros(N, np.float32) for _ in keys]
    assert len(messages(plan, keys, grads, outs, None, limit=LIMIT,
                        reply_bytes=coded)) == len(keys)
