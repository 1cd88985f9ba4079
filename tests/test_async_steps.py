"""Async/ssp updates that converge like sync (ServerConfig.split_lr, ServerConfig.lookahead):
a clock's pushes share one step's learning rate, and float32 pulls hand out the parameters one
update ahead per other live worker. Exact SGD arithmetic (tests.test_shard_core's values)."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.ps.__main__ import parse_config
from tests.test_shard_core import INIT, LR, _arrays, _core, _grad, _send


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_pushes_share_a_step_and_pulls_look_one_update_ahead(mode):
    core, _ = _core(mode)  # two workers
    g0, g1 = _grad(1, 0), _grad(2, 0)
    _send(core, pb.PUSH, 0, 0, [0], [g0])
    after0 = INIT[0] - LR / 2 * g0
    assert np.array_equal(core.slots[0].param, after0)  # lr split over 2 workers
    (reply,) = _send(core, pb.PULL, 1, 0, [0])
    # the other worker's push is due before this worker's lands: one update ahead
    assert np.array_equal(_arrays(reply)[0], after0 - LR / 2 * g0)
    assert np.array_equal(core.slots[0].param, after0)  # the shard's own copy is unchanged
    assert list(reply.header.versions) == [1]
    _send(core, pb.PUSH, 1, 0, [0], [g1])
    after1 = after0 - LR / 2 * g1
    assert np.array_equal(core.slots[0].param, after1)
    (reply,) = _send(core, pb.PULL, 0, 1, [0])
    assert np.array_equal(_arrays(reply)[0], after1 - LR / 2 * g1)


def test_without_them_pushes_are_whole_steps_and_pulls_exact():
    core, _ = _core("async", split_lr=False, lookahead=False)
    g0 = _grad(1, 0)
    _send(core, pb.PUSH, 0, 0, [0], [g0])
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * g0)
    (reply,) = _send(core, pb.PULL, 1, 0, [0])
    assert np.array_equal(_arrays(reply)[0], INIT[0] - LR * g0)


def test_one_worker_and_sync_pull_exact_parameters():
    core, _ = _core("async", world=1, ranks=(0,))
    g0 = _grad(1, 0)
    _send(core, pb.PUSH, 0, 0, [0], [g0])
    (reply,) = _send(core, pb.PULL, 0, 1, [0])
    assert np.array_equal(_arrays(reply)[0], INIT[0] - LR * g0)  # no other worker: no split
    assert core.slots[0].last_delta is not None
    sync, _ = _core("sync")
    assert all(s.last_delta is None for s in sync.slots.values())


def test_flags():
    cfg, _ = parse_config(["--no-split-lr", "--no-lookahead"])
    assert not cfg.split_lr and not cfg.lookahead
    cfg, _ = parse_config([])
    assert cfg.split_lr and cfg.lookahead
