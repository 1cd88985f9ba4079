"""Delayed Nesterov (``ps.outer.DelayedNesterov``, ``--optimizer delayed_nesterov``): in async each
arriving pseudo-gradient is a plain step and the momentum moves every N arrivals (N = the key's
pushers by default), against a plain-numpy reference written here; in sync the rule is
``nesterov`` bit for bit; its state restores bit for bit; its flag reaches the config."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PROTOCOL
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.outer import DelayedNesterov, DelayedNesterovConfig
from bitps.ps.rules import make_rule
from bitps.ps.shard import ShardCore

N = 1024
INCARNATION = 0x0D  # the pushes' life id (a push needs one: the exactly-once window)
LR, BETA = 0.7, 0.9


def _dn(delay: int = 0, **kw) -> OptimizerConfig:
    return OptimizerConfig(name="delayed_nesterov", lr=LR, momentum=BETA,
                           rule_config=DelayedNesterovConfig(momentum_delay=delay), **kw)


def _core(mode: str, optimizer: OptimizerConfig, workers: int) -> ShardCore:
    """One key ``w`` of N elements, every rank of a world of ``workers`` registered."""
    core = ShardCore(ServerConfig(mode=mode, optimizer=optimizer), now=lambda: 0.0)
    spec = pb.KeySpec(key=0, name="w", offset=0, length=N, dtype=pb.FLOAT32)
    init = np.linspace(-1, 1, N, dtype=np.float32)
    for rank in range(workers):
        core.register(pb.RegisterRequest(protocol=PROTOCOL, rank=rank, world_size=workers,
                                         signature="s", num_shards=1, shard_id=0, keys=[spec],
                                         sends_values=rank == 0),
                      {0: init.tobytes()} if rank == 0 else {})
    return core


def _push(core: ShardCore, worker: int, clock: int, delta: np.ndarray, rid: int) -> None:
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=worker, clock=clock, keys=[0],
                           dtype=pb.FLOAT32, request_id=rid, incarnation=INCARNATION)
    replies = core.handle(f"w{worker}".encode(), [header.SerializeToString(), delta.tobytes()])
    assert replies[-1].header.op == pb.REPLY, replies[-1].header.message


def _deltas(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) * 0.1 for _ in range(count)]


def reference(theta: np.ndarray, deltas: list[np.ndarray], *, lr: float, beta: float,
              n: int) -> tuple[np.ndarray, np.ndarray]:
    """Delayed Nesterov in float64, straight from the paper's description (c = 0): a plain step
    per arrival; every n-th arrival the momentum takes the mean of the last n and the step
    carries it at n times the arrival's learning rate."""
    theta, m, pending = theta.astype(np.float64), np.zeros(theta.size), np.zeros(theta.size)
    for t, d in enumerate(deltas, 1):
        d = d.astype(np.float64)
        pending += d
        step = d
        if t % n == 0:
            m = beta * m + pending / n
            pending[:] = 0
            step = d + n * beta * m
        theta -= lr * step
    return theta, m


