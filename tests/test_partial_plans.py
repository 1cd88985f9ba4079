"""Partial plans: pipeline stages as PS workers, each registering only its own stage's keys
(``KeyPlan.subset``), and shards that count, per key, only the workers that push it (sync
aggregation, the SSP bound, async's split learning rate), initialize per key, refuse a
conflicting spec or another model, and checkpoint and restore per-key state."""

from __future__ import annotations

import pytest

from bitps.proto.keyplan import (
    ParamSpec,
    PlanMismatchError,
    UnknownParametersError,
    make_plan,
)

# Two "stages" of one model: stage 0 holds a.*, stage 1 holds b.*.
MODEL = [ParamSpec("a.w", (8, 4)), ParamSpec("a.b", (8,)), ParamSpec("b.w", (4, 8)),
         ParamSpec("b.b", (4,))]
STAGES = (("a.w", "a.b"), ("b.w", "b.b"))


def test_subset_keeps_the_whole_models_ids_shards_and_signature():
    plan = make_plan(MODEL, num_shards=2, partition_bytes=1024)
    parts = [plan.subset(names) for names in STAGES]
    assert [k for p in parts for k in p.keys] == list(plan.keys)
    for part, names in zip(parts, STAGES):
        assert {k.name for k in part.keys} == set(names)
        assert part.signature == plan.signature and part.model_keys == len(plan.keys)
        assert part.partial and not plan.partial
        for k in part.keys:
            assert part.key(k.key) == plan.key(k.key) and k.key in part
    with pytest.raises(KeyError, match="key 0 is not in this plan"):
        parts[1].key(0)


def test_subset_of_unknown_names_names_them():
    plan = make_plan(MODEL, num_shards=1)
    with pytest.raises(UnknownParametersError, match=r"\['c.w', 'z'\]") as err:
        plan.subset(["a.w", "z", "c.w"])
    assert err.value.names == ["c.w", "z"] and err.value.known == 4


def test_bind_refuses_another_shape():
    plan = make_plan(MODEL, num_shards=1)
    assert plan.bind([ParamSpec("b.w", (4, 8))]).keys == plan.subset(["b.w"]).keys
    with pytest.raises(PlanMismatchError, match=r"'b.w' is float32\[8, 4\].*float32\[4, 8\]"):
        plan.bind([ParamSpec("b.w", (8, 4))])
