"""Tests for ps.shard.ShardCore called directly (no sockets), time driven by a fake clock:
validation and typed errors, async/sync/ssp consistency, held pulls and their deadlines,
staleness metrics, registration."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, CodecConfig, Compressor
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import store
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.shard import ShardCore

# Key 2 is 64 KiB, large enough to be answered from snapshots; keys 0 and 1 come as bytes copies.
KEYS = {0: 6, 1: 10, 2: 16384}
LR = 0.25
SGD = OptimizerConfig(name="sgd", lr=LR)
# Values are small multiples of 1/4 and LR is a power of two, so every SGD step in these tests is
# exact in float32 and expected parameters can be written as plain numpy arithmetic.
INIT = {k: ((np.arange(n) % 17 - 8) * 0.5 + k).astype(np.float32) for k, n in KEYS.items()}
_request_ids = itertools.count(1000)
INCARNATION = 0x5EED
"""The life id ``_send`` gives every request unless told otherwise (a PSClient's is random and
odd): a push without one is refused while the exactly-once window is on."""


def _grad(seed: int, key: int) -> np.ndarray:
    rng = np.random.default_rng([seed, key])
    return (rng.integers(-8, 9, KEYS[key]) * 0.25).astype(np.float32)


def _reg(rank: int, world: int, *, signature: str = "sig", token: str = "",
         keys: dict[int, int] = KEYS, **fields) -> pb.RegisterRequest:
    specs = [pb.KeySpec(key=k, name=f"p{k}", offset=0, length=n, dtype=pb.FLOAT32)
             for k, n in keys.items()]
    return pb.RegisterRequest(protocol=PROTOCOL, rank=rank, world_size=world, signature=signature,
                              num_shards=1, shard_id=0, keys=specs, sends_values=rank == 0,
                              token=token, **fields)


def _values(keys: dict[int, int] = KEYS) -> dict[int, bytes]:
    return {k: INIT[k][:n].tobytes() for k, n in keys.items()}


def _core(mode: str = "async", *, world: int = 2, ranks=(0, 1), optimizer=SGD, **cfg):
    t = [0.0]
    core = ShardCore(ServerConfig(mode=mode, optimizer=optimizer, **cfg), now=lambda: t[0])
    for r in ranks:
        core.register(_reg(r, world, token=cfg.get("token", "")), _values() if r == 0 else {})
    return core, t


def _send(core, op, worker, clock, keys, grads=(), *, ident=None, **fields):
    fields = {"protocol": PROTOCOL, "dtype": pb.FLOAT32, "request_id": next(_request_ids),
              "incarnation": INCARNATION, **fields}
    header = pb.DataHeader(op=op, worker=worker, clock=clock, keys=keys, **fields)
    frames = [header.SerializeToString()]
    frames += [g if isinstance(g, (bytes, memoryview)) else np.asarray(g, np.float32).tobytes()
               for g in grads]
    return core.handle(ident or f"w{worker}".encode(), frames)


def _arrays(reply) -> list[np.ndarray]:
    return [np.frombuffer(f, np.float32).copy() for f in reply.payload]


def _params(core) -> dict[int, np.ndarray]:
    return {k: s.param.copy() for k, s in core.slots.items()}


@dataclass
class _State:
    params: dict
    versions: dict
    steps: dict
    bufs: dict
    pushed: dict
    clocks: dict
    updates: int
    held: int


def _state(core) -> _State:
    s = core.slots
    return _State(params=_params(core), versions={k: v.version for k, v in s.items()},
                  steps={k: v.state.step for k, v in s.items()},
                  bufs={k: v.state.buf1.copy() for k, v in s.items()},
                  pushed={k: sorted(v.pushed) for k, v in s.items()},
                  clocks={r: (w.clock, w.last_seen, w.dropped)
                          for r, w in core.clocks.workers.items()},
                  updates=core.updates_applied, held=len(core.held))


def _assert_unchanged(before: _State, after: _State) -> None:
    for k in before.params:
        assert np.array_equal(before.params[k], after.params[k]), k
        assert np.array_equal(before.bufs[k], after.bufs[k]), k
    assert (before.versions, before.steps, before.pushed) == (
        after.versions, after.steps, after.pushed)
    assert before.clocks == after.clocks
    assert (before.updates, before.held) == (after.updates, after.held)


def _error_count(core, code: int) -> float:
    value = core.metrics.registry.get_sample_value("bitps_errors_total",
                                                   {"code": pb.ErrorCode.Name(code)})
    return value or 0.0


# -- bad input ----------------------------------------------------------------------------------

_G0, _G1, _G2 = _grad(0, 0), _grad(0, 1), _grad(0, 2)
_NAN1 = _G1.copy()
_NAN1[3] = np.nan
_INF2 = _G2.copy()
_INF2[-1] = -np.inf

_SIGN1 = {k: bytes(Compressor(Codec(pb.CODEC_SIGN1, 64), n).encode(_grad(0, k)))
          for k, n in KEYS.items()}
_SIGN1_NAN = bytearray(_SIGN1[2])
_SIGN1_NAN[4:8] = np.array([np.nan], "<f4").tobytes()  # the second chunk's scale
_SIGN1_NAN = bytes(_SIGN1_NAN)

BAD = {
    "unknown_key": (dict(op=pb.PUSH, keys=[0, 7], grads=[_G0, _G0]), pb.UNKNOWN_KEY,
                    ["key 7"]),
    "unknown_key_pull": (dict(op=pb.PULL, keys=[3]), pb.UNKNOWN_KEY, ["key 3"]),
    "bad_length": (dict(op=pb.PUSH, keys=[0], grads=[_G0[:5]]), pb.BAD_LENGTH,
                   ["key 0", "20 bytes", "24"]),
    "odd_length": (dict(op=pb.PUSH, keys=[1], grads=[_G1.tobytes() + b"\0"]), pb.BAD_LENGTH,
                   ["key 1", "41 bytes", "40"]),
    "float16": (dict(op=pb.PUSH, keys=[0], grads=[_G0.astype(np.float16).tobytes() * 2],
                     dtype=pb.FLOAT16), pb.BAD_DTYPE, ["FLOAT16"]),
    "codec": (dict(op=pb.PUSH, keys=[0], grads=[_G0], codec=9), pb.BAD_DTYPE,
              ["codec 9 is unknown"]),
    "codec_chunk": (dict(op=pb.PUSH, keys=[0], grads=[_SIGN1[0]], codec=pb.CODEC_SIGN1,
                         codec_chunk=100), pb.BAD_DTYPE, ["chunk 100"]),
    # A compressed payload whose length disagrees with its header (key 2 has 16384 elements).
    "sign1_length": (dict(op=pb.PUSH, keys=[0, 2], grads=[_SIGN1[0], _SIGN1[2][:-1]],
                          codec=pb.CODEC_SIGN1, codec_chunk=64), pb.BAD_LENGTH,
                     ["key 2", "sign1 payload is 3071 bytes", "expected 3072"]),
    "sign1_nan_scale": (dict(op=pb.PUSH, keys=[0, 2], grads=[_SIGN1[0], _SIGN1_NAN],
                             codec=pb.CODEC_SIGN1, codec_chunk=64), pb.NON_FINITE,
                        ["key 2", "decoded from sign1"]),
    "sparse_garbage": (dict(op=pb.PUSH, keys=[2], grads=[b"\xff" * 40],
                            codec=pb.CODEC_SPARSE, codec_chunk=64), pb.BAD_LENGTH, ["key 2"]),
    "op_99": (dict(op=99, keys=[0], grads=[_G0]), pb.UNKNOWN_OP, ["op 99"]),
    "frames_missing": (dict(op=pb.PUSH, keys=[0, 1], grads=[_G0]), pb.FRAME_COUNT,
                       ["1 payload frames for 2 keys"]),
    "frames_extra": (dict(op=pb.PUSH_PULL, keys=[0], grads=[_G0, _G0]), pb.FRAME_COUNT,
                     ["2 payload frames for 1 keys"]),
    "pull_with_payload": (dict(op=pb.PULL, keys=[0], grads=[_G0]), pb.FRAME_COUNT,
                          ["PULL carries 1 payload frames"]),
    "not_registered": (dict(op=pb.PUSH, keys=[0], grads=[_G0], worker=5), pb.NOT_REGISTERED,
                       ["worker 5"]),
    "nan": (dict(op=pb.PUSH, keys=[1], grads=[_NAN1]), pb.NON_FINITE, ["key 1"]),
    "protocol": (dict(op=pb.PUSH, keys=[0], grads=[_G0], protocol=7), pb.PROTOCOL,
                 ["protocol 7"]),
    "no_keys": (dict(op=pb.PULL, keys=[]), pb.BAD_HEADER, ["no keys"]),
    "duplicate_key": (dict(op=pb.PUSH, keys=[0, 0], grads=[_G0, _G0]), pb.BAD_HEADER,
                      ["twice"]),
    "versions_count": (dict(op=pb.PUSH, keys=[0, 1], grads=[_G0, _G1], versions=[1]),
                       pb.BAD_HEADER, ["1 versions for 2 keys"]),
    # A push's own learning rate and weight decay (bitps.Optimizer's param groups).
    "hyper_count": (dict(op=pb.PUSH, keys=[0, 1], grads=[_G0, _G1], lr=[0.1],
                         weight_decay=[0.0, 0.0]), pb.BAD_HYPERPARAMETERS,
                    ["1 lr and 2 weight_decay values for 2 keys"]),
    "hyper_lr_nan": (dict(op=pb.PUSH, keys=[0, 1], grads=[_G0, _G1], lr=[0.1, float("nan")],
                          weight_decay=[0.0, 0.0]), pb.BAD_HYPERPARAMETERS,
                     ["key 1: lr nan", "finite lr > 0"]),
    "hyper_lr_zero": (dict(op=pb.PUSH, keys=[0], grads=[_G0], lr=[0.0], weight_decay=[0.0]),
                      pb.BAD_HYPERPARAMETERS, ["key 0: lr 0.0"]),
    "hyper_wd_negative": (dict(op=pb.PUSH_PULL, keys=[2], grads=[_G2], lr=[0.1],
                               weight_decay=[-0.5]), pb.BAD_HYPERPARAMETERS,
                          ["weight_decay -0.5", ">= 0"]),
    # Multi-key requests whose last key is bad change none of the keys.
    "last_key_inf": (dict(op=pb.PUSH, keys=[0, 1, 2], grads=[_G0, _G1, _INF2]), pb.NON_FINITE,
                     ["key 2"]),
    "last_key_length": (dict(op=pb.PUSH_PULL, keys=[2, 1, 0], grads=[_G2, _G1, _G1]),
                        pb.BAD_LENGTH, ["key 0", "40 bytes"]),
    "last_key_unknown": (dict(op=pb.PUSH_PULL, keys=[0, 1, 9], grads=[_G0, _G1, _G1]),
                         pb.UNKNOWN_KEY, ["key 9"]),
    # A push without the client's life id could not be applied only once (issue 29).
    "no_incarnation": (dict(op=pb.PUSH, keys=[0], grads=[_G0], incarnation=0), pb.BAD_HEADER,
                       ["push from worker 0 (request 77) carries no incarnation",
                        "DataHeader.incarnation", "dedup_window 1024"]),
    "no_incarnation_push_pull": (dict(op=pb.PUSH_PULL, keys=[0, 1], grads=[_G0, _G1],
                                      incarnation=0), pb.BAD_HEADER,
                                 ["push_pull from worker 0 (request 77) carries no "
                                  "incarnation"]),
}


@pytest.fixture
def trained():
    """An async momentum shard after one good push, so state and versions are not trivial."""
    core, t = _core(optimizer=OptimizerConfig(name="momentum", lr=0.1, momentum=0.9))
    (ack,) = _send(core, pb.PUSH, 0, 0, [0, 1, 2], [_grad(1, 0), _grad(1, 1), _grad(1, 2)])
    assert ack.header.op == pb.REPLY
    assert core.updates_applied == 3 and core.slots[2].state.step == 1
    t[0] = 1.0
    return core


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_one_typed_error_and_changes_nothing(trained, case):
    fields, code, words = BAD[case]
    fields = dict(fields)
    op, keys, grads = fields.pop("op"), fields.pop("keys"), fields.pop("grads", ())
    worker = fields.pop("worker", 0)
    before = _state(trained)
    replies = _send(trained, op, worker, 1, keys, grads, request_id=77, **fields)
    assert len(replies) == 1
    (reply,) = replies
    h = reply.header
    assert h.op == pb.ERROR and h.error == code, (pb.ErrorCode.Name(h.error), h.message)
    assert h.request_id == 77 and h.worker == worker and h.clock == 1
    assert reply.ident == f"w{worker}".encode() and reply.payload == []
    for word in words:
        assert word in h.message, h.message
    assert _error_count(trained, code) == 1
    _assert_unchanged(before, _state(trained))


def test_garbage_header_frame(trained):
    before = _state(trained)
    (reply,) = trained.handle(b"junk", [b"\xff\x00garbage", _G0.tobytes()])
    assert reply.ident == b"junk"
    assert reply.header.op == pb.ERROR and reply.header.error == pb.BAD_HEADER
    assert "frame 0 is not a DataHeader (9 bytes)" in reply.header.message
    _assert_unchanged(before, _state(trained))


def test_header_without_op_is_bad_header(trained):
    before = _state(trained)
    (reply,) = _send(trained, 0, 0, 1, [0], [_G0], request_id=78)
    assert reply.header.op == pb.ERROR and reply.header.error == pb.BAD_HEADER
    assert "header has no op" in reply.header.message
    _assert_unchanged(before, _state(trained))


def test_header_without_op_error_echoes_request_id(trained):
    (reply,) = _send(trained, 0, 0, 1, [0], [_G0], request_id=78)
    assert reply.header.error == pb.BAD_HEADER
    assert (reply.header.request_id, reply.header.worker, reply.header.clock) == (78, 0, 1)


def test_pull_without_incarnation_is_answered(trained):
    # a pull changes nothing, so it needs no life id
    (reply,) = _send(trained, pb.PULL, 0, 1, [0, 1], incarnation=0)
    assert reply.header.op == pb.REPLY, reply.header.message
    assert [len(a) for a in _arrays(reply)] == [KEYS[0], KEYS[1]]


def test_push_without_incarnation_is_applied_with_dedup_off():
    core, _ = _core(dedup_window=0)
    for request_id in (1, 1):  # no window: the same push again is applied again
        (ack,) = _send(core, pb.PUSH, 0, 0, [0], [_G0], request_id=request_id, incarnation=0)
        assert ack.header.op == pb.REPLY, ack.header.message
    (reply,) = _send(core, pb.PUSH_PULL, 1, 0, [0], [_G0], incarnation=0)
    assert reply.header.op == pb.REPLY, reply.header.message
    assert core.updates_applied == 3
    # two workers: each async push applies lr / 2 (ServerConfig.split_lr)
    assert np.array_equal(core.slots[0].param, INIT[0] - 3 * (LR / 2) * _G0)


def test_token_checked_on_every_request():
    core, _ = _core(token="s3cret")
    before = _state(core)
    (reply,) = _send(core, pb.PUSH, 1, 0, [0], [_G0], token="guess")
    assert (reply.header.op, reply.header.error) == (pb.ERROR, pb.UNAUTHENTICATED)
    assert "worker 1" in reply.header.message
    (reply,) = _send(core, pb.PULL, 1, 0, [0])  # no token at all
    assert reply.header.error == pb.UNAUTHENTICATED
    _assert_unchanged(before, _state(core))
    (reply,) = _send(core, pb.PUSH, 1, 0, [0], [_G0], token="s3cret")
    assert reply.header.op == pb.REPLY
    # two workers: each async push applies lr / 2 (ServerConfig.split_lr)
    assert np.array_equal(core.slots[0].param, INIT[0] - LR / 2 * _G0)
    with pytest.raises(PSError) as err:
        core.register(_reg(1, 2, token="nope"), {})
    assert err.value.code == pb.UNAUTHENTICATED and "rank 1" in err.value.message


def test_frame_over_limit_is_too_large():
    t = [0.0]
    core = ShardCore(ServerConfig(optimizer=SGD, max_frame_bytes=1024), now=lambda: t[0])
    core.register(_reg(0, 1, keys={0: 6}), _values({0: 6}))
    (reply,) = _send(core, pb.PUSH, 0, 0, [0], [np.zeros(257, np.float32)])
    assert reply.header.error == pb.TOO_LARGE
    assert "1028 bytes exceeds 1024" in reply.header.message
    assert np.array_equal(core.slots[0].param, INIT[0]) and core.slots[0].version == 0


def test_push_before_initial_values_is_not_initialized():
    t = [0.0]
    core = ShardCore(ServerConfig(optimizer=SGD), now=lambda: t[0])
    core.register(_reg(1, 2), {})  # rank 1 arrives before rank 0's values
    assert not core.initialized.is_set()
    for op, grads in ((pb.PUSH, [_G0]), (pb.PULL, [])):
        (reply,) = _send(core, op, 1, 0, [0], grads)
        assert reply.header.error == pb.NOT_INITIALIZED
    assert core.updates_applied == 0
    core.register(_reg(0, 2), _values())
    (reply,) = _send(core, pb.PULL, 1, 0, [0, 1])
    assert reply.header.op == pb.REPLY
    assert [a.tolist() for a in _arrays(reply)] == [INIT[0].tolist(), INIT[1].tolist()]


# -- registration -------------------------------------------------------------------------------

def test_registration_with_other_signature_is_refused():
    core, _ = _core(ranks=(0,))
    _send(core, pb.PUSH, 0, 0, [1], [_G1])
    before = _state(core)
    with pytest.raises(PSError) as err:
        core.register(_reg(1, 2, signature="other", keys={0: 3}), {})
    assert err.value.code == pb.BAD_HEADER
    assert "'other'" in err.value.message and "'sig'" in err.value.message
    assert core.signature == "sig" and sorted(core.slots) == [0, 1, 2]
    assert not core.clocks.is_registered(1)
    _assert_unchanged(before, _state(core))


def test_rank0_reregistering_does_not_reset_trained_params():
    core, _ = _core(ranks=(0,), world=1)
    _send(core, pb.PUSH, 0, 0, [0], [_G0])
    reply = core.register(_reg(0, 1), _values())
    assert reply.mode == "async" and reply.max_frame_bytes == 16 << 20
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * _G0)
    assert core.slots[0].version == 1


@pytest.mark.parametrize("change, code, word", [
    (dict(protocol=9), pb.PROTOCOL, "protocol 9"),
    (dict(num_shards=2), pb.BAD_HEADER, "shard 0 of 2"),
    (dict(shard_id=3), pb.BAD_HEADER, "shard 3"),
    (dict(rank=4), pb.BAD_HEADER, "rank 4 outside world size 2"),
])
def test_registration_mismatch_raises(change, code, word):
    core, _ = _core(ranks=(0,))
    req = _reg(1, 2)
    for name, value in change.items():
        setattr(req, name, value)
    with pytest.raises(PSError) as err:
        core.register(req, {})
    assert err.value.code == code and word in err.value.message
    assert core.clocks.live() == [0, 1] and not core.clocks.is_registered(1)


def test_registration_rejects_bad_plans_and_values():
    t = [0.0]
    core = ShardCore(ServerConfig(optimizer=SGD), now=lambda: t[0])
    req = _reg(0, 1)
    req.keys[1].dtype = pb.FLOAT16
    with pytest.raises(PSError) as err:
        core.register(req, _values())
    assert err.value.code == pb.BAD_DTYPE and "key 1" in err.value.message
    assert core.signature == "" and core.slots == {}
    values = _values()
    del values[2]
    with pytest.raises(PSError) as err:
        core.register(_reg(0, 1), values)
    assert err.value.code == pb.UNKNOWN_KEY and "missing [2]" in err.value.message
    assert not core.initialized.is_set()


def test_failed_first_registration_changes_nothing():
    t = [0.0]
    core = ShardCore(ServerConfig(optimizer=SGD), now=lambda: t[0])
    values = _values()
    values[1] = values[1][:-4]
    with pytest.raises(PSError) as err:
        core.register(_reg(0, 1), values)
    assert err.value.code == pb.BAD_LENGTH
    # The worker fixes its model and retries; the shard must not still hold the failed plan.
    assert core.signature == "" and core.slots == {}
    core.register(_reg(0, 1, signature="fixed", keys={0: 6}), _values({0: 6}))
    assert core.signature == "fixed"


def test_empty_signature_cannot_reset_parameters():
    t = [0.0]
    core = ShardCore(ServerConfig(optimizer=SGD), now=lambda: t[0])
    try:
        core.register(_reg(0, 2, signature=""), _values())
        _send(core, pb.PUSH, 0, 0, [0], [_G0])
        core.register(_reg(1, 2, signature=""), {})
    except PSError as err:  # refusing an empty signature is a fix as well
        assert err.code == pb.BAD_HEADER
        return
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * _G0)
    assert core.slots[0].version == 1


# -- async --------------------------------------------------------------------------------------

def test_async_push_applies_on_arrival_and_pull_returns_it(monkeypatch):
    monkeypatch.setattr(store, "ZERO_COPY_MIN_BYTES", 64 << 10)  # key 2 goes zero-copy
    core, _ = _core(world=1, ranks=(0,))
    (reply,) = _send(core, pb.PULL, 0, 0, [0, 1, 2], request_id=5)
    assert reply.header.op == pb.REPLY and reply.header.request_id == 5
    assert list(reply.header.versions) == [0, 0, 0] and reply.header.dtype == pb.FLOAT32
    assert all(np.array_equal(a, INIT[k]) for k, a in zip((0, 1, 2), _arrays(reply)))
    # Small keys go by copy (no buffer to track); the large one zero-copy from its buffer.
    assert reply.buffers[0] is None and reply.buffers[2] is core.slots[2].buffer

    g0, g2 = _grad(2, 0), _grad(2, 2)
    (ack,) = _send(core, pb.PUSH, 0, 0, [0, 2], [g0, g2], request_id=6)
    assert ack.header.op == pb.REPLY and ack.header.request_id == 6 and ack.payload == []
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * g0)
    assert np.array_equal(core.slots[2].param, INIT[2] - LR * g2)
    assert np.array_equal(core.slots[1].param, INIT[1])
    assert [core.slots[k].version for k in (0, 1, 2)] == [1, 0, 1]
    assert core.updates_applied == 2

    (reply,) = _send(core, pb.PULL, 0, 1, [2, 1, 0])
    assert list(reply.header.versions) == [1, 0, 1] and list(reply.header.keys) == [2, 1, 0]
    got = _arrays(reply)
    assert np.array_equal(got[0], INIT[2] - LR * g2) and np.array_equal(got[2], INIT[0] - LR * g0)

    g0b = _grad(3, 0)
    (reply,) = _send(core, pb.PUSH_PULL, 0, 1, [0], [g0b])
    assert reply.header.clock == 2 and list(reply.header.versions) == [2]
    assert np.array_equal(_arrays(reply)[0], INIT[0] - LR * g0 - LR * g0b)
    assert core.clocks.workers[0].clock == 2


def test_push_frames_may_be_memoryviews():
    # The data loop hands payload frames over as memoryviews of the received zmq buffers.
    core, _ = _core(world=1, ranks=(0,))
    big = np.array([np.finfo(np.float32).max, -1e38, 1e-45, -0.0, 8, 0.25], np.float32)
    (ack,) = _send(core, pb.PUSH, 0, 0, [0, 1], [memoryview(big.tobytes()), memoryview(_G1)])
    assert ack.header.op == pb.REPLY  # extreme but finite values are not NON_FINITE
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * big)
    assert np.array_equal(core.slots[1].param, INIT[1] - LR * _G1)
    (reply,) = _send(core, pb.PUSH, 0, 1, [1], [memoryview(_G1[:9])])
    assert reply.header.error == pb.BAD_LENGTH and "36 bytes" in reply.header.message
    assert core.slots[1].version == 1


def test_parameters_in_flight_are_never_overwritten(monkeypatch):
    monkeypatch.setattr(store, "ZERO_COPY_MIN_BYTES", 64 << 10)  # key 2 goes zero-copy
    """Copy-on-write: while a zero-copy reply still reads a key's buffer, an update writes a new
    buffer; once the send is done, updates go back to writing in place."""
    @dataclass
    class FakeTracker:
        done: bool = False

    core, _ = _core(world=1, ranks=(0,))
    (first,) = _send(core, pb.PULL, 0, 0, [2])
    (buf,) = first.buffers
    tracker = FakeTracker()
    buf.trackers.append(tracker)
    sent = first.payload[0]
    assert np.shares_memory(sent, core.slots[2].param)
    (reply,) = _send(core, pb.PUSH_PULL, 0, 0, [2], [_grad(0, 2)])
    assert np.array_equal(sent, INIT[2]), "an in-flight buffer was overwritten"
    assert not np.shares_memory(reply.payload[0], sent)
    assert np.array_equal(reply.payload[0], core.slots[2].param)
    assert reply.header.versions == [1]
    tracker.done = True
    current = core.slots[2].param
    _send(core, pb.PUSH_PULL, 0, 1, [2], [_grad(1, 2)])
    assert core.slots[2].param is current  # nothing in flight any more: updated in place


def test_staleness_metrics_record_version_and_clock_gaps():
    core, _ = _core()

    def sample(name):
        return core.metrics.registry.get_sample_value(name)

    _send(core, pb.PUSH, 1, 0, [0], [_G0], versions=[0])  # version gap 0, clock gap 0
    _send(core, pb.PUSH, 1, 3, [0], [_G0], versions=[1])  # version gap 0, clock gap 3 - 0
    _send(core, pb.PUSH, 0, 0, [0], [_G0], versions=[0])  # version gap 2 - 0
    _send(core, pb.PUSH, 0, 1, [0], [_G0], versions=[0])  # version gap 3 - 0
    assert core.slots[0].version == 4
    assert sample("bitps_staleness_version_gap_updates_count") == 4
    assert sample("bitps_staleness_version_gap_updates_sum") == 5
    assert core.metrics.registry.get_sample_value(
        "bitps_staleness_version_gap_updates_bucket", {"le": "0.0"}) == 2
    assert sample("bitps_staleness_clock_gap_steps_count") == 4
    assert sample("bitps_staleness_clock_gap_steps_sum") == 3
    assert sample("bitps_updates_applied_total") == 4


def test_staleness_damping_scales_lr_by_version_gap():
    core, _ = _core(world=1, ranks=(0,), staleness_damping=True)
    for _ in range(3):
        _send(core, pb.PUSH, 0, 0, [1], [_G1], versions=[0])
    # versions gap 0, 1, 2: lr, lr/2, lr/3 ...
    g4 = _grad(4, 1)
    before = core.slots[1].param.copy()
    _send(core, pb.PUSH, 0, 0, [1], [g4], versions=[0])  # gap 3: lr / 4 = 1/16, exact
    assert np.array_equal(core.slots[1].param, before - np.float32(LR / 4) * g4)


# -- sync ---------------------------------------------------------------------------------------

def test_sync_applies_mean_gradient_once_every_worker_pushed():
    core, _ = _core("sync")
    keys = [0, 1, 2]
    g0 = [_grad(10, k) for k in keys]
    g1 = [_grad(11, k) for k in keys]
    assert _send(core, pb.PUSH_PULL, 0, 0, keys, g0, request_id=1) == []
    assert len(core.held) == 1 and core.updates_applied == 0
    assert all(np.array_equal(core.slots[k].param, INIT[k]) for k in keys)
    assert "lacks pushes from workers [1]" in core.held_reasons()[0]

    replies = _send(core, pb.PUSH_PULL, 1, 0, keys, g1, request_id=2)
    assert sorted((r.ident, r.header.request_id) for r in replies) == [(b"w0", 1), (b"w1", 2)]
    expect = [INIT[k] - LR * ((a + b) * np.float32(0.5)) for k, a, b in zip(keys, g0, g1)]
    for r in replies:
        assert r.header.op == pb.REPLY and r.header.clock == 1
        assert list(r.header.versions) == [1, 1, 1]
        for got, want in zip(_arrays(r), expect):
            assert np.array_equal(got, want)
    assert core.updates_applied == 3 and core.held == []
    assert [core.slots[k].version for k in keys] == [1, 1, 1]


@pytest.mark.parametrize("codec", ["raw", "bf16"])
def test_sync_adds_pushes_in_rank_order_whatever_order_they_arrive_in(codec):
    """Float addition does not associate: three pushes summed as they arrive would give a step
    that depends on timing (a sync overlap run differing from an overlap-off one). The shard
    adds them in rank order, also when a later push overwrites the reused decode buffer."""
    rng = np.random.default_rng(5)
    grads = [(rng.standard_normal(KEYS[2]) * 10.0 ** rng.integers(-4, 4, KEYS[2]))
             .astype(np.float32) for _ in range(3)]
    frames = [g.tobytes() for g in grads]
    fields = {}
    if codec == "bf16":
        c = Codec.from_config(CodecConfig(name="bf16"))
        frames = [bytes(Compressor(c, KEYS[2]).encode(g)) for g in grads]
        fields = dict(zip(("codec", "codec_chunk", "codec_flags"), c.wire_fields()))
    results = []
    for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0)):
        core, _ = _core("sync", world=3, ranks=(0, 1, 2))
        for w in order:
            _send(core, pb.PUSH, w, 0, [2], [frames[w]], **fields)
        assert core.slots[2].version == 1
        results.append(core.slots[2].param.copy())
    assert all(np.array_equal(r, results[0]) for r in results)
    # the trap is real: summed in arrival order these pushes give other bits
    assert not np.array_equal((grads[2] + grads[1]) + grads[0], (grads[0] + grads[1]) + grads[2])


@pytest.mark.parametrize(("mode", "world", "holds"),
                         [("sync", 1, False), ("sync", 2, True), ("ssp", 2, False),
                          ("async", 2, False)])
def test_registration_says_whether_pulls_wait_for_other_workers_pushes(mode, world, holds):
    """Workers push and pull apart (credit for pushes only) exactly when a pull can wait for
    another worker's push of the same keys: sync with more than one worker."""
    core = ShardCore(ServerConfig(mode=mode, optimizer=SGD))
    assert core.register(_reg(0, world), _values()).holds_pulls == holds


