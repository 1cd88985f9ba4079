"""Tests for ps.rules and the native update kernels: equality with torch.optim, grad/lr scaling,
copy-on-write ``dst``, the NaN/Inf test, the pure-Python path (``NUMBA_DISABLE_JIT=1``) and the
small kernels."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from bitps import native
from bitps.ps.config import OptimizerConfig
from bitps.ps.rules import make_rule

# Odd length so the scalar tail of torch's vectorised loops is exercised too.
N = 1037
STEPS = 20

CONFIGS = {
    "sgd": OptimizerConfig(name="sgd", lr=0.05),
    "sgd_wd": OptimizerConfig(name="sgd", lr=0.05, weight_decay=0.01),
    "momentum": OptimizerConfig(name="momentum", lr=0.05, momentum=0.9),
    "momentum_damp_wd": OptimizerConfig(name="momentum", lr=0.05, momentum=0.8, dampening=0.1,
                                        weight_decay=0.01),
    "nesterov_wd": OptimizerConfig(name="momentum", lr=0.05, momentum=0.9, nesterov=True,
                                   weight_decay=0.02),
    "adam": OptimizerConfig(name="adam", lr=1e-2),
    "adam_wd": OptimizerConfig(name="adam", lr=1e-2, weight_decay=0.01),
    "adamw_wd": OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.99),
}
EXACT = [k for k, c in CONFIGS.items() if c.name in ("sgd", "momentum")]
ADAM = [k for k, c in CONFIGS.items() if c.name in ("adam", "adamw")]


def _data(seed: int, n: int = N, steps: int = STEPS):
    rng = np.random.default_rng(seed)
    param = rng.standard_normal(n).astype(np.float32)
    grads = (rng.standard_normal((steps, n)) * rng.uniform(0.01, 3.0, (steps, 1)))
    return param, grads.astype(np.float32)


def _ours(cfg: OptimizerConfig, param: np.ndarray, grads: np.ndarray) -> np.ndarray:
    rule, p = make_rule(cfg), param.copy()
    state = rule.new_state(p.shape[0])
    for g in grads:
        rule.apply(p, g, state)
    assert state.step == len(grads)
    return p


def _torch(cfg: OptimizerConfig, param: np.ndarray, grads: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.from_numpy(param.copy()))
    if cfg.name == "sgd":
        opt = torch.optim.SGD([p], lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    elif cfg.name == "momentum":
        opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                              nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, foreach=False)
    else:
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        opt = cls([p], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  weight_decay=cfg.weight_decay, foreach=False, fused=False)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy().copy()


@pytest.mark.parametrize("name", EXACT)
def test_sgd_and_momentum_bit_identical_to_torch(name):
    param, grads = _data(1)
    ours, ref = _ours(CONFIGS[name], param, grads), _torch(CONFIGS[name], param, grads)
    assert not np.array_equal(ours, param)
    assert np.array_equal(ours, ref), np.abs(ours - ref).max()


@pytest.mark.parametrize("name", ADAM)
def test_adam_matches_torch(name):
    # Not bit-exact: torch's CPU sqrt comes from MKL (vectorised) and differs from a correctly
    # rounded sqrt by 1 ulp on some inputs, and that ulp propagates through the division.
    param, grads = _data(2)
    ours, ref = _ours(CONFIGS[name], param, grads), _torch(CONFIGS[name], param, grads)
    assert np.abs(ours - param).max() > 0.05  # the steps actually moved the parameters
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grad_scale_half_equals_halved_gradient(name):
    cfg = CONFIGS[name]
    param, grads = _data(3, steps=5)
    scaled, halved = param.copy(), param.copy()
    rule = make_rule(cfg)
    s1, s2 = rule.new_state(N), rule.new_state(N)
    for g in grads:
        rule.apply(scaled, g, s1, grad_scale=0.5)
        rule.apply(halved, g * np.float32(0.5), s2)
    assert np.array_equal(scaled, halved)
    assert np.array_equal(s1.buf1, s2.buf1) and np.array_equal(s1.buf2, s2.buf2)
    assert not np.array_equal(scaled, _ours(cfg, param, grads))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lr_scale_equals_scaled_learning_rate(name):
    cfg = CONFIGS[name]
    param, grads = _data(4, steps=5)
    damped = param.copy()
    rule = make_rule(cfg)
    state = rule.new_state(N)
    for g in grads:
        rule.apply(damped, g, state, lr_scale=0.25)
    half = OptimizerConfig(**{**cfg.__dict__, "lr": cfg.lr * 0.25})
    assert np.array_equal(damped, _ours(half, param, grads))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dst_receives_the_update_and_param_is_left_alone(name):
    """Copy-on-write: with ``dst`` the new parameters land there and ``param`` is unchanged
    (optimizer state still advances); a ``dst`` of another shape is refused."""
    param, grads = _data(5, steps=3)
    rule = make_rule(CONFIGS[name])
    p, state = param.copy(), rule.new_state(N)
    ref = _ours(CONFIGS[name], param, grads[:2])
    with pytest.raises(ValueError, match="dst has shape"):
        rule.apply(p, grads[0], state, dst=np.empty(N - 1, np.float32))
    assert state.step == 0  # refused before anything changed
    rule.apply(p, grads[0], state)
    before = p.copy()
    dst = np.full(N, np.nan, np.float32)
    rule.apply(p, grads[1], state, dst=dst)
    assert np.array_equal(p, before)
    assert np.array_equal(dst, ref)


def test_new_state_buffers():
    assert make_rule(CONFIGS["sgd"]).new_state(5).buf1.size == 0
    m = make_rule(CONFIGS["momentum"]).new_state(5)
    assert m.buf1.dtype == np.float32 and np.array_equal(m.buf1, np.zeros(5)) and m.buf2.size == 0
    a = make_rule(CONFIGS["adam"]).new_state(5)
    assert a.step == 0 and a.buf1.shape == a.buf2.shape == (5,)
    assert not np.shares_memory(a.buf1, a.buf2)


def test_sgd_single_step_exact_formula():
    param, grads = _data(6, steps=1)
    p = param.copy()
    rule = make_rule(OptimizerConfig(name="sgd", lr=0.125))
    rule.apply(p, grads[0], rule.new_state(N))
    assert np.array_equal(p, param - np.float32(0.125) * grads[0])


def test_accumulate_matches_numpy():
    rng = np.random.default_rng(7)
    a, b, c = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    acc = np.full(N, np.nan, np.float32)
    native.accumulate(acc, a, True)
    assert np.array_equal(acc, a)
    native.accumulate(acc, b, False)
    assert np.array_equal(acc, a + b)
    # gradients arrive as read-only views of received frames
    ro = np.frombuffer(c.tobytes(), np.float32)
    assert not ro.flags.writeable
    native.accumulate(acc, ro, False)
    assert np.array_equal(acc, (a + b) + c)
    native.accumulate(acc, ro, True)
    assert np.array_equal(acc, c)


def test_all_finite_flags_every_nan_and_inf():
    """The bit test must agree with ``np.isfinite`` on every class of float32, at any position
    (vector body and scalar tail), on read-only frame views too."""
    f32 = np.finfo(np.float32)
    finite = np.array([0.0, -0.0, 1.0, -1.0, f32.max, -f32.max, f32.tiny, f32.smallest_subnormal,
                       -f32.smallest_subnormal], np.float32)
    assert native.all_finite(np.frombuffer(np.resize(finite, N).tobytes(), np.float32))
    assert native.all_finite(np.empty(0, np.float32))
    nan_payload = np.array([0x7FC00001, 0xFFC00000, 0x7F800001], np.uint32).view(np.float32)
    for bad in (np.nan, np.inf, -np.inf, *nan_payload):
        for pos in (0, 517, N - 1):
            x = np.resize(finite, N)
            x[pos] = bad
            assert not native.all_finite(x), (bad, pos)


_NOJIT_SCRIPT = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    assert numba.config.DISABLE_JIT
    from bitps import native
    from bitps.ps.config import OptimizerConfig
    from bitps.ps.rules import make_rule
    from tests.test_update_rules import _worker_moments

    data = np.load(sys.argv[1])
    param, grads = data["param"], data["grads"]
    out = {}
    for name in ("sgd", "momentum", "adam"):
        cfg = OptimizerConfig(name=name, lr=0.01, weight_decay=0.01)
        rule, p = make_rule(cfg), param.copy()
        state = rule.new_state(p.shape[0])
        for g in grads:
            rule.apply(p, g, state)
        out[name] = p
    out["direction"] = _worker_moments(param, grads)
    acc = np.empty_like(param)
    native.accumulate(acc, grads[0], True)
    native.accumulate(acc, grads[1], False)
    out["accumulate"] = acc
    bad = param.copy()
    bad[7] = np.inf
    out["finite"] = np.array([native.all_finite(param), native.all_finite(bad)])
    np.savez(sys.argv[2], **out)
""")


