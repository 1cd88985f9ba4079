"""A push's own learning rate and weight decay (``DataHeader.lr`` / ``weight_decay``, sent by
``bitps.Optimizer`` from its param groups) on a shard, called directly: they replace the shard's
``lr`` x schedule and ``weight_decay``; async still splits the lr over the pushers; sync refuses
a rank whose values differ from the step's; rules whose lr is not the shard's alone refuse
them. (The bad-value cases are in ``test_shard_core.BAD``.)"""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.schedule import LRSchedule
from bitps.ps.config import OptimizerConfig
from bitps.ps.onebit import OneBitConfig
from tests.test_shard_core import INIT, _assert_unchanged, _core, _grad, _send, _state

# The shard's own lr and a warm-up schedule: a push carrying its lr must not see either.
SHARD_SGD = OptimizerConfig(name="sgd", lr=0.125, weight_decay=0.5,
                            schedule=LRSchedule(warmup_steps=4))


def _push(core, worker, clock, keys, *, lr=None, wd=None, op=pb.PUSH, seed=1):
    fields = {} if lr is None else {"lr": [lr] * len(keys), "weight_decay": [wd] * len(keys)}
    return _send(core, op, worker, clock, keys, [_grad(seed + worker, k) for k in keys],
                 **fields)


def test_sync_step_uses_the_pushes_lr_and_weight_decay():
    core, _ = _core("sync", optimizer=SHARD_SGD)
    for worker in (0, 1):
        (ack,) = _push(core, worker, 0, [0, 1], lr=0.5, wd=0.25)
        assert ack.header.op == pb.REPLY, ack.header.message
    for k in (0, 1):
        g = (_grad(1, k) + _grad(2, k)) * np.float32(0.5)
        # SGD with L2 decay: p - lr * (g + wd * p), all in exact float32 here
        want = INIT[k] - np.float32(0.5) * (g + np.float32(0.25) * INIT[k])
        assert np.array_equal(core.slots[k].param, want), k
    # the next step without values is the shard's again: its lr x schedule (warm-up 2/4)
    for worker in (0, 1):
        _push(core, worker, 1, [0])
    g = (_grad(1, 0) + _grad(2, 0)) * np.float32(0.5)
    before = INIT[0] - np.float32(0.5) * ((_grad(1, 0) + _grad(2, 0)) * np.float32(0.5)
                                          + np.float32(0.25) * INIT[0])
    want = before - np.float32(0.125 * 2 / 4) * (g + np.float32(0.5) * before)
    assert np.allclose(core.slots[0].param, want, rtol=0, atol=1e-6)


def test_sync_refuses_a_rank_whose_lr_differs_and_changes_nothing():
    core, _ = _core("sync", optimizer=SHARD_SGD)
    _push(core, 0, 0, [0, 1], lr=0.5, wd=0.0)
    before = _state(core)
    for lr, wd in ((0.25, 0.0), (0.5, 0.125), (None, None)):
        (err,) = _push(core, 1, 0, [0, 1], lr=lr, wd=wd)
        assert err.header.op == pb.ERROR and err.header.error == pb.BAD_HYPERPARAMETERS
        assert "key 0" in err.header.message and "workers [0]" in err.header.message
        assert "(0.5, 0.0)" in err.header.message, err.header.message
        _assert_unchanged(before, _state(core))
    (ack,) = _push(core, 1, 0, [0, 1], lr=0.5, wd=0.0)  # the agreeing push still goes in
    assert ack.header.op == pb.REPLY and core.slots[0].version == 1


def test_async_push_lr_is_split_over_the_pushers():
    core, _ = _core("async", optimizer=SHARD_SGD)
    _push(core, 0, 0, [2], lr=0.5, wd=0.0)
    # two live pushers: each push gets half the step's lr (ServerConfig.split_lr)
    want = INIT[2] - np.float32(0.25) * _grad(1, 2)
    assert np.array_equal(core.slots[2].param, want)


@pytest.mark.parametrize("optimizer", [
    OptimizerConfig(name="onebit_adam", rule_config=OneBitConfig(freeze_step=3)),
    OptimizerConfig(name="nesterov", lr=0.5),
], ids=["onebit_adam", "nesterov"])
def test_rules_whose_lr_is_not_the_shards_alone_refuse_pushed_values(optimizer):
    core, _ = _core("sync", optimizer=optimizer)
    before = _state(core)
    (err,) = _push(core, 0, 0, [0], lr=0.5, wd=0.0)
    assert err.header.error == pb.BAD_HYPERPARAMETERS
    assert f"update rule {optimizer.name} takes none" in err.header.message
    _assert_unchanged(before, _state(core))