def test_sync_rejects_wrong_clock_and_duplicate_push():
    core, _ = _core("sync")
    (reply,) = _send(core, pb.PUSH, 0, 1, [0], [_G0])
    assert reply.header.error == pb.BAD_CLOCK
    assert "clock 1" in reply.header.message and "aggregating clock 0" in reply.header.message

    a, dup, b = _grad(20, 0), _grad(21, 0), _grad(22, 0)
    (ack,) = _send(core, pb.PUSH, 0, 0, [0], [a])
    assert ack.header.op == pb.REPLY
    before = _state(core)
    (reply,) = _send(core, pb.PUSH, 0, 0, [0], [dup])
    assert reply.header.error == pb.BAD_CLOCK
    assert "worker 0" in reply.header.message
    assert "already has this worker's push" in reply.header.message
    _assert_unchanged(before, _state(core))

    _send(core, pb.PUSH, 1, 0, [0], [b])
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * ((a + b) * np.float32(0.5)))
    (reply,) = _send(core, pb.PUSH, 1, 0, [0], [b])  # step 0 is done: now a stale clock
    assert reply.header.error == pb.BAD_CLOCK and "aggregating clock 1" in reply.header.message


def test_sync_dead_worker_is_dropped_and_aggregate_applied():
    core, t = _core("sync", heartbeat_timeout_s=10.0)
    t[0] = 6.0
    g = [_grad(30, k) for k in (0, 2)]
    assert _send(core, pb.PUSH_PULL, 0, 0, [0, 2], g, request_id=9) == []
    t[0] = 9.0
    assert core.tick() == []  # worker 1 is silent but not yet timed out
    assert core.slots[0].version == 0
    t[0] = 10.5  # worker 1 silent 10.5 s; worker 0 heartbeats (the shard still hears it)
    core.clocks.seen(0)
    (reply,) = core.tick()
    assert core.clocks.live() == [0]
    assert reply.ident == b"w0" and reply.header.request_id == 9 and reply.header.op == pb.REPLY
    assert list(reply.header.versions) == [1, 1]
    for k, got, gk in zip((0, 2), _arrays(reply), g):
        assert np.array_equal(got, INIT[k] - LR * gk)
        assert np.array_equal(core.slots[k].param, got)
    assert core.slots[1].version == 0 and core.held == []
    assert core.admissions[-1].waited_s == 4.5


