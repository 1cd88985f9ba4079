"""Compressed pulls for every codec (``ps.publish``): a shard compresses each update with its own
error feedback, applies the code to its own copy and publishes it; workers apply the codes and
hold the shard's parameters bit for bit. In-process shards on real sockets, worker threads."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, CodecConfig, Compressor
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.worker import ClientConfig, PSClient
from tests.encoding import EncodingClient

STEPS = 50


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _train(servers, plan, rank, codec, results, barrier):
    try:
        cfg = ClientConfig(servers=servers, rank=rank, world_size=2, partition_bytes=16384,
                           compress_min_bytes=4096, deadline_s=30,
                           push_codec=CodecConfig(name=codec, chunk=256))
        keys = [k.key for k in plan.keys]
        copy = [np.zeros(k.length, np.float32) for k in plan.keys]
        target = [np.linspace(-1, 1, k.length, dtype=np.float32) for k in plan.keys]
        rng = np.random.default_rng(rank)
        with EncodingClient(cfg) as client:
            client.register(plan, dict(zip(keys, copy)) if rank == 0 else None)
            barrier.wait()
            client.pull(keys, copy, clock=0).wait()
            for step in range(STEPS):
                grads = [(c - t + rng.standard_normal(c.shape[0]).astype(np.float32) * 0.1)
                         .astype(np.float32) for c, t in zip(copy, target)]
                client.push_pull(keys, grads, copy, clock=step).wait()
            barrier.wait()  # both have pushed everything: one last pull sees the end
            client.pull(keys, copy, clock=STEPS).wait()
            results[rank] = (_digest(copy), dict(client.versions),
                             client.metrics.pull_bytes.value)
    except BaseException as err:  # noqa: BLE001 - reported by the test thread
        results[rank] = err
        barrier.abort()


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("codec", ["sign1", "bf16", "sparse"])
def test_workers_hold_the_shards_parameters_bit_for_bit_after_50_steps(codec, mode):
    """Acceptance 4: the pull codec defaults to the push codec; "w" (64 KiB) pulls codes, "b"
    (1 KiB, under compress_min_bytes) float32 parameters."""
    shards = [create_server(ServerConfig(shard_id=i, num_shards=2, mode=mode, staleness=1,
                                         metrics_port=-1,
                                         optimizer=OptimizerConfig(name="adam", lr=0.01)))
              for i in range(2)]
    try:
        servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
        plan = make_plan([ParamSpec("w", (16384,)), ParamSpec("b", (256,))], num_shards=2,
                         partition_bytes=16384)
        results: dict = {}
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_train, args=(servers, plan, r, codec, results,
                                                         barrier)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for r in (0, 1):
            if isinstance(results.get(r), BaseException):
                raise results[r]
        slots = {k.key: s.core.slots[k.key] for s in shards for k in plan.keys
                 if k.key in s.core.slots}
        shard_digest = _digest(slots[k.key].param for k in plan.keys)
        for rank in (0, 1):
            digest, versions, pulled = results[rank]
            assert digest == shard_digest, f"worker {rank} differs from the shards"
            assert versions == {k: s.version for k, s in slots.items()}
            # over STEPS + 2 pulls "w"'s updates arrive as codes, never more bytes than its
            # parameters would take (async bf16: two workers' codes a step weigh as much, so
            # the parameters go then)
            share = 1.01 if codec == "bf16" and mode != "sync" else 0.75
            assert pulled < share * (STEPS + 2) * 4 * sum(k.length for k in plan.keys)
        w = [slots[k.key] for k in plan.keys if k.name == "w"]
        b = [slots[k.key] for k in plan.keys if k.name == "b"]
        assert all(s.publisher is not None and s.publisher.codec.name == codec for s in w)
        assert all(s.publisher is None for s in b)  # under compress_min_bytes: float32 pulls
        assert any(np.any(s.publisher.server.residual) for s in w)
    finally:
        for s in shards:
            s.stop(0)


def test_a_pull_codec_of_its_own_and_mismatched_workers_are_refused():
    """``pull_codec`` overrides the push codec's; every worker must pull alike (the shard's
    parameters follow one stream of codes per key)."""
    from bitps.proto.wire import PSError

    shard = create_server(ServerConfig(mode="async", metrics_port=-1,
                                       optimizer=OptimizerConfig(name="sgd", lr=0.1)))
    try:
        servers = (f"127.0.0.1:{shard.ports['grpc_port']}",)
        plan = make_plan([ParamSpec("w", (4096,))], num_shards=1)
        keys = [k.key for k in plan.keys]
        bf16 = ClientConfig(servers=servers, world_size=2, compress_min_bytes=0,
                            pull_codec=CodecConfig(name="bf16"))
        with EncodingClient(bf16) as client:
            client.register(plan, {keys[0]: np.ones(4096, np.float32)})
            out = np.empty(4096, np.float32)
            client.pull(keys, [out], clock=0).wait()
            client.push_pull(keys, [np.ones(4096, np.float32)], [out], clock=0).wait()
            assert client.metrics.push_wire_bytes.value == 4 * 4096  # pushes stay raw
            assert client.metrics.pull_bytes.value == 4 * 4096 + 2 * 4096  # then one bf16 code
            expect = np.ones(4096, np.float32)
            Codec.from_config(CodecConfig(name="bf16")).decode_add(
                Compressor(Codec.from_config(CodecConfig(name="bf16")), 4096).encode(
                    # lr 0.1 split over the world's 2 workers (ServerConfig.split_lr)
                    np.full(4096, -0.05, np.float32)), 4096, expect)
            assert np.array_equal(out, expect) and np.array_equal(shard.core.slots[0].param, out)
            other = ClientConfig(servers=servers, rank=1, world_size=2, compress_min_bytes=0,
                                 push_codec=CodecConfig(name="sign1"))
            with EncodingClient(other) as second, pytest.raises(PSError) as err:
                second.register(plan)
            assert err.value.code == pb.BAD_DTYPE and "pull" in str(err.value)
    finally:
        shard.stop(0)


def test_the_demo_moves_20x_fewer_bytes_with_sign1_in_sync():
    """Acceptance 4: in sync mode a worker's bytes per step for sign1 (pushes + pulls, from its
    byte counters) are >= 20x below fp32's on the demo model with compress_min_bytes=0."""
    torch = pytest.importorskip("torch")
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn
    from bitps.worker.training.model import PSModel

    torch.set_num_threads(1)
    demo = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    corpus = load_corpus(demo.corpus_bytes)

    def per_step(codec: str) -> float:
        shard = create_server(ServerConfig(mode="sync", metrics_port=-1,
                                           optimizer=OptimizerConfig(name="adam", lr=3e-3)))
        try:
            model = build_model(demo)
            client = PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                                           compress_min_bytes=0,
                                           push_codec=CodecConfig(name=codec)))
            ps_model = PSModel(model, client)
            m = client.metrics
            start = m.push_wire_bytes.value + m.pull_bytes.value  # registration's pull
            data = batches(corpus, batch_size=4, seq_len=32, rank=0, world_size=1, seed=0)
            for _ in range(6):
                loss_fn(model, *next(data)).backward()
                ps_model.step()
            ps_model.synchronize()
            moved = m.push_wire_bytes.value + m.pull_bytes.value - start
            ps_model.close()
            return moved / 6
        finally:
            shard.stop(0)

    fp32, sign1 = per_step("raw"), per_step("sign1")
    assert fp32 == 2 * 4 * sum(p.numel() for p in build_model(demo).parameters())
    assert fp32 / sign1 >= 20, f"fp32 {fp32:.0f} B/step, sign1 {sign1:.0f} B/step"


def test_overlap_with_compressed_pulls_keeps_the_model_bit_identical_to_the_shard():
    """Compressed pulls applied by the communication thread while the next forward runs (the
    CPU path: codes added straight into the parameters; ``bench/gpu_check.py`` runs the CUDA
    path, pinned host copies then uploads)."""
    pytest.importorskip("torch")
    from bitps.bench.gpu_check import pulled_copies_match

    started = []

    def shard():
        s = create_server(ServerConfig(mode="async", metrics_port=-1,
                                       optimizer=OptimizerConfig(name="adam", lr=3e-3)))
        started.append(s)
        return f"127.0.0.1:{s.ports['grpc_port']}", s.core

    try:
        assert pulled_copies_match(shard) == []
    finally:
        for s in started:
            s.stop(0)
