"""1-bit Adam's momentum window with worker moments (``OneBitConfig.momentum_window``): with
``updates`` each of W workers' m decays by ``beta1**W`` per push, checked against plain numpy
Adam; the flag reaches the workers; layouts with one momentum (sync, shard moments) refuse it,
so sync is unchanged by construction."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, Compressor
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig, ServerConfig
from bitps.ps import __main__ as server_cli
from bitps.ps.onebit import OneBitConfig, params
from bitps.worker.algorithms.onebit import MomentsPush, push_policy

N = 1000
BETA1, BETA2, EPS = 0.9, 0.99, 1e-8


def _cfg(window: str, mode: str = "ssp", moments: str = "auto") -> ServerConfig:
    return ServerConfig(mode=mode, optimizer=OptimizerConfig(
        name="onebit_adam", lr=1e-3, beta1=BETA1, beta2=BETA2, eps=EPS,
        rule_config=OneBitConfig(freeze_step=2, moments=moments, momentum_window=window)))


def _policy(window: str, pushers: int | None) -> MomentsPush:
    reply = pb.RegisterReply(rule="onebit_adam", mode="ssp")
    reply.rule_params.Pack(params(_cfg(window), ratio_clip=0.0))
    policy = push_policy(reply)
    assert isinstance(policy, MomentsPush)
    plan = make_plan([ParamSpec("w", (N,))], num_shards=1)
    policy.bind(None, plan, pushers=pushers)
    return policy


def _numpy_adam(grads: list[np.ndarray], beta1: float) -> list[np.ndarray]:
    """Adam's direction after each gradient, in float64: m/(1-beta1^t) / (sqrt(v/(1-beta2^t))
    + eps)."""
    m = v = np.zeros(N)
    out = []
    for t, g in enumerate(grads, 1):
        m = beta1 * m + (1 - beta1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
        out.append(m / (1 - beta1**t) / (np.sqrt(v / (1 - BETA2**t)) + EPS))
    return out


@pytest.mark.parametrize(("window", "pushers", "beta1"),
                         [("updates", 4, BETA1**4), ("updates", 2, BETA1**2),
                          ("updates", 1, BETA1), ("steps", 4, BETA1)])
def test_worker_momentum_decays_by_beta1_to_the_pushers_with_the_update_window(
        window, pushers, beta1):
    """Each direction (and the fused direction-and-encode path) is numpy Adam's with m's
    decay ``beta1**W`` (``updates``) or ``beta1`` (``steps``), v's ``beta2`` either way."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(6)]
    policy = _policy(window, pushers)
    fused = _policy(window, pushers)
    comp = Compressor(Codec(pb.CODEC_SIGN1, 256), N)
    reference = Compressor(Codec(pb.CODEC_SIGN1, 256), N)
    for g, want in zip(grads, _numpy_adam(grads, beta1)):
        got = policy.worker_moments.direction(0, g).copy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
        payload = bytes(fused.worker_moments.encode(0, g, comp))
        assert payload == bytes(reference.encode(got))  # one pass, the same code
    assert policy.worker_moments.beta1 == pytest.approx(beta1)


def test_the_window_reaches_the_workers_from_the_server_flag():
    cfg, _ = server_cli.parse_config(
        ["--mode", "ssp", "--optimizer", "onebit_adam", "--onebit-momentum-window", "updates"],
        environ={})
    assert cfg.optimizer.rule_config.momentum_window == "updates"
    assert params(cfg, ratio_clip=0.0).momentum_per_update
    assert not params(_cfg("steps"), ratio_clip=0.0).momentum_per_update


def test_layouts_with_one_momentum_and_unknown_pushers_refuse_the_update_window():
    """sync (DeepSpeed's shared momentum) and shard moments keep one m: the window is refused
    there, so sync runs as before; a worker that cannot say how many workers push its keys
    (a pipeline stage's part of a plan without ``pushers``) refuses to guess."""
    with pytest.raises(ValueError, match="onebit_momentum_window 'updates' applies to the "
                                         "workers' own moments.*mode 'sync'"):
        _cfg("updates", mode="sync")
    with pytest.raises(ValueError, match="onebit_moments 'shard' keeps one momentum"):
        _cfg("updates", moments="shard")
    with pytest.raises(ValueError, match="onebit_momentum_window 'shared'; expected one of"):
        OneBitConfig(momentum_window="shared")
    with pytest.raises(ValueError, match="needs how many workers push each key; got None"):
        _policy("updates", None)
    assert _policy("steps", None).worker_moments.beta1 == BETA1