@pytest.mark.parametrize("heard_by", ["pull", "heartbeat", None])
def test_sync_worker_skipped_while_dropped_is_named_the_step_at_re_registration(heard_by):
    """Worker 1 is dropped and worker 0 goes on alone to version 3. A dropped worker heard from
    again (a pull sent apart from its push, as with overlap on; a heartbeat) is live at its old
    clock; its re-registration is still named the step its keys are at (``step``, and
    ``start_clock`` there), where before only a worker still dropped was: it kept clock 1 and
    its pushes at clock 1 were refused (BAD_CLOCK) until ShardLostError."""
    core, t = _core("sync", heartbeat_timeout_s=10.0)
    for clock in (0, 1, 2):  # worker 1 pushed step 0 only, then fell silent
        g = [_grad(40 + clock, k) for k in KEYS]
        if clock == 0:
            _send(core, pb.PUSH, 1, 0, list(KEYS), g)
        else:
            t[0] = 11.0 * clock
            core.clocks.seen(0)
            core.tick()
        _send(core, pb.PUSH_PULL, 0, clock, list(KEYS), g)
    assert core.clocks.live() == [0] and {s.version for s in core.slots.values()} == {3}
    if heard_by == "pull":
        _send(core, pb.PULL, 1, 1, list(KEYS))
    elif heard_by == "heartbeat":
        core.clocks.seen(1)
    assert core.clocks.is_dropped(1) == (heard_by is None)
    reply = core.register(_reg(1, 2), {})
    assert (reply.step, reply.start_clock) == (3, 3)
    assert _send(core, pb.PUSH, 1, 3, list(KEYS), [_grad(50, k) for k in KEYS])[-1] \
        .header.op == pb.REPLY