def test_pure_python_path_matches_jit(run_without_jit):
    param, grads = _data(9, n=301, steps=5)
    got = run_without_jit(_NOJIT_SCRIPT, param=param, grads=grads)
    for name in ("sgd", "momentum", "adam"):
        cfg = OptimizerConfig(name=name, lr=0.01, weight_decay=0.01)
        jitted = _ours(cfg, param, grads)
        assert got[name].dtype == np.float32
        assert not np.array_equal(jitted, param)
        np.testing.assert_allclose(got[name], jitted, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["direction"], _worker_moments(param, grads), rtol=1e-6)
    assert np.array_equal(got["accumulate"], grads[0] + grads[1])
    assert got["finite"].tolist() == [True, False]


def _worker_moments(param: np.ndarray, grads: np.ndarray,
                    adamw: OptimizerConfig = CONFIGS["adamw_wd"]) -> np.ndarray:
    """1-bit Adam with worker moments, nothing compressed: the worker's directions
    (``WorkerMoments``) applied by the shard (``UpdateRule.direction_delta``)."""
    from bitps.worker.algorithms.onebit import OneBitParams, WorkerMoments

    cfg = OptimizerConfig(name="onebit_adam", lr=adamw.lr, beta1=adamw.beta1,
                          beta2=adamw.beta2, eps=adamw.eps, weight_decay=adamw.weight_decay)
    rule = make_rule(cfg)
    moments = WorkerMoments(OneBitParams(beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps))
    p, delta = param.copy(), np.empty_like(param)
    for g in grads:
        rule.direction_delta(p, moments.direction(3, g), delta)
        p += delta
    assert moments.steps[3] == len(grads)
    return p


