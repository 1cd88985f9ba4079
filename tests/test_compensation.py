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