def test_sync_worker_never_dropped_is_not_named_a_step_at_re_registration():
    """A worker whose push of clock 0 completed the step (version 1) but which has not pulled
    yet (with overlap on its pull travels apart) is at clock 0 in the table, behind its keys:
    re-registering (a lost reply, say) it is named no step (it was not dropped) and the start
    its keys hold its pushes to (1: a sync step completes only with its push). A worker still
    at clock 0 (the reply lost) then loses no step and keeps its clock, so its redo of that
    push is answered from the exactly-once window instead of being taken as the next step's;
    one that moved on to clock 1 is not told it lost its push of 0."""
    core, t = _core("sync", heartbeat_timeout_s=10.0)
    for w in (0, 1):
        _send(core, pb.PUSH, w, 0, list(KEYS), [_grad(60 + w, k) for k in KEYS])
    assert {s.version for s in core.slots.values()} == {1}
    reply = core.register(_reg(1, 2), {})
    assert (reply.step, reply.start_clock) == (0, 1)
    assert core.clocks.workers[1].clock == 0  # the table keeps its last pull's clock


def test_sync_worker_leaving_completes_pending_aggregate():
    from bitps.ps.control import ControlServicer

    core, t = _core("sync")
    assert _send(core, pb.PUSH_PULL, 0, 0, [0], [_G0]) == []
    ControlServicer(core, data_port=0, metrics_port=0).Leave(pb.LeaveRequest(rank=1), None)
    assert core.clocks.live() == [0]
    t[0] = 1.0
    replies = core.tick()
    assert [r.header.op for r in replies] == [pb.REPLY]
    assert np.array_equal(_arrays(replies[0])[0], INIT[0] - LR * _G0)


