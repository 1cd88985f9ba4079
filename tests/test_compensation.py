"""Staleness compensation (``ps.compensation``): each method's arithmetic against plain numpy,
its selection by config, and sync training unchanged bit for bit with each one on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import CodecConfig
from bitps.ps import OptimizerConfig, ServerConfig
from bitps.ps.compensation import (
    Damping,
    DelayCompensation,
    GapAware,
    NoCompensation,
    make_compensation,
)
from bitps.ps.store import Slot
from bitps.worker.config import EncoderConfig
from tests.helpers import train_two_workers

METHODS = ["none", "damping", "gap_aware", "dc_asgd"]


def test_config_names_the_method_and_refuses_unknown_or_contradictory_ones():
    assert isinstance(make_compensation(ServerConfig()), NoCompensation)
    assert isinstance(make_compensation(ServerConfig(compensation="gap_aware")), GapAware)
    assert isinstance(make_compensation(ServerConfig(staleness_damping=True)), Damping)
    with pytest.raises(ValueError, match="compensation 'nope' is not one of"):
        ServerConfig(compensation="nope")
    with pytest.raises(ValueError, match="staleness_damping is compensation 'damping'"):
        ServerConfig(staleness_damping=True, compensation="dc_asgd")
    with pytest.raises(ValueError, match="dc_lambda must be >= 0"):
        ServerConfig(dc_lambda=-1.0)


@pytest.mark.parametrize("gap, pushers", [(0, 2), (1, 2), (3, 2), (2, 4), (7, 4), (5, 1)])
def test_damping_and_gap_aware_scale_the_learning_rate_by_their_formulas(gap, pushers):
    cfg = ServerConfig()
    assert Damping(cfg).lr_scale(version_gap=gap, pushers=pushers) == 1 / (1 + gap)
    expected = max(pushers - 1, 1)
    assert GapAware(cfg).lr_scale(version_gap=gap, pushers=pushers) == \
        1 / max(1.0, gap / expected)
    assert NoCompensation(cfg).lr_scale(version_gap=gap, pushers=pushers) == 1.0


def _slot(values: np.ndarray) -> Slot:
    slot = Slot.zeros(pb.KeySpec(key=3, name="w", offset=0, length=values.size))
    slot.param[:] = values
    return slot


def test_dc_asgd_matches_a_numpy_reference_over_several_pushes():
    rng = np.random.default_rng(0)
    n, lam, m, eps = 257, 0.04, np.float32(0.95), np.float32(1e-7)
    comp = DelayCompensation(ServerConfig(compensation="dc_asgd", dc_lambda=lam))
    slot = _slot(rng.standard_normal(n).astype(np.float32))
    ms = np.zeros(n, np.float32)
    g0 = rng.standard_normal(n).astype(np.float32)
    # before any pull of the worker: the gradient as it came (the mean square still moves)
    assert comp.gradient(slot, g0, worker=0) is g0
    ms = m * ms + (np.float32(1) - m) * g0 * g0
    for _ in range(3):
        read = slot.param.copy()
        comp.handed(slot, 0, read)
        slot.param[:] += rng.standard_normal(n).astype(np.float32) * 0.1  # others' updates
        g = rng.standard_normal(n).astype(np.float32)
        ms = m * ms + (np.float32(1) - m) * g * g
        want = g + (((slot.param - read) * g) * g) * (np.float32(lam) / np.sqrt(ms + eps))
        got = comp.gradient(slot, g, worker=0)
        np.testing.assert_array_equal(got, want.astype(np.float32))
    # another worker has no read copy yet: its gradient is not corrected
    g = rng.standard_normal(n).astype(np.float32)
    assert comp.gradient(slot, g, worker=1) is g


SIGN1 = EncoderConfig(push_codec=CodecConfig(name="sign1", chunk=64), compress_min_bytes=0)
RAW = EncoderConfig()


@pytest.mark.parametrize("method", METHODS[1:])
def test_sync_training_is_unchanged_bit_for_bit_with_each_compensation(cluster, method):
    finals = []
    for compensation in ("none", method):
        shards = cluster(2, mode="sync", compensation=compensation, metrics_port=-1,
                         optimizer=OptimizerConfig(name="adam", lr=1e-2))
        servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
        out = train_two_workers(servers, encoder=RAW, steps=6)
        finals.append(torch.cat([p.reshape(-1) for p in out[0][2]]))
        for s in shards:
            s.stop(0)
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize("encoder", [RAW, SIGN1], ids=["raw", "sign1"])
def test_async_dc_asgd_keeps_what_each_worker_read_and_replicas_stay_exact(cluster, encoder):
    shards = cluster(1, mode="async", compensation="dc_asgd", metrics_port=-1,
                     optimizer=OptimizerConfig(name="adam", lr=1e-2))
    servers = (f"127.0.0.1:{shards[0].ports['grpc_port']}",)
    out = train_two_workers(servers, encoder=encoder, steps=8)
    comp = shards[0].core.consistency.compensation
    assert isinstance(comp, DelayCompensation)
    assert {w for w, _ in comp._read} == {0, 1}
    if encoder is SIGN1:  # exact pulls: the copies are the shard's, bit for bit
        for r in (0, 1):
            for key, copy in out[r][1].items():
                assert np.array_equal(copy, shards[0].core.slots[key].param)


def _async_core(lr_by: str, mode: str = "async"):
    """A shard (sgd, lr 1, cosine over 10 clocks to 0.1) with two registered workers and one
    key of 4 zeros."""
    import time

    from bitps.proto.schedule import LRSchedule
    from bitps.proto.wire import PROTOCOL
    from bitps.ps.shard import ShardCore

    opt = OptimizerConfig(name="sgd", lr=1.0, schedule=LRSchedule(decay_steps=10,
                                                                  min_ratio=0.1))
    core = ShardCore(ServerConfig(mode=mode, lr_by=lr_by, lookahead=False, optimizer=opt),
                     now=time.monotonic)
    spec = pb.KeySpec(key=0, name="w", offset=0, length=4, dtype=pb.FLOAT32)
    for rank in range(2):
        core.register(pb.RegisterRequest(
            protocol=PROTOCOL, rank=rank, world_size=2, signature="lr_by", num_shards=1,
            shard_id=0, keys=[spec], sends_values=rank == 0),
            {0: np.zeros(4, np.float32).tobytes()} if rank == 0 else {})
    return core


def _push(core, worker: int, clock: int) -> None:
    from bitps.proto.wire import PROTOCOL

    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=worker,
                           request_id=1000 * worker + clock + 1, clock=clock, keys=[0],
                           dtype=pb.FLOAT32, incarnation=0x51 + 2 * worker)
    replies = core.handle(f"w{worker}".encode(), [header.SerializeToString(),
                                                  np.ones(4, np.float32).tobytes()])
    assert replies[-1].header.op == pb.REPLY


@pytest.mark.parametrize("lr_by", ["clock", "progress"])
def test_lr_by_progress_reads_a_straggler_push_at_the_jobs_step(lr_by):
    """Worker 0 pushes clocks 0-3 while worker 1 is still at clock 0 (a straggler). By clock,
    worker 1's push gets the schedule's factor at 0; by progress, at the key's 4 updates over
    2 pushers = step 2, what a sync job would be at. Either way split over the 2 pushers."""
    from bitps.proto.schedule import LRSchedule

    core = _async_core(lr_by)
    sched = LRSchedule(decay_steps=10, min_ratio=0.1)
    before = []
    for clock in range(4):
        before.append(core.slots[0].param[0].copy())
        _push(core, 0, clock)
    x = core.slots[0].param[0].copy()
    _push(core, 1, 0)
    moved = float(x - core.slots[0].param[0])
    step = 0 if lr_by == "clock" else 4 // 2
    assert moved == pytest.approx(sched.factor(step) / 2, rel=1e-6)
    # worker 0's own pushes: by progress the steps 0, 0, 1, 1 (updates 0-3 over 2 pushers)
    first = [float(a - b) for a, b in zip(before, [*before[1:], x])]
    steps = [0, 1, 2, 3] if lr_by == "clock" else [0, 0, 1, 1]
    assert first == pytest.approx([sched.factor(c) / 2 for c in steps], rel=1e-6)


def test_lr_by_progress_is_refused_in_sync_and_checked():
    with pytest.raises(ValueError, match="lr_by 'progress' applies to async/ssp"):
        ServerConfig(mode="sync", lr_by="progress")
    with pytest.raises(ValueError, match="lr_by 'step'; expected one of"):
        ServerConfig(mode="async", lr_by="step")
