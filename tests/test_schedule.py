"""The learning-rate schedule (proto.schedule): its curve, its validation, and shards that
follow it exactly as torch's LambdaLR does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.schedule import LRSchedule
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.shard import ShardCore
from tests.test_shard_core import INIT, KEYS, _grad, _reg, _send, _values


def test_warmup_then_cosine_curve():
    s = LRSchedule(warmup_steps=4, decay_steps=12, min_ratio=0.1)
    assert [s.factor(c) for c in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == 1.0
    assert math.isclose(s.factor(8), 0.1 + 0.9 * 0.5)  # half way down the cosine
    assert s.factor(12) == pytest.approx(0.1) and s.factor(1000) == pytest.approx(0.1)
    assert LRSchedule().constant and LRSchedule().factor(7) == 1.0
    assert LRSchedule(warmup_steps=3).factor(100) == 1.0


@pytest.mark.parametrize("kw, match", [
    ({"warmup_steps": -1}, "warmup_steps"), ({"decay_steps": 3, "warmup_steps": 3}, "exceed"),
    ({"min_ratio": 1.5}, "min_ratio"), ({"warmup_steps": 1.5}, "warmup_steps")])
def test_bad_schedule_is_refused_with_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(**kw)


def test_server_flags_build_the_schedule():
    from bitps.ps.__main__ import parse_config

    cfg, _ = parse_config(["--lr-warmup", "5", "--lr-decay", "50", "--lr-min-ratio", "0.2"])
    assert cfg.optimizer.schedule == LRSchedule(warmup_steps=5, decay_steps=50, min_ratio=0.2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shard_follows_the_schedule_like_torch_lambda_lr(mode):
    """Two workers, 8 clocks of Adam with warm-up and decay: sync applies the mean at the step's
    factor, async each push at its own clock's factor; both equal torch's Adam + LambdaLR."""
    torch = pytest.importorskip("torch")
    schedule = LRSchedule(warmup_steps=3, decay_steps=8, min_ratio=0.1)
    opt_cfg = OptimizerConfig(name="adam", lr=0.01, schedule=schedule)
    core = ShardCore(ServerConfig(mode=mode, optimizer=opt_cfg, staleness=100))
    for r in (0, 1):
        core.register(_reg(r, 2), _values() if r == 0 else {})
    keys = sorted(KEYS)
    params = {k: torch.nn.Parameter(torch.from_numpy(INIT[k].copy())) for k in keys}
    split = 0.5 if mode == "async" else 1.0
    opt = torch.optim.Adam(list(params.values()), lr=0.01)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: schedule.factor(c) * split)
    for clock in range(8):
        grads = {w: [_grad(10 * clock + w, k) for k in keys] for w in (0, 1)}
        for w in (0, 1):
            _send(core, pb.PUSH, w, clock, keys, grads[w])
            if mode == "async":
                for k, g in zip(keys, grads[w]):
                    params[k].grad = torch.from_numpy(g.copy())
                opt.step()
                # LambdaLR counts optimizer steps; the shard counts clocks: set it per push,
                # split over the 2 workers (ServerConfig.split_lr)
                for group in opt.param_groups:
                    group["lr"] = 0.01 * schedule.factor(clock + (w == 1)) / 2
        if mode == "sync":
            for i, k in enumerate(keys):
                params[k].grad = torch.from_numpy((grads[0][i] + grads[1][i]) * np.float32(0.5))
            opt.step()
            lam.step()
    for k in keys:
        np.testing.assert_allclose(core.slots[k].param, params[k].detach().numpy(),
                                   rtol=2e-6, atol=1e-7)
