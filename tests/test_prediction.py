"""Weight prediction for exact (compressed) pulls (``worker.training.prediction``): its
arithmetic against plain numpy, which shards ask for it, that the replicas stay bit-identical to
the shards while the model computes with predicted values, and that sync is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitps import native
from bitps.proto.codecs import CodecConfig
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient
from bitps.worker.config import EncoderConfig
from bitps.worker.training.prediction import WeightPrediction
from tests.helpers import train_two_workers

SIGN1 = EncoderConfig(push_codec=CodecConfig(name="sign1", chunk=64), compress_min_bytes=0)


def _reference(x, x0, steps):
    """shown = x + steps * (x - x0), float32 operation by operation."""
    x, x0 = x.astype(np.float32), x0.astype(np.float32)
    return (x + np.float32(steps) * (x - x0)).astype(np.float32)


def test_extrapolate_matches_numpy_and_makes_the_exact_copy_the_next_previous():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1001).astype(np.float32)
    x0 = rng.standard_normal(1001).astype(np.float32)
    want = _reference(x, x0, 1.5)
    shown, previous = np.empty_like(x), x0.copy()
    native.extrapolate(x, previous, shown, np.float32(1.5))
    assert np.array_equal(shown, want)
    assert np.array_equal(previous, x)


def test_prediction_moves_ahead_by_the_mean_update_since_the_last_pull():
    x = {1: np.zeros(8, np.float32), 2: np.zeros(4, np.float32)}
    shown = {1: np.full(8, 9, np.float32), 2: np.full(4, 9, np.float32)}
    versions = {1: 3, 2: 3}
    p = WeightPrediction(x, shown, ahead={1: 3, 2: 0}, versions=versions)
    p.update([1, 2])  # no earlier copy: shown exact
    assert np.array_equal(shown[1], x[1]) and np.array_equal(shown[2], x[2])
    before = x[1].copy()
    x[1] += np.arange(8, dtype=np.float32)  # two updates arrived
    x[2] += 1
    versions.update({1: 5, 2: 5})
    p.update([1, 2])
    assert np.array_equal(shown[1], _reference(x[1], before, 3 / 2))
    assert np.array_equal(shown[2], x[2])  # lookahead 0: the shard moves it itself
    held = shown[1].copy()
    p.update([1])  # nothing arrived: the prediction stands
    assert np.array_equal(shown[1], held)
    versions[1] = 2  # a shard restored from an older checkpoint: shown exact
    x[1] -= 5
    p.update([1])
    assert np.array_equal(shown[1], x[1])
    with pytest.raises(ValueError, match="lookahead"):
        WeightPrediction(x, shown, ahead={1: -1, 2: 0}, versions=versions)
    with pytest.raises(ValueError, match="lack"):
        WeightPrediction(x, {1: shown[1]}, ahead={1: 1, 2: 1}, versions=versions)


@pytest.mark.parametrize("mode, pull_codec, lookahead, asked", [
    ("async", "sign1", True, True), ("ssp", "sign1", True, True),
    ("async", "sign1", False, False), ("async", "raw", True, False),
    ("sync", "sign1", True, False)])
def test_shards_ask_for_prediction_only_when_their_pulls_are_exact_and_they_look_ahead(
        cluster, mode, pull_codec, lookahead, asked):
    (shard,) = cluster(1, mode=mode, staleness=1, lookahead=lookahead, metrics_port=-1,
                       optimizer=OptimizerConfig(name="sgd", lr=0.1))
    cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",), world_size=2)
    encoder = EncoderConfig(push_codec=CodecConfig(name="sign1"), compress_min_bytes=0,
                            pull_codec=CodecConfig(name=pull_codec))
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker.training.encoder import Encoder
    client = PSClient(cfg)
    try:
        plan = make_plan([ParamSpec("w", (64,))], num_shards=1)
        replies = Encoder(encoder, client).register(plan, {0: np.zeros(64, np.float32)})
        assert replies[0].worker_lookahead is asked
    finally:
        client.close()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_async_replicas_stay_bit_identical_while_the_model_computes_ahead(cluster, overlap):
    shards = cluster(2, mode="async", metrics_port=-1,
                     optimizer=OptimizerConfig(name="adam", lr=1e-2))
    servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
    out = train_two_workers(servers, encoder=SIGN1, overlap=overlap)
    slots = {k: s for sh in shards for k, s in sh.core.slots.items()}
    for r in (0, 1):
        shown, exact, closed, predicted = out[r]
        assert predicted
        for key, copy in exact.items():
            assert np.array_equal(copy, slots[key].param), f"rank {r} key {key}"
        flat_shown = torch.cat([p.reshape(-1) for p in shown])
        flat_closed = torch.cat([p.reshape(-1) for p in closed])
        assert not torch.equal(flat_shown, flat_closed)  # computed ahead of the copy
        # after close the model holds the exact copy
        assert np.array_equal(flat_closed.numpy(), np.concatenate(
            [exact[k] for k in sorted(exact)]))


def test_sync_is_unchanged_bit_for_bit_with_lookahead_on(cluster):
    finals = []
    for lookahead in (False, True):
        shards = cluster(2, mode="sync", lookahead=lookahead, metrics_port=-1,
                         optimizer=OptimizerConfig(name="adam", lr=1e-2))
        servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
        out = train_two_workers(servers, encoder=SIGN1, overlap="off", steps=8)
        assert not out[0][3] and not out[1][3]
        finals.append(torch.cat([p.reshape(-1) for p in out[0][2]]))
        for s in shards:
            s.stop(0)
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_gpu_checks_prediction_check_holds_on_the_cpu(cluster, overlap):
    """``bench/gpu_check.py`` runs this same function on CUDA (pinned buffers, upload)."""
    pytest.importorskip("transformers")
    from bitps.bench.gpu_check import predicted_copies_match

    shards = cluster(2, mode="async", metrics_port=-1,
                     optimizer=OptimizerConfig(name="adam", lr=1e-2))
    servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
    assert predicted_copies_match(servers, [s.core for s in shards], overlap=overlap,
                                  steps=4) == []