@pytest.mark.parametrize("workers,delay,n", [(2, 0, 2), (3, 0, 3), (1, 4, 4), (2, 1, 1)])
def test_async_arrivals_are_plain_steps_and_momentum_moves_every_n(workers, delay, n):
    """N defaults to the key's pushers; each push is applied at lr / W (split_lr), the momentum
    term at N times that; ``--outer-momentum-delay 1`` is Nesterov on every arrival."""
    core = _core("async", _dn(delay), workers)
    theta0 = core.slots[0].param.copy()
    deltas = _deltas(4 * n + 1)
    for i, d in enumerate(deltas):  # round robin over the workers, each at its own clock
        _push(core, i % workers, i // workers, d, rid=i + 1)
    want, m = reference(theta0, deltas, lr=LR / workers, beta=BETA, n=n)
    np.testing.assert_allclose(core.slots[0].param, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(core.slots[0].rule_state.buf1, m, rtol=1e-5, atol=1e-6)
    assert core.slots[0].rule_state.step == len(deltas)
    # one arrival past the last activation is pending, the rest went into the momentum
    np.testing.assert_allclose(core.slots[0].rule_state.buf2,
                               deltas[-1] if n > 1 else np.zeros(N), rtol=1e-6)


def test_between_activations_the_step_carries_no_momentum():
    core = _core("async", _dn(3), 1)
    deltas = _deltas(4)
    for i, d in enumerate(deltas[:3]):
        _push(core, 0, i, d, rid=i + 1)
    before = core.slots[0].param.copy()
    _push(core, 0, 3, deltas[3], rid=4)  # arrival 4: momentum is nonzero, but not applied
    # fma(delta, -lr, theta): the product is exact in float64, the sum rounds once
    plain = before.astype(np.float64) - float(np.float32(LR)) * deltas[3].astype(np.float64)
    np.testing.assert_array_equal(core.slots[0].param, plain.astype(np.float32))


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_sync_is_nesterov_bit_for_bit(delay):
    """Two workers, six sync rounds: parameters and momentum equal ``nesterov``'s bit for bit,
    whatever the delay."""
    plain = _core("sync", OptimizerConfig(name="nesterov", lr=LR, momentum=BETA), 2)
    delayed = _core("sync", _dn(delay), 2)
    deltas = _deltas(12, seed=5)
    for clock in range(6):
        for worker in (1, 0):
            d = deltas[2 * clock + worker]
            _push(plain, worker, clock, d, rid=2 * clock + worker + 1)
            _push(delayed, worker, clock, d, rid=2 * clock + worker + 1)
    assert delayed.slots[0].version == 6
    np.testing.assert_array_equal(delayed.slots[0].param, plain.slots[0].param)
    np.testing.assert_array_equal(delayed.slots[0].rule_state.buf1,
                                  plain.slots[0].rule_state.buf1)


def test_a_restored_key_continues_bit_for_bit():
    a = _core("async", _dn(3), 1)
    deltas = _deltas(10, seed=2)
    for i, d in enumerate(deltas[:4]):
        _push(a, 0, i, d, rid=i + 1)
    slot = a.slots[0]
    saved, params, version = slot.rule_state.state_dict(), slot.param.copy(), slot.version
    assert set(saved) == {"version", "step", "buf1", "buf2"}
    b = _core("async", _dn(3), 1)
    b.slots[0].rule_state.load_state_dict(saved)
    b.slots[0].set_values(params.tobytes())
    b.slots[0].version = version
    for i, d in enumerate(deltas[4:], 4):
        _push(a, 0, i, d, rid=i + 1)
        _push(b, 0, i, d, rid=i + 1)
    np.testing.assert_array_equal(a.slots[0].param, b.slots[0].param)
    np.testing.assert_array_equal(a.slots[0].rule_state.buf2, b.slots[0].rule_state.buf2)


def test_the_kernel_without_jit_matches(run_without_jit):
    """The kernel run as plain Python (``NUMBA_DISABLE_JIT=1``) gives what the compiled one
    does."""
    rule = make_rule(_dn(2))
    assert isinstance(rule, DelayedNesterov)
    deltas = np.stack(_deltas(5, seed=9))
    theta = np.linspace(-1, 1, N, dtype=np.float32)
    state = rule.new_state(N)
    for d in deltas:
        rule._arrival = 2  # as ``arrived`` sets it for a key of two pushers
        rule.apply(theta, d, state, lr_scale=0.5)
    out = run_without_jit(
        "import sys, numpy as np\n"
        "from bitps.ps.config import OptimizerConfig\n"
        "from bitps.ps.outer import DelayedNesterovConfig\n"
        "from bitps.ps.rules import make_rule\n"
        "a = np.load(sys.argv[1])\n"
        "rule = make_rule(OptimizerConfig(name='delayed_nesterov', lr=0.7, momentum=0.9,\n"
        "                 rule_config=DelayedNesterovConfig(momentum_delay=2)))\n"
        "theta, state = a['theta'].copy(), rule.new_state(a['theta'].size)\n"
        "for d in a['deltas']:\n"
        "    rule._arrival = 2\n"
        "    rule.apply(theta, d, state, lr_scale=0.5)\n"
        "np.savez(sys.argv[2], theta=theta, m=state.buf1)\n",
        theta=np.linspace(-1, 1, N, dtype=np.float32), deltas=deltas)
    np.testing.assert_allclose(out["theta"], theta, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["m"], state.buf1, rtol=1e-6, atol=1e-7)


def test_the_flag_reaches_the_config_and_a_bad_delay_is_refused():
    from bitps.ps.__main__ import parse_config

    cfg, _ = parse_config(["--optimizer", "delayed_nesterov", "--outer-momentum-delay", "4"],
                          environ={})
    assert cfg.optimizer.rule_config == DelayedNesterovConfig(momentum_delay=4)
    cfg, _ = parse_config(["--optimizer", "delayed_nesterov"], environ={})
    assert cfg.optimizer.rule_config.momentum_delay == 0
    with pytest.raises(ValueError, match="outer_momentum_delay must be >= 0"):
        DelayedNesterovConfig(momentum_delay=-1)
    with pytest.raises(ValueError, match="no weight decay"):
        make_rule(_dn(weight_decay=0.1))