def test_worker_moments_direction_applied_by_the_shard_is_adamw():
    param, grads = _data(4)
    ours, ref = _worker_moments(param, grads), _torch(CONFIGS["adamw_wd"], param, grads)
    assert np.abs(ours - param).max() > 0.05
    # not bit-exact: the shard adds lr * (d + wd * x) where torch decays x first
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_sync_sum_takes_the_first_decoded_push_without_a_copy_and_keeps_it_whole():
    """Slot.accumulate: the step's first push, decoded into the key's scratch array, becomes
    the sum (no copy); the next push decodes into another array, so the sum stays whole, in
    rank order whatever the arrival order."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.ps.store import Slot

    n = 1000
    slot = Slot.zeros(pb.KeySpec(key=0, name="w", offset=0, length=n, dtype=pb.FLOAT32))
    rng = np.random.default_rng(0)
    pushes = {r: rng.standard_normal(n).astype(np.float32) for r in range(3)}
    for step in range(2):  # the scratch and the sum trade places every step
        for rank in (1, 0, 2):  # rank 1 arrives first: kept aside (copied) until rank 0's
            scratch = slot.decode_buffer()
            np.copyto(scratch, pushes[rank] * np.float32(step + 1))
            slot.accumulate(rank, scratch, [0, 1, 2])
            slot.decode_buffer().fill(np.nan)  # what the next push's decode writes
        total, count = slot.step_sum()
        want = (pushes[0] * np.float32(step + 1) + pushes[1] * np.float32(step + 1)) \
            + pushes[2] * np.float32(step + 1)
        assert count == 3
        np.testing.assert_array_equal(total, want)
        slot.end_step()


def test_lookahead_from_the_previous_parameters_equals_adding_the_stored_update():
    """Slot keeps the parameters before the last update (one copy) instead of the update
    (a copy and a subtraction): the lookahead ``x + steps * delta`` is bit for bit what adding
    the stored difference gave, before the first update, after updates, and from a
    checkpoint's delta until the next update."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.ps.config import OptimizerConfig
    from bitps.ps.rules import make_rule
    from bitps.ps.store import Slot

    n = 1003
    rule = make_rule(OptimizerConfig(name="adam", lr=1e-2))
    slot = Slot.zeros(pb.KeySpec(key=0, name="w", offset=0, length=n, dtype=pb.FLOAT32))
    rule.setup(slot)
    rng = np.random.default_rng(0)
    slot.set_values(rng.standard_normal(n).astype(np.float32).tobytes())
    slot.track_updates()
    x0 = slot.param.copy()
    np.testing.assert_array_equal(slot.lookahead(3.0)[0], x0)  # no update yet
    for _ in range(3):
        before = slot.param.copy()
        rule.update(slot, rng.standard_normal(n).astype(np.float32), clock=0)
        delta = slot.param - before  # what the shard stored before
        want = slot.param.copy()
        native.add_scaled(want, delta, np.float32(1.5))
        np.testing.assert_array_equal(slot.last_delta, delta)
        np.testing.assert_array_equal(slot.lookahead(1.5)[0], want)
    saved = slot.last_delta
    slot.set_values(slot.param.tobytes())  # as a checkpoint restores: values, then the delta
    slot.restore_delta(saved * np.float32(2))
    want = slot.param.copy()
    native.add_scaled(want, saved * np.float32(2), np.float32(1.0))
    np.testing.assert_array_equal(slot.lookahead(1.0)[0], want)
    before = slot.param.copy()
    rule.update(slot, rng.standard_normal(n).astype(np.float32), clock=0)
    np.testing.assert_array_equal(slot.last_delta, slot.param - before)


def test_sync_sum_of_raw_pushes_keeps_the_first_as_received_and_adds_the_second_into_it():
    """A raw push (a read-only view of its frame) that is a step's only one is the step's sum
    as it is; the second push is added to it into the sum in one pass; the bits are those of
    copying the first and adding the rest in rank order."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.ps.store import Slot

    n = 777
    rng = np.random.default_rng(1)
    frames = {r: rng.standard_normal(n).astype(np.float32).tobytes() for r in range(3)}
    views = {r: np.frombuffer(f, np.float32) for r, f in frames.items()}
    slot = Slot.zeros(pb.KeySpec(key=0, name="w", offset=0, length=n, dtype=pb.FLOAT32))
    slot.accumulate(0, views[0], [0])
    total, count = slot.step_sum()
    assert count == 1 and total is views[0]  # one push: no copy
    slot.end_step()
    assert slot.first is None
    for rank in (2, 0, 1):
        slot.accumulate(rank, views[rank], [0, 1, 2])
    total, count = slot.step_sum()
    np.testing.assert_array_equal(total, (views[0] + views[1]) + views[2])
    assert count == 3 and not np.may_share_memory(total, views[0])
    slot.end_step()
