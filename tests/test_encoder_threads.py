"""``EncoderConfig.threads``: a push's keys checked and encoded on several threads
(``native.keypool``) give the same payloads, residuals, moments and parameters bit for bit as on
one thread, for every push codec and both 1-bit Adam layouts that the worker encodes; a refused
push (NaN) is refused once, with no state changed."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from bitps.native.keypool import MIN_SPLIT_BYTES
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import CodecConfig, Compressor
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PSError
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.ps.onebit import OneBitConfig
from bitps.worker import ClientConfig
from bitps.worker.config import EncoderConfig
from tests.encoding import EncodingClient

N = 1 << 19  # 2 MiB of float32: above MIN_SPLIT_BYTES, so the keys are split over threads
PART = 1 << 18  # bytes per key: 8 keys of 256 KiB
STEPS = 4


@contextlib.contextmanager
def _worker(server: ServerConfig, encoder: EncoderConfig, copy: np.ndarray):
    """An in-process shard of ``server`` and one registered worker pushing through
    ``encoder``, its parameters ``copy`` cut into 8 keys: yields ``(client, shard, keys,
    outs)``."""
    shard = create_server(server)
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=PART)
        keys = [k.key for k in plan.keys]
        outs = [copy[k.offset:k.offset + k.length] for k in plan.keys]
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           partition_bytes=PART)
        with EncodingClient(cfg, encoder=encoder) as client:
            client.register(plan, dict(zip(keys, outs)))
            yield client, shard, keys, outs
    finally:
        shard.stop(0)


def _run(threads: int, *, mode: str, optimizer: OptimizerConfig, codec: str, clip: bool):
    """Train ``STEPS`` push_pulls of seeded gradients; what the worker and the shard hold."""
    assert 4 * N >= MIN_SPLIT_BYTES
    copy = (np.random.default_rng(7).standard_normal(N) * 0.02).astype(np.float32)
    enc = EncoderConfig(push_codec=CodecConfig(name=codec), compress_min_bytes=0,
                        threads=threads)
    payloads = []
    server = ServerConfig(mode=mode, optimizer=optimizer, metrics_port=-1, threads=1)
    with _worker(server, enc, copy) as (client, shard, keys, outs):
        rng = np.random.default_rng(1)
        for step in range(STEPS):
            grads = [(rng.standard_normal(len(o)) * 1e-2).astype(np.float32) for o in outs]
            sent = client.encode(keys, grads, clock=step, scale=0.5 if clip else None)
            payloads.append([bytes(memoryview(p).cast("B")) for p in sent.payloads])
            client.push_pull(keys, grads, outs, clock=step, scale=0.5 if clip else None).wait()
        state = client.state_dict()
        held = np.concatenate([shard.core.slots[k].param for k in keys])
    return payloads, copy, held, state


CASES = {
    "sign1": dict(mode="async", optimizer=OptimizerConfig(name="adam", lr=1e-3),
                  codec="sign1", clip=False),
    "bf16 clipped": dict(mode="async", optimizer=OptimizerConfig(name="adam", lr=1e-3),
                         codec="bf16", clip=True),
    "sparse": dict(mode="async", optimizer=OptimizerConfig(name="adam", lr=1e-3),
                   codec="sparse", clip=False),
    "raw clipped": dict(mode="sync", optimizer=OptimizerConfig(name="adam", lr=1e-3),
                        codec="raw", clip=True),
    "1-bit Adam sync": dict(mode="sync", optimizer=OptimizerConfig(
        name="onebit_adam", lr=1e-3, rule_config=OneBitConfig(freeze_step=2)),
        codec="raw", clip=False),
    "1-bit Adam async, worker moments": dict(mode="async", optimizer=OptimizerConfig(
        name="onebit_adam", lr=1e-3, rule_config=OneBitConfig(freeze_step=2)),
        codec="raw", clip=True),
}


def _flat(state) -> list[np.ndarray]:
    if isinstance(state, np.ndarray):
        return [state]
    if isinstance(state, dict):
        return [a for k in sorted(state) for a in _flat(state[k])]
    if isinstance(state, tuple | list):
        return [a for v in state for a in _flat(v)]
    return [np.asarray(state)]


@pytest.mark.parametrize("case", CASES)
def test_two_threads_give_one_threads_bits(case, monkeypatch):
    one = _run(1, **CASES[case])
    used: set[int] = set()
    encode = Compressor.encode

    def spy(self, grad, **kw):
        used.add(threading.get_ident())
        return encode(self, grad, **kw)

    monkeypatch.setattr(Compressor, "encode", spy)
    two = _run(2, **CASES[case])
    assert one[0] == two[0]  # every push's payloads
    assert np.array_equal(one[1].view(np.uint32), two[1].view(np.uint32))  # the worker's copy
    assert np.array_equal(one[2].view(np.uint32), two[2].view(np.uint32))  # the shard's
    a, b = _flat(one[3]), _flat(two[3])  # residuals and the policy's moments
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    if case not in ("1-bit Adam sync", "1-bit Adam async, worker moments"):
        assert len(used) == 2  # the compressors ran on both threads (1-bit Adam: fused kernels)


def test_a_nonfinite_push_is_refused_once_with_nothing_changed():
    """Two keys hold NaN: the checks run on both threads, and the push is refused for the first
    key in the push's order, counted once, with no residual changed."""
    server = ServerConfig(mode="async", metrics_port=-1, threads=1,
                          optimizer=OptimizerConfig(name="adam", lr=1e-3))
    enc = EncoderConfig(push_codec=CodecConfig(name="sign1"), compress_min_bytes=0, threads=2)
    with _worker(server, enc, np.zeros(N, np.float32)) as (client, _, keys, outs):
        grads = [np.full(len(o), 1e-3, np.float32) for o in outs]
        client.push_pull(keys, grads, outs, clock=0).wait()
        before = [r.copy() for r in client.residuals().values()]
        grads[2][5] = np.nan
        grads[6][9] = np.inf
        with pytest.raises(PSError, match=f"key {keys[2]}: gradient holds NaN") as err:
            client.push_pull(keys, grads, outs, clock=1)
        assert err.value.code == pb.NON_FINITE
        assert client.metrics.nonfinite.value == 1
        after = list(client.residuals().values())
        assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_threads_below_zero_are_refused():
    with pytest.raises(ValueError, match="encoder threads must be >= 0"):
        EncoderConfig(threads=-1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_gradient_of_the_wrong_shape_is_refused_before_any_key_is_encoded(threads):
    """async 1-bit Adam with worker moments, past the switch (each key's push is made in one
    fused pass): the third key's gradient is too short. The push is refused before the keys
    ahead of it advanced their moments or their error feedback (they used to)."""
    opt = OptimizerConfig(name="onebit_adam", lr=1e-3, rule_config=OneBitConfig(freeze_step=1))
    server = ServerConfig(mode="async", optimizer=opt, metrics_port=-1, threads=1)
    enc = EncoderConfig(compress_min_bytes=0, threads=threads)
    with _worker(server, enc, np.zeros(N, np.float32)) as (client, _, keys, outs):
        grads = [np.full(len(o), 1e-3, np.float32) for o in outs]
        for step in range(2):
            client.push_pull(keys, grads, outs, clock=step).wait()
        before = _flat(client.state_dict())
        bad = list(grads)
        bad[2] = bad[2][:-1]
        with pytest.raises(ValueError, match=f"key {keys[2]}: gradient is float32"):
            client.push_pull(keys, bad, outs, clock=2)
        after = _flat(client.state_dict())
        # residual, m and v per key (and the step counts)
        assert sum(a.size == PART // 4 for a in before) == 3 * len(keys)
        assert len(before) == len(after)
        assert all(np.array_equal(x, y) for x, y in zip(before, after))
