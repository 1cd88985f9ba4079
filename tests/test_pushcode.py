"""A push that reaches the update rule as its code (``ps.pushcode``): the shard ends bit for bit
as one that decodes every push into the key's scratch array first (the path before), through
``ShardCore.handle``, in every mode that takes codes, checkpoints included."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.native import sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.wire import PROTOCOL
from bitps.ps import OptimizerConfig, ServerConfig
from bitps.ps.checkpoint import load, restore, save
from bitps.ps.onebit import OneBitConfig
from bitps.ps.pushcode import PushCode, PushCodes
from bitps.ps.shard import ShardCore


def _core(mode: str, moments: str, lengths: tuple[int, ...], *, world: int = 1,
          compensation: str = "none", rule: str = "onebit_adam", pull_codes: bool = True):
    """A ShardCore of ``rule`` (1-bit Adam: freeze_step 1, chunk 256) over keys of
    ``lengths``, the pulls compressed or not, ``world`` ranks registered (rank 0 with seeded
    values)."""
    rule_config = OneBitConfig(freeze_step=1, chunk=256,
                               moments="auto" if mode == "sync" else moments) \
        if rule == "onebit_adam" else None
    opt = OptimizerConfig(name=rule, lr=1e-3, weight_decay=0.01, rule_config=rule_config)
    core = ShardCore(ServerConfig(mode=mode, optimizer=opt, metrics_port=-1,
                                  compensation=compensation), now=lambda: 0.0)
    rng = np.random.default_rng(7)
    specs = [pb.KeySpec(key=k, name=f"p{k}", offset=0, length=n, dtype=pb.FLOAT32,
                        compressed_pull=pull_codes) for k, n in enumerate(lengths)]
    values = {k: rng.standard_normal(n).astype(np.float32).tobytes()
              for k, n in enumerate(lengths)}
    for rank in range(world):
        core.register(pb.RegisterRequest(
            protocol=PROTOCOL, rank=rank, world_size=world, signature="s", num_shards=1,
            shard_id=0, keys=specs, sends_values=rank == 0,
            pull_codec=pb.CODEC_SIGN1 if pull_codes else pb.CODEC_RAW,
            pull_codec_chunk=256 if pull_codes else 0), values if rank == 0 else {})
    return core


def _push_codes(core, clock: int, lengths: tuple[int, ...], push_chunk: int,
                worker: int = 0) -> None:
    """``worker``'s push of ``clock``: raw gradients at clock 0 (1-bit Adam's warmup), sign1
    codes after (a zero chunk, its signs half negative, in the first key)."""
    grads = [np.random.default_rng([clock, worker, k]).standard_normal(n).astype(np.float32)
             for k, n in enumerate(lengths)]
    fields, frames = {}, [g.tobytes() for g in grads]
    if clock:
        fields = dict(codec=pb.CODEC_SIGN1, codec_chunk=push_chunk)
        frames = []
        grads[0][:push_chunk] = 0
        for g in grads:
            out = np.empty(sign1.payload_bytes(g.size, push_chunk), np.uint8)
            frames.append(out[:sign1.encode(g, np.zeros_like(g), out, chunk=push_chunk)])
        frames[0][4 * -(-lengths[0] // push_chunk):][:push_chunk // 8] = 0xAA
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=worker, clock=clock,
                           request_id=100 * clock + worker + 1, incarnation=5 + worker,
                           keys=range(len(lengths)), dtype=pb.FLOAT32, **fields)
    (reply,) = core.handle(f"w{worker}".encode(), [header.SerializeToString(), *frames])
    assert reply.header.op == pb.REPLY, reply.header.message


def _same_keys(a, b) -> None:
    """Two cores' keys hold the same bits: parameters, versions, Adam's moments, and the
    published codes and their residuals where pulls are compressed."""
    for x, y in zip(a.slots.values(), b.slots.values()):
        assert x.version == y.version
        pairs = [(x.param, y.param), (x.rule_state.buf1, y.rule_state.buf1),
                 (x.rule_state.buf2, y.rule_state.buf2)]
        if x.publisher is not None:
            pairs.append((x.publisher.server.residual, y.publisher.server.residual))
            assert [bytes(p) for _, p in x.publisher.history] == \
                [bytes(p) for _, p in y.publisher.history]
        for u, v in pairs:
            assert np.array_equal(u.view(np.uint32), v.view(np.uint32))


RUNS = [("onebit_adam", mode, moments, True) for mode, moments in
        (("async", "worker"), ("ssp", "worker"), ("async", "shard"), ("sync", "auto"))]
RUNS += [(rule, mode, "auto", pulls) for rule in ("adam", "adamw") for mode in ("async", "sync")
         for pulls in (False, True)]


@pytest.mark.parametrize("rule,mode,moments,pull_codes", RUNS)
@pytest.mark.parametrize("push_chunk", (256, 64))
def test_a_compressed_push_reaches_the_update_kernel_as_its_code(rule, mode, moments,
                                                                  pull_codes, push_chunk):
    """1-bit Adam's compressed pushes, and Adam's (AdamW's) sign1 pushes, reach the update
    kernel as they came, never written to the key-long scratch array: the shard ends bit for
    bit as one that decodes every push first: parameters, m and v, and the published codes
    and their residuals (compressed pulls), or the lookahead's last update (async, raw pulls).
    dc_asgd reads the pushed values: its pushes are decoded."""
    lengths = (3001, 256, 70)
    cores = [_core(mode, moments, lengths, rule=rule, pull_codes=pull_codes)
             for _ in range(2)]
    cores[1].keeps_code = lambda codec: False  # the decoded path
    for clock in range(4):
        for core in cores:
            _push_codes(core, clock, lengths, push_chunk)
            if clock == 0:  # the warmup decoded into the scratch arrays: mark them
                for slot in core.slots.values():
                    slot.decode_buffer().fill(np.nan)
    assert all(s.version == 4 for s in cores[0].slots.values())
    _same_keys(*cores)
    for a, b in zip(cores[0].slots.values(), cores[1].slots.values()):
        assert np.isnan(a.decoded).all() and not np.isnan(b.decoded).any()
        if a.previous is not None:
            assert np.array_equal(a.last_delta.view(np.uint32), b.last_delta.view(np.uint32))
    dc = _core(mode, moments, lengths, compensation="dc_asgd", rule=rule)
    assert dc.keeps_code(Codec(pb.CODEC_SIGN1, 256)) == (mode == "sync")
    assert cores[0].keeps_code(Codec(pb.CODEC_SIGN1, 256))
    assert not cores[0].keeps_code(Codec(pb.CODEC_BF16))


def test_a_sync_step_of_pushed_codes_sums_and_checkpoints_as_decoded_ones(tmp_path):
    """sync 1-bit Adam, three workers pushing codes in the order 2, 0, 1 (rank 2's kept aside
    as a code, rank 0's the step's first, rank 1's joining it, then rank 2's: the step's codes,
    summed in the update's kernel without a key-long sum): bit for bit the shard that decodes
    each push first and sums them in the key's store, also after a checkpoint taken with rank
    2's and rank 0's pushes in and restored into a fresh core (the codes decoded into the saved
    sum and held push)."""
    lengths = (3001, 256, 70)
    cores = [_core("sync", "auto", lengths, world=3) for _ in range(2)]
    cores[1].keeps_code = lambda codec: False
    for clock in range(3):
        for core in cores:
            for worker in (2, 0, 1):
                _push_codes(core, clock, lengths, 64, worker)
        if clock == 0:  # the warmup summed raw pushes in acc: mark it, and the scratch
            for slot in cores[0].slots.values():
                slot.acc.fill(np.nan)
                slot.decode_buffer().fill(np.nan)
    _same_keys(*cores)
    for slot in cores[0].slots.values():  # the codes were summed in the kernel
        assert np.isnan(slot.acc).all() and np.isnan(slot.decoded).all()
    for core in cores:
        for worker in (2, 0):
            _push_codes(core, 3, lengths, 64, worker)
    slot = next(iter(cores[0].slots.values()))
    assert isinstance(slot.first, PushCode) and isinstance(slot.held[2], PushCode)
    restored = ShardCore(cores[0].cfg, now=lambda: 0.0)
    restore(restored, load(save(cores[0], tmp_path, keep=1)))
    for core in (*cores, restored):
        _push_codes(core, 3, lengths, 64, 1)
        _push_codes(core, 4, lengths, 64, 0)
    assert all(s.version == 4 and s.pushed == {0} for s in restored.slots.values())
    _same_keys(cores[0], cores[1])
    _same_keys(cores[0], restored)
    for core in (cores[0], restored):  # rank 1's code joins rank 0's, not decoded yet
        _push_codes(core, 4, lengths, 64, 1)
        slot = next(iter(core.slots.values()))
        assert isinstance(slot.first, PushCodes) and len(slot.first.codes) == 2


def test_sync_m_stays_the_published_code_until_read(tmp_path):
    """sync 1-bit Adam's update kernel keeps m in a chunk of scratch: the key-long m is not
    written by a compressed update (a sixth of that kernel's memory traffic), and read after
    it (a checkpoint, a worker's fetch, a test) it is the decode of the code the update
    published, which is what every replica applied; the same after a checkpoint's restore."""
    lengths = (3001, 256, 70)
    core = _core("sync", "auto", lengths, world=2)
    for clock in range(3):
        for worker in (0, 1):
            _push_codes(core, clock, lengths, 64, worker)
        if clock == 1:  # the first compressed update is in: m's storage marked
            stores = {k: s.rule_state.buf1 for k, s in core.slots.items()}
            for m in stores.values():
                m.fill(np.nan)
    for key, slot in core.slots.items():
        ob = slot.rule_state
        assert np.isnan(stores[key]).all()  # the update of clock 2 did not write it
        want = np.zeros(slot.length, np.float32)
        ob.codec.decode_add(ob.m_code, slot.length, want)
        assert ob.m_code == ob.pub.history[-1][1] and np.any(want)
        assert np.array_equal(ob.buf1.view(np.uint32), want.view(np.uint32))
        assert ob.buf1 is stores[key]  # decoded into the same array, once
    restored = ShardCore(core.cfg, now=lambda: 0.0)
    restore(restored, load(save(core, tmp_path, keep=1)))
    _same_keys(core, restored)
    for c in (core, restored):
        for worker in (0, 1):
            _push_codes(c, 3, lengths, 64, worker)
    _same_keys(core, restored)
