"""Update rules are registered classes owning a key's state: the registry names every optimizer
the config accepts, a rule's state saves and loads so that a restored shard continues bit for
bit, and a bad state is refused before anything changes."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps.config import OPTIMIZERS, OptimizerConfig, ServerConfig
from bitps.ps.onebit import (
    OneBitAdamShardMoments,
    OneBitAdamSync,
    OneBitAdamWorkerMoments,
    OneBitConfig,
)
from bitps.ps.rules import RULES, UpdateRule, make_rule
from bitps.ps.shard import ShardCore
from tests.helpers import one_key_core

N = 4096  # one key, large enough for several sign1 chunks
INCARNATION = 0x2B  # the pushes' life id (a push needs one: the exactly-once window)


def _core(mode: str, optimizer: OptimizerConfig) -> ShardCore:
    return one_key_core(ServerConfig(mode=mode, optimizer=optimizer), N)


def _push(core: ShardCore, clock: int, seed: int) -> None:
    grad = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=0, clock=clock, keys=[0],
                           dtype=pb.FLOAT32, request_id=seed + 1, incarnation=INCARNATION)
    replies = core.handle(b"w0", [header.SerializeToString(), grad.tobytes()])
    assert replies[-1].header.op == pb.REPLY, replies[-1].header.message


def test_every_optimizer_is_a_registered_rule_and_layouts_follow_the_mode():
    assert set(OPTIMIZERS) == set(RULES)
    for name in OPTIMIZERS:
        assert isinstance(make_rule(OptimizerConfig(name=name)), UpdateRule)
    onebit = OptimizerConfig(name="onebit_adam")
    layouts = {"sync": OneBitAdamSync, "async": OneBitAdamWorkerMoments}
    for mode, cls in layouts.items():
        assert type(make_rule(onebit, ServerConfig(mode=mode, optimizer=onebit))) is cls
    shard_m = OptimizerConfig(name="onebit_adam", rule_config=OneBitConfig(moments="shard"))
    assert type(make_rule(shard_m, ServerConfig(mode="ssp", optimizer=shard_m))) \
        is OneBitAdamShardMoments


@pytest.mark.parametrize("mode,optimizer", [
    ("async", OptimizerConfig(name="adam", lr=1e-2)),
    ("async", OptimizerConfig(name="momentum", lr=1e-2, momentum=0.9, nesterov=True)),
    ("sync", OptimizerConfig(name="onebit_adam", lr=1e-2,
                             rule_config=OneBitConfig(freeze_step=3))),
    ("async", OptimizerConfig(name="onebit_adam", lr=1e-2,
                              rule_config=OneBitConfig(freeze_step=3, moments="shard"))),
])
def test_a_restored_key_continues_bit_for_bit(mode, optimizer):
    """Train, save the rule's state (and the parameters and codec residuals, as a checkpoint
    will), load it into a fresh shard, and both go on identically, across 1-bit Adam's
    switch."""
    a = _core(mode, optimizer)
    for clock in range(4):
        _push(a, clock, clock)
    slot = a.slots[0]
    saved = slot.rule_state.state_dict()
    params, version, residuals = slot.param.copy(), slot.version, a.codecs.state_dict()

    b = _core(mode, optimizer)
    b.slots[0].rule_state.load_state_dict(saved)
    b.slots[0].set_values(params.tobytes())
    b.slots[0].version = version
    b.codecs.load_state_dict(residuals)
    for clock in range(4, 8):
        _push(a, clock, clock)
        _push(b, clock, clock)
    np.testing.assert_array_equal(a.slots[0].param, b.slots[0].param)
    after_a, after_b = a.slots[0].rule_state.state_dict(), b.slots[0].rule_state.state_dict()
    assert after_a.keys() == after_b.keys()
    for name in after_a:
        np.testing.assert_array_equal(after_a[name], after_b[name], err_msg=name)


def test_a_state_of_the_wrong_shape_or_names_is_refused_and_nothing_changes():
    core = _core("async", OptimizerConfig(name="adam"))
    _push(core, 0, 0)
    state = core.slots[0].rule_state
    before = state.state_dict()
    bad = dict(before, buf2=np.zeros(N - 1, np.float32))
    with pytest.raises(PSError) as err:
        state.load_state_dict(bad)
    assert err.value.code == pb.BAD_LENGTH and "buf2" in err.value.message
    with pytest.raises(PSError, match="buf1"):
        state.load_state_dict({"version": 1, "step": before["step"]})
    for name, value in state.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_the_outer_rule_is_torch_nesterov_sgd_and_refuses_what_does_not_fit():
    """``nesterov`` (local SGD's outer rule) steps as ``torch.optim.SGD(nesterov=True)`` does,
    bit for bit with the ``momentum`` rule; dampening and weight decay are refused at start."""
    outer = make_rule(OptimizerConfig(name="nesterov", lr=0.7, momentum=0.9))
    same = make_rule(OptimizerConfig(name="momentum", lr=0.7, momentum=0.9, nesterov=True))
    rng = np.random.default_rng(3)
    a = b = rng.standard_normal(N).astype(np.float32)
    a, b = a.copy(), b.copy()
    sa, sb = outer.new_state(N), same.new_state(N)
    for _ in range(5):
        g = rng.standard_normal(N).astype(np.float32)
        outer.apply(a, g, sa)
        same.apply(b, g, sb)
    assert np.array_equal(a, b) and np.array_equal(sa.buf1, sb.buf1)
    for bad, match in [({"weight_decay": 0.1}, "no weight decay; got weight_decay 0.1"),
                       ({"dampening": 0.5}, "no dampening; got dampening 0.5")]:
        with pytest.raises(ValueError, match=match):
            make_rule(OptimizerConfig(name="nesterov", **bad))
    with pytest.raises(ValueError, match="no weight decay"):
        ShardCore(ServerConfig(mode="sync", optimizer=OptimizerConfig(
            name="nesterov", weight_decay=0.1)), now=lambda: 0.0)


def test_a_rule_registered_from_outside_is_selectable_by_config_and_flag():
    """The config's choices are the registry's names: a rule registered by a user's module is
    accepted by ``OptimizerConfig`` and ``bitps-server --optimizer`` alike, and a shard runs it."""
    from bitps.ps import __main__ as server_cli
    from bitps.ps.rules import SGD, register

    @register
    class HalfSGD(SGD):
        name = "half_sgd"

        def _step(self, param, grad, state, scale, lr, lr_scale, wd):
            super()._step(param, grad, state, np.float32(scale * 0.5), lr, lr_scale, wd)

    try:
        cfg, _ = server_cli.parse_config(["--optimizer", "half_sgd", "--lr", "1"], environ={})
        assert cfg.optimizer.name == "half_sgd"
        core = _core("async", cfg.optimizer)
        before = core.slots[0].param.copy()
        _push(core, 0, seed=5)
        grad = np.random.default_rng(5).standard_normal(N).astype(np.float32)
        assert np.allclose(core.slots[0].param, before - 0.5 * grad, atol=1e-6)
    finally:
        del RULES["half_sgd"]
    with pytest.raises(ValueError, match="'half_sgd' is not one of"):
        OptimizerConfig(name="half_sgd")