# -- ssp ----------------------------------------------------------------------------------------

def test_ssp_holds_a_worker_more_than_s_ahead():
    core, t = _core("ssp", staleness=1)
    for w in (0, 1):
        (r,) = _send(core, pb.PULL, w, 0, [0])
        assert r.header.op == pb.REPLY
    (r,) = _send(core, pb.PUSH_PULL, 0, 0, [0], [_G0])  # pull for clock 1: 1 - 0 <= S
    assert r.header.op == pb.REPLY and r.header.clock == 1
    assert _send(core, pb.PUSH_PULL, 0, 1, [0], [_G0], request_id=42) == []  # clock 2: held
    assert core.slots[0].version == 2  # the push part is applied; only the pull is held
    assert "worker 1 at 0" in core.held_reasons()[0]
    t[0] = 1.5
    assert core.tick() == [] and len(core.held) == 1
    assert _send(core, pb.PULL, 0, 2, [1], request_id=43) == []  # a second held pull
    t[0] = 2.5
    # Worker 1 advances; the data loop ticks after every batch of messages, releasing held pulls.
    replies = _send(core, pb.PUSH_PULL, 1, 0, [0], [_G0]) + core.tick()
    assert sorted((r.ident, r.header.request_id) for r in replies)[:2] == [(b"w0", 42),
                                                                             (b"w0", 43)]
    assert len(replies) == 3 and all(r.header.op == pb.REPLY for r in replies)
    assert core.held == []
    held = [a for a in core.admissions if a.worker == 0 and a.clock == 2]
    assert sorted(a.waited_s for a in held) == [1.0, 2.5]
    assert all(a.clock - a.min_clock <= 1 for a in core.admissions)
    assert len(core.admissions) == 6


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_ssp_admissions_never_exceed_the_bound(staleness):
    core, t = _core("ssp", world=3, ranks=(0, 1, 2), staleness=staleness)
    rng = np.random.default_rng(staleness)
    clocks = [0, 0, 0]
    waiting = set()
    for _ in range(200):
        t[0] += 0.01
        w = int(rng.integers(3))
        if w in waiting:  # a worker blocks on its held pull
            continue
        replies = _send(core, pb.PUSH_PULL, w, clocks[w], [0], [_G0 * 0.01])
        if not replies:
            waiting.add(w)
        clocks[w] += 1
        for r in replies + core.tick():
            waiting.discard(r.header.worker)
            assert r.header.op == pb.REPLY
    assert all(a.clock - a.min_clock <= staleness for a in core.admissions)
    assert max(clocks) - min(clocks) <= staleness + 1
    assert any(a.waited_s > 0 for a in core.admissions)
    assert core.updates_applied == sum(clocks)


