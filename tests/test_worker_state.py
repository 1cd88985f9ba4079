"""The worker's checkpointed state speaks one protocol: ``Encoder``, ``PSModel`` and ``LocalSGD``
offer ``state_dict()`` / ``load_state_dict()`` with a versioned layout (docs/checkpoints.md), and
what one saves another restores exactly; a state that does not fit is refused whole."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bitps.proto.codecs import CodecConfig
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient
from bitps.worker.algorithms.local_sgd import LocalSGD
from bitps.worker.config import EncoderConfig, OverlapConfig
from bitps.worker.training.model import PSModel

SIGN1 = EncoderConfig(push_codec=CodecConfig(name="sign1", chunk=64), compress_min_bytes=1024,
                      clip_norm=0.5)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(ps_model: PSModel, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(8, 32, generator=gen)
        (ps_model.model(x).square().sum() * (0.1, 3.0)[step % 2]).backward()
        ps_model.step()
    ps_model.synchronize()


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_psmodel_state_round_trips_and_a_state_that_does_not_fit_is_refused_whole(cluster, overlap):
    (shard,) = cluster(1, mode="async", metrics_port=-1, optimizer=OptimizerConfig(name="sgd",
                                                                                    lr=0.1))
    cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",), partition_bytes=1024)
    ps_model = PSModel(_model(), PSClient(cfg), encoder=SIGN1,
                       overlap=OverlapConfig(mode=overlap, bucket_bytes=2048))
    try:
        _train(ps_model, 5)
        state = ps_model.state_dict()
        assert state["version"] == 1 and state["clock"] == 5
        assert state["encoder"]["residuals"] and any(np.any(r) for r in
                                                     state["encoder"]["residuals"].values())
        assert 0 < state["clip_factor"] <= 1
        saved = copy.deepcopy(state)
        _train(ps_model, 2, seed=7)  # the state moves on
        assert not _equal(ps_model.state_dict()["encoder"], saved["encoder"])
        ps_model.load_state_dict(saved)
        back = ps_model.state_dict()
        assert _equal(back["encoder"], saved["encoder"])
        assert back["clip_factor"] == saved["clip_factor"]
        with pytest.raises(ValueError, match="version 9; expected 1"):
            ps_model.load_state_dict(dict(saved, version=9))
        bad = copy.deepcopy(saved)
        key = next(iter(bad["encoder"]["residuals"]))
        bad["encoder"]["residuals"][key] = bad["encoder"]["residuals"][key][:3]
        with pytest.raises(ValueError, match=f"residual of key {key} is float32"):
            ps_model.load_state_dict(bad)
        assert _equal(ps_model.state_dict()["encoder"], saved["encoder"])  # nothing loaded
    finally:
        ps_model.close()


def test_local_sgd_saves_its_encoders_error_feedback(cluster):
    (shard,) = cluster(1, mode="sync", metrics_port=-1, optimizer=OptimizerConfig(
        name="momentum", lr=0.7, momentum=0.9, nesterov=True))
    cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",), partition_bytes=1024)
    model = _model()
    local = LocalSGD(model, PSClient(cfg), torch.optim.AdamW(model.parameters(), lr=1e-2),
                     inner_steps=2, encoder=SIGN1)
    try:
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            model(torch.randn(8, 32, generator=gen)).square().sum().backward()
            local.step()
        state = local.state_dict()
        assert state["version"] == 1 and state["clock"] == 2
        residuals = state["encoder"]["residuals"]
        assert residuals and any(np.any(r) for r in residuals.values())
        zeroed = copy.deepcopy(state)
        for r in zeroed["encoder"]["residuals"].values():
            r[:] = 0
        local.load_state_dict(zeroed)
        assert not any(np.any(r) for r in local.state_dict()["encoder"]["residuals"].values())
        local.load_state_dict(state)
        assert _equal(local.state_dict()["encoder"], state["encoder"])
    finally:
        local.close()
