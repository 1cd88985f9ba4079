"""Tests for proto.keyplan: determinism, signature, exact coverage, key order, balance, errors."""

from __future__ import annotations

import dataclasses

import pytest

from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES, ParamSpec, make_plan

PARAMS = [
    ParamSpec("embed", (300, 70)),
    ParamSpec("bias", (7,)),
    ParamSpec("w", (1024, 1024)),
    ParamSpec("empty", (0, 5)),
    ParamSpec("half", (999, 3), "float16"),
    ParamSpec("bf", (4097,), "bfloat16"),
]


def _covers(plan, params):
    for p in params:
        keys = [k for k in plan.keys if k.name == p.name]
        if p.numel == 0:
            assert keys == []
            continue
        offsets = [k.offset for k in keys]
        assert offsets[0] == 0
        for a, b in zip(keys, keys[1:]):
            assert b.offset == a.offset + a.length
        assert sum(k.length for k in keys) == p.numel
        assert all(k.length > 0 and k.dtype == p.dtype for k in keys)
        # near-equal cuts: lengths differ by at most one element
        assert max(k.length for k in keys) - min(k.length for k in keys) <= 1


@pytest.mark.parametrize("partition_bytes", [1024, 4096, 1 << 20, DEFAULT_PARTITION_BYTES])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5])
def test_partitions_cover_each_tensor_exactly(num_shards, partition_bytes):
    plan = make_plan(PARAMS, num_shards=num_shards, partition_bytes=partition_bytes)
    _covers(plan, PARAMS)
    assert all(k.nbytes <= partition_bytes for k in plan.keys)
    assert all(0 <= k.shard < num_shards for k in plan.keys)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}
    assert sum(plan.shard_bytes()) == sum(p.numel * itemsize[p.dtype] for p in PARAMS)
    assert plan.num_shards == num_shards and plan.partition_bytes == partition_bytes


def test_keys_numbered_in_parameter_order():
    plan = make_plan(PARAMS, num_shards=3, partition_bytes=4096)
    assert [k.key for k in plan.keys] == list(range(len(plan.keys)))
    order = {p.name: i for i, p in enumerate(PARAMS)}
    seq = [(order[k.name], k.offset) for k in plan.keys]
    assert seq == sorted(seq)
    for s in range(3):
        assert plan.for_shard(s) == tuple(k for k in plan.keys if k.shard == s)
    assert sum(len(plan.for_shard(s)) for s in range(3)) == len(plan.keys)


def test_docstring_example():
    plan = make_plan([ParamSpec("w", (1024, 1024))], num_shards=2, partition_bytes=1 << 20)
    assert [k.length for k in plan.keys] == [262144] * 4
    assert [k.offset for k in plan.keys] == [0, 262144, 524288, 786432]
    assert plan.shard_bytes() == [2 << 20, 2 << 20]
    assert plan.imbalance() == 1.0


def test_default_partitions_are_at_most_1_mib():
    plan = make_plan([ParamSpec("w", (3 << 20,))], num_shards=2)  # 12 MiB
    assert len(plan.keys) == 12 and {k.nbytes for k in plan.keys} == {1 << 20}


def test_plan_is_deterministic():
    a = make_plan(PARAMS, num_shards=3, partition_bytes=4096)
    b = make_plan(list(PARAMS), num_shards=3, partition_bytes=4096)
    assert a == b
    assert a.signature == b.signature
    assert len(a.signature) == 32 and int(a.signature, 16) >= 0


def test_signature_changes_with_any_input():
    base = make_plan(PARAMS, num_shards=2, partition_bytes=4096).signature
    reshaped = [dataclasses.replace(PARAMS[0], shape=(70, 300))] + PARAMS[1:]
    renamed = [dataclasses.replace(PARAMS[0], name="embed2")] + PARAMS[1:]
    retyped = [dataclasses.replace(PARAMS[0], dtype="float16")] + PARAMS[1:]
    variants = [
        make_plan(reshaped, num_shards=2, partition_bytes=4096).signature,
        make_plan(renamed, num_shards=2, partition_bytes=4096).signature,
        make_plan(retyped, num_shards=2, partition_bytes=4096).signature,
        make_plan(PARAMS, num_shards=3, partition_bytes=4096).signature,
        make_plan(PARAMS, num_shards=2, partition_bytes=8192).signature,
        make_plan(PARAMS[::-1], num_shards=2, partition_bytes=4096).signature,
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)


def test_greedy_balance_largest_first():
    # sizes 5, 4, 3, 3, 2, 1 (x1024 float32) over 2 shards: LPT gives loads 9 and 9
    params = [ParamSpec(f"p{i}", (n * 256,)) for i, n in enumerate([5, 4, 3, 3, 2, 1])]
    plan = make_plan(params, num_shards=2, partition_bytes=1 << 20)
    assert [k.shard for k in plan.keys] == [0, 1, 1, 0, 1, 0]
    assert plan.shard_bytes() == [9 * 1024, 9 * 1024]


def test_more_shards_than_keys_leaves_empty_shards():
    plan = make_plan([ParamSpec("w", (10,))], num_shards=3, partition_bytes=1024)
    assert plan.shard_bytes() == [40, 0, 0]
    assert plan.imbalance() == 3.0


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_demo_model_is_balanced(num_shards):
    pytest.importorskip("transformers")
    from bitps.worker.demo import DemoConfig, build_model

    model = build_model(DemoConfig())
    params = [ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = make_plan(params, num_shards=num_shards)
    _covers(plan, params)
    assert plan.imbalance() <= 1.05
    assert sum(plan.shard_bytes()) == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("num_shards", [0, -1])
def test_rejects_bad_num_shards(num_shards):
    with pytest.raises(ValueError, match=f"num_shards must be >= 1, got {num_shards}"):
        make_plan(PARAMS, num_shards=num_shards)


def test_rejects_small_partition():
    with pytest.raises(ValueError, match="partition_bytes must be >= 1024, got 1000"):
        make_plan(PARAMS, num_shards=1, partition_bytes=1000)


def test_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        make_plan([ParamSpec("a", (4,)), ParamSpec("a", (8,))], num_shards=1)


def test_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="'x' has dtype 'int8'"):
        make_plan([ParamSpec("x", (4,), "int8")], num_shards=1)
