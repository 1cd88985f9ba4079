"""Registration with value digests (``RegisterRequest.value_digests``): a worker whose values
already equal the shard's is told so and skips its first pull; one that differs pulls. In-process
shards on real sockets."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import CodecConfig
from bitps.proto.keyplan import ParamSpec, make_plan, value_digest
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import ServerConfig, create_server
from bitps.worker import ClientConfig, PSClient
from tests.encoding import EncodingClient

torch = pytest.importorskip("torch")


def _servers(shards) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)


def test_matching_copies_skip_the_first_pull_and_later_codes_apply_to_them():
    """sync, sign1 pulls: rank 1 holds rank 0's values except in one key. Only that key is
    pulled; the others count as received at version 0, so the next step's codes (sent against
    version 0) bring both workers to the shards' parameters bit for bit."""
    shards = [create_server(ServerConfig(shard_id=i, num_shards=2, mode="sync", metrics_port=-1))
              for i in range(2)]
    try:
        plan = make_plan([ParamSpec("w", (20_000,)), ParamSpec("b", (300,))], num_shards=2,
                         partition_bytes=16384)
        keys = [k.key for k in plan.keys]
        rng = np.random.default_rng(0)
        init = [rng.standard_normal(k.length).astype(np.float32) for k in plan.keys]
        copies = [[a.copy() for a in init] for _ in range(2)]
        copies[1][1][:] = 7.0  # rank 1 differs in key 1 only
        results: dict[int, object] = {}

        def work(rank: int) -> None:
            cfg = ClientConfig(servers=_servers(shards), rank=rank, world_size=2,
                               partition_bytes=16384, compress_min_bytes=4096, deadline_s=30,
                               push_codec=CodecConfig(name="sign1", chunk=256))
            mine = copies[rank]
            try:
                with EncodingClient(cfg) as client:
                    client.register(plan, dict(zip(keys, mine)) if rank == 0 else None,
                                    copies=dict(zip(keys, mine)))
                    received = dict(client.versions)
                    stale = [i for i, k in enumerate(keys) if k not in client.versions]
                    if stale:
                        client.pull([keys[i] for i in stale], [mine[i] for i in stale],
                                    clock=0).wait()
                    pulled = client.metrics.pull_bytes.value
                    grads = [np.full(k.length, 0.5 + rank, np.float32) for k in plan.keys]
                    client.push_pull(keys, grads, mine, clock=0).wait()
                    results[rank] = (received, pulled, dict(client.versions))
            except BaseException as err:  # noqa: BLE001 - reported below
                results[rank] = err

        threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for rank in (0, 1):
            assert not isinstance(results[rank], BaseException), results[rank]
        (got0, pulled0, _), (got1, pulled1, after1) = results[0], results[1]
        assert got0 == dict.fromkeys(keys, 0)  # rank 0's own values: nothing to pull
        assert pulled0 == 0
        assert got1 == {k: 0 for k in keys if k != keys[1]}
        assert pulled1 == plan.keys[1].length * 4  # the one differing key, float32
        by_key = {k: s.core.slots[k] for s in shards for k in keys if k in s.core.slots}
        assert after1 == {k: by_key[k].version for k in keys} == dict.fromkeys(keys, 1)
        for rank in (0, 1):
            for k, mine in zip(keys, copies[rank]):
                assert np.array_equal(mine, by_key[k].param), f"rank {rank} key {k}"
    finally:
        for s in shards:
            s.stop(0)


def test_psmodel_ranks_built_from_one_seed_pull_nothing_at_start():
    """Two ranks of the same seeded model: rank 1's copy matches, so it pulls nothing; a rank
    built from another seed pulls and ends with rank 0's values."""
    from bitps.worker.training.model import PSModel

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))

    shard = create_server(ServerConfig(mode="sync", metrics_port=-1))
    models, results = {0: build(0), 1: build(0), 2: build(1)}, {}

    def work(rank: int) -> None:
        cfg = ClientConfig(servers=_servers([shard]), rank=rank, world_size=3, deadline_s=30)
        try:
            client = PSClient(cfg)
            ps_model = PSModel(models[rank], client)
            results[rank] = client.metrics.pull_bytes.value
            ps_model.close()
        except BaseException as err:  # noqa: BLE001 - reported below
            results[rank] = err

    try:
        threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results[0] == 0 and results[1] == 0, results
        n = sum(p.numel() for p in models[0].parameters())
        assert results[2] == 4 * n
        for a, b in zip(models[0].parameters(), models[2].parameters()):
            assert torch.equal(a, b)
    finally:
        shard.stop(0)


def test_malformed_digests_are_refused_before_anything_is_kept():
    shard = create_server(ServerConfig(metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (100,))], num_shards=1)
        spec = plan.keys[0]
        req = pb.RegisterRequest(
            protocol=PROTOCOL, rank=0, world_size=1, signature=plan.signature, num_shards=1,
            shard_id=0, sends_values=True,
            keys=[pb.KeySpec(key=spec.key, name=spec.name, offset=spec.offset,
                             length=spec.length, dtype=pb.FLOAT32)],
            value_digests=[value_digest(np.zeros(100, np.float32))[:8]])
        with pytest.raises(PSError) as err:
            shard.core.register(req, {spec.key: np.zeros(100, np.float32).tobytes()})
        assert err.value.code == pb.BAD_HEADER
        assert "expected none or 1 of 16" in err.value.message
        assert not shard.core.slots and not shard.core.initialized.is_set()
    finally:
        shard.stop(0)