# -- deadlines ----------------------------------------------------------------------------------

def test_held_pull_past_deadline_gets_deadline_error():
    core, t = _core("ssp", staleness=1, pull_deadline_s=0.5)
    _send(core, pb.PULL, 1, 0, [0])
    assert _send(core, pb.PULL, 0, 3, [0, 1], request_id=11) == []
    assert _send(core, pb.PULL, 0, 3, [1], request_id=12, deadline_s=2.0) == []
    t[0] = 0.4
    assert core.tick() == []
    t[0] = 0.6
    (reply,) = core.tick()
    h = reply.header
    assert (h.op, h.error, h.request_id, h.worker) == (pb.ERROR, pb.DEADLINE, 11, 0)
    for word in ("worker 0", "clock 3", "keys [0, 1]", "clock >= 2", "worker 1 at 0"):
        assert word in h.message, h.message
    assert len(core.held) == 1  # the request's own deadline_s overrides the shard default
    t[0] = 2.0
    (reply,) = core.tick()
    assert reply.header.request_id == 12 and reply.header.error == pb.DEADLINE
    assert core.held == [] and _error_count(core, pb.DEADLINE) == 2
    assert core.slots[0].version == 0


def test_sync_held_pull_deadline_names_missing_worker():
    core, t = _core("sync", pull_deadline_s=1.0)
    assert _send(core, pb.PUSH_PULL, 1, 0, [2], [_G2]) == []
    t[0] = 1.0
    (reply,) = core.tick()
    assert reply.header.error == pb.DEADLINE and reply.ident == b"w1"
    assert "worker 1 pull for clock 1" in reply.header.message
    assert "lacks pushes from workers [0]" in reply.header.message
