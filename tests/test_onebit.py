"""1-bit Adam through real sockets: in-process shards on port 0, two PSClients on threads.

After warmup the shards publish sign1-compressed updates and workers add them to their own
copies; the copies must stay bit-identical to the shard's parameters (hash compared), and both
directions must carry about one bit per element."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from native import sign1
from proto.codecs import CodecConfig
from proto.keyplan import ParamSpec, make_plan
from ps import OptimizerConfig, ServerConfig, create_server
from worker import ClientConfig, PSClient

N = 20_000
FREEZE = 10
STEPS = 50


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _train(servers, plan, rank: int, world: int, init, results, barrier, mode):
    keys = [k.key for k in plan.keys]
    cfg = ClientConfig(servers=servers, rank=rank, world_size=world, partition_bytes=16384,
                       compress_min_bytes=0)
    copy = init.copy()
    outs = [copy[k.offset:k.offset + k.length] for k in plan.keys]
    rng = np.random.default_rng(rank)
    target = np.linspace(-1, 1, N, dtype=np.float32)
    with PSClient(cfg) as client:
        client.register(plan, dict(zip(keys, outs)) if rank == 0 else None)
        client.pull(keys, outs, clock=0).wait()
        for step in range(STEPS):
            # a noisy quadratic: the gradient pulls the copy towards `target`
            grad = (copy - target + 0.1 * rng.standard_normal(N)).astype(np.float32)
            grads = [grad[k.offset:k.offset + k.length] for k in plan.keys]
            client.push_pull(keys, grads, outs, clock=step).wait()
        barrier.wait()  # every push has landed: a last pull brings each copy to the newest version
        client.pull(keys, outs, clock=STEPS).wait()
        barrier.wait()  # both copies read before either worker leaves
        results[rank] = (_digest(outs), float(np.abs(copy - target).mean()),
                         dict(client.versions), client.metrics.pull_bytes.value,
                         client.metrics.push_bytes.value)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_workers_hold_the_shards_parameters_bit_for_bit(mode):
    opt = OptimizerConfig(name="onebit_adam", lr=0.05, freeze_step=FREEZE, onebit_chunk=256,
                          delta_history=4 if mode == "async" else 16)
    shards = [create_server(ServerConfig(shard_id=i, num_shards=2, mode=mode, optimizer=opt,
                                         metrics_port=-1)) for i in range(2)]
    try:
        servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
        plan = make_plan([ParamSpec("w", (N,))], num_shards=2, partition_bytes=16384)
        init = np.zeros(N, np.float32)
        results, barrier = {}, threading.Barrier(2)
        threads = [threading.Thread(target=_train, args=(servers, plan, r, 2, init, results,
                                                         barrier, mode)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert set(results) == {0, 1}, "a worker failed; see the log"
        by_key = {k: s.core.slots[k.key] for s in shards for k in plan.keys
                  if k.key in s.core.slots}
        shard_digest = _digest(by_key[k].param for k in plan.keys)
        for rank in (0, 1):
            digest, loss, versions, pulled, _ = results[rank]
            assert digest == shard_digest, f"worker {rank} differs from the shards"
            assert versions == {k.key: by_key[k].version for k in plan.keys}
            # from 0.5 at the start; the noisy quadratic's optimum is 0
            assert loss < 0.1, "1-bit Adam did not move the copy towards the target"
            # 52 pulls of 4N bytes if nothing were compressed; ~12 float32 pulls (warmup,
            # and async workers that fell behind the history) and ~N/8 bytes per update
            assert pulled < 0.4 * 52 * 4 * N
        assert all(by_key[k].onebit.compressing for k in plan.keys)
        assert all(by_key[k].onebit.history for k in plan.keys)
        for s in shards:
            text = generate_latest(s.core.metrics.registry).decode()
            values = {x.name: x.value for f in text_string_to_metric_families(text)
                      for x in f.samples}
            assert values["bitps_onebit_compressing_keys"] == len(s.core.slots)
            assert values["bitps_onebit_residual_norm"] > 0
    finally:
        for s in shards:
            s.stop(0)


def test_compressed_traffic_is_about_one_bit_per_element():
    """Bytes per step after warmup, both directions, from one worker's own counters."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01, freeze_step=2, onebit_chunk=2048)
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        keys = [k.key for k in plan.keys]
        copy = np.zeros(N, np.float32)
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           compress_min_bytes=0)
        with PSClient(cfg) as client:
            client.register(plan, {keys[0]: copy})
            grad = np.ones(N, np.float32)
            for step in range(4):
                if step == 2:
                    pulled = client.metrics.pull_bytes.value
                    wire_before = client.metrics.codec_wire_bytes.labels("sign1").value
                client.push_pull(keys, [grad], [copy], clock=step).wait()
            wire = client.metrics.codec_wire_bytes.labels("sign1").value - wire_before
            down = client.metrics.pull_bytes.value - pulled
        size = sign1.payload_bytes(N, 2048)
        assert wire == 2 * size  # two sign1 pushes
        assert down == 2 * size  # two sign1 updates pulled
        assert np.array_equal(copy, shard.core.slots[keys[0]].param)
    finally:
        shard.stop(0)


def test_error_feedback_state_saves_and_restores():
    """Worker and shard residuals come out as arrays and go back in unchanged; bad input to
    the shard is refused whole."""
    from proto.wire import PSError

    opt = OptimizerConfig(name="onebit_adam", lr=0.01, freeze_step=1, onebit_chunk=256)
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=16384)
        keys = [k.key for k in plan.keys]
        copy = np.zeros(N, np.float32)
        outs = [copy[k.offset:k.offset + k.length] for k in plan.keys]
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           partition_bytes=16384, compress_min_bytes=0)
        grads = [np.random.default_rng(k).standard_normal(len(o)).astype(np.float32)
                 for k, o in zip(keys, outs)]
        with PSClient(cfg) as client:
            client.register(plan, dict(zip(keys, outs)))
            for step in range(3):
                client.push_pull(keys, grads, outs, clock=step).wait()
            saved = {k: r.copy() for k, r in client.residuals(clock=2).items()}
            assert set(saved) == set(keys) and all(np.any(r) for r in saved.values())
        core = shard.core
        server = core.codec_state()
        assert set(server) == set(keys) and all(np.any(r) for r in server.values())
        before = {k: r.copy() for k, r in server.items()}
        for r in core.codec_state().values():
            r[:] = 7  # copies: the shard's state is untouched
        assert all(np.array_equal(before[k], r) for k, r in core.codec_state().items())
        zeroed = {k: np.zeros_like(r) for k, r in before.items()}
        with pytest.raises(PSError, match="expected"):
            core.load_codec_state({**zeroed, keys[-1]: np.zeros(3, np.float32)})
        assert all(np.array_equal(before[k], r) for k, r in core.codec_state().items())
        core.load_codec_state(before)
        assert all(np.array_equal(before[k], r) for k, r in core.codec_state().items())
        with PSClient(ClientConfig(servers=cfg.servers, partition_bytes=16384,
                                   compress_min_bytes=0, push_codec=CodecConfig(name="sign1")))\
                as other:
            other.plan = plan
            other.load_residuals(saved)
            assert all(np.array_equal(saved[k], r) for k, r in other.residuals().items())
    finally:
        shard.stop(0)
