"""Partial plans: pipeline stages as PS workers, each registering only its own stage's keys
(``KeyPlan.subset``), and shards that count, per key, only the workers that push it (sync
aggregation, the SSP bound, async's split learning rate), initialize per key, refuse a
conflicting spec or another model, and checkpoint and restore per-key state."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, Compressor
from bitps.proto.keyplan import (
    ParamSpec,
    PlanMismatchError,
    UnknownParametersError,
    make_plan,
)
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import checkpoint
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.onebit import OneBitConfig
from bitps.ps.shard import ShardCore

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


# -- the shard, in process (tests/test_shard_core.py's style: no sockets, a fake clock) ---------

# Stage 0's keys 0 and 1 are pushed by ranks 0 and 2 (its two replicas), stage 1's keys 2 and 3
# by ranks 1 and 3: rank r is replica r // 2 of stage r % 2, world size 4.
STAGE_KEYS = ({0: 6, 1: 10}, {2: 8, 3: 4})
ALL_KEYS = {**STAGE_KEYS[0], **STAGE_KEYS[1]}
LR = 0.25
SGD = OptimizerConfig(name="sgd", lr=LR)
INIT = {k: ((np.arange(n) % 7 - 3) * 0.5 + k).astype(np.float32) for k, n in ALL_KEYS.items()}
_ids = itertools.count(1)
INCARNATION = 0x9A27  # the life id of the hand-built pushes (a push needs one: ps.dedup)


def _grad(rank: int, key: int, step: int = 0) -> np.ndarray:
    """Multiples of 1/4, so every SGD step here is exact in float32."""
    rng = np.random.default_rng([rank, key, step])
    return (rng.integers(-8, 9, ALL_KEYS[key]) * 0.25).astype(np.float32)


def _reg(rank: int, keys=None, *, world: int = 4, signature: str = "sig",
         values: bool | None = None, model_keys: int = 4, **fields) -> pb.RegisterRequest:
    keys = STAGE_KEYS[rank % 2] if keys is None else keys
    specs = [pb.KeySpec(key=k, name=f"p{k}", offset=0, length=n, dtype=pb.FLOAT32,
                        shape=pb.TensorShape(dims=[n])) for k, n in keys.items()]
    return pb.RegisterRequest(protocol=PROTOCOL, rank=rank, world_size=world,
                              signature=signature, num_shards=1, shard_id=0, keys=specs,
                              sends_values=rank < 2 if values is None else values,
                              model_keys=model_keys, **fields)


def _values(keys) -> dict[int, bytes]:
    return {k: INIT[k].tobytes() for k in keys}


def _core(mode: str = "sync", *, ranks=(0, 1, 2, 3), optimizer=SGD, **cfg):
    """A shard holding both stages' keys, ranks 0 and 1 (replica 0) initializing them."""
    t = [0.0]
    core = ShardCore(ServerConfig(mode=mode, optimizer=optimizer, **cfg), now=lambda: t[0])
    for r in ranks:
        core.register(_reg(r), _values(STAGE_KEYS[r % 2]) if r < 2 else {})
    return core, t


def _send(core, op, worker, clock, keys, grads=()):
    header = pb.DataHeader(op=op, worker=worker, clock=clock, keys=keys, protocol=PROTOCOL,
                           dtype=pb.FLOAT32, request_id=next(_ids), incarnation=INCARNATION)
    frames = [header.SerializeToString()]
    frames += [g if isinstance(g, bytes) else np.asarray(g, np.float32).tobytes() for g in grads]
    return core.handle(f"w{worker}".encode(), frames)


def _push(core, worker, clock, keys, step=None):
    step = clock if step is None else step
    (reply,) = _send(core, pb.PUSH, worker, clock, keys, [_grad(worker, k, step) for k in keys])
    assert reply.header.op == pb.REPLY, reply.header.message
    return reply


def test_sync_aggregates_each_key_over_its_own_pushers():
    core, _ = _core("sync")
    _push(core, 0, 0, [0, 1])
    assert [core.slots[k].version for k in (0, 1)] == [0, 0]  # rank 2 still owes its push
    _push(core, 2, 0, [0, 1])
    # stage 1 (ranks 1, 3) has pushed nothing: stage 0's step is complete regardless
    for k in (0, 1):
        slot = core.slots[k]
        assert slot.version == 1 and slot.pushers == {0, 2}
        expect = INIT[k] - LR * (_grad(0, k) + _grad(2, k)) / np.float32(2)
        assert np.array_equal(slot.param, expect), k
    assert [core.slots[k].version for k in (2, 3)] == [0, 0]
    (reply,) = _send(core, pb.PULL, 0, 1, [0, 1])
    assert reply.header.op == pb.REPLY and list(reply.header.versions) == [1, 1]
    # a pull of stage 1's keys for clock 1 waits for stage 1's pushers only
    assert _send(core, pb.PULL, 1, 1, [2]) == []
    assert core.consistency.waited_ranks(core.clocks, 1, [core.slots[2]]) == [1, 3]
    _push(core, 1, 0, [2, 3])
    assert core.consistency.waited_ranks(core.clocks, 1, [core.slots[2]]) == [3]
    assert "lacks pushes from workers [3]" in core.held_reasons()[1]
    (_, reply), = [(r.header.worker, r) for r in _push_and_release(core, 3, 0, [2, 3])]
    assert reply.header.op == pb.REPLY and reply.header.worker == 1
    for k in (2, 3):
        expect = INIT[k] - LR * (_grad(1, k) + _grad(3, k)) / np.float32(2)
        assert np.array_equal(core.slots[k].param, expect), k


def _push_and_release(core, worker, clock, keys):
    """Push and return the replies other than the push's own ack (released held pulls)."""
    header = pb.DataHeader(op=pb.PUSH, worker=worker, clock=clock, keys=keys,
                           protocol=PROTOCOL, dtype=pb.FLOAT32, request_id=next(_ids),
                           incarnation=INCARNATION)
    frames = [header.SerializeToString()] + [_grad(worker, k, clock).tobytes() for k in keys]
    return [r for r in core.handle(f"w{worker}".encode(), frames)
            if r.header.request_id != header.request_id]


def test_sync_step_of_a_key_equals_a_whole_plan_shard_of_its_pushers():
    """Stage 0's keys on a 4-rank partial-plan shard take the very steps a 2-rank whole-plan
    shard takes from the same pushes (ranks 0, 2 there are ranks 0, 1 here)."""
    partial, _ = _core("sync", optimizer=OptimizerConfig(name="adam", lr=0.01))
    t = [0.0]
    whole = ShardCore(ServerConfig(mode="sync", optimizer=OptimizerConfig(name="adam", lr=0.01)),
                      now=lambda: t[0])
    for r in (0, 1):
        whole.register(_reg(r, STAGE_KEYS[0], world=2, values=r == 0, model_keys=2),
                       _values(STAGE_KEYS[0]) if r == 0 else {})
    for step in range(3):
        for theirs, ours in ((0, 0), (2, 1)):
            _push(partial, theirs, step, [0, 1])
            (reply,) = _send(whole, pb.PUSH, ours, step, [0, 1],
                             [_grad(theirs, k, step) for k in (0, 1)])
            assert reply.header.op == pb.REPLY
    for k in (0, 1):
        assert partial.slots[k].version == whole.slots[k].version == 3
        assert np.array_equal(partial.slots[k].param, whole.slots[k].param), k


def test_a_rank_whose_plan_is_not_known_yet_is_waited_for():
    """Ranks of the world that have not registered may push any key: stage 0's step waits
    for stage 1's ranks until their plans (without stage 0's keys) are in."""
    core, _ = _core("sync", ranks=(0, 2))
    _push(core, 0, 0, [0, 1])
    _push(core, 2, 0, [0, 1])
    core.tick()
    assert core.slots[0].version == 0
    assert core.consistency.waited_ranks(core.clocks, 1, [core.slots[0]]) == [1, 3]
    core.register(_reg(1), _values(STAGE_KEYS[1]))
    core.tick()
    assert core.slots[0].version == 0  # rank 3 still unknown
    core.register(_reg(3), {})
    core.tick()
    assert [core.slots[k].version for k in (0, 1)] == [1, 1]
    assert np.array_equal(core.slots[0].param,
                          INIT[0] - LR * (_grad(0, 0) + _grad(2, 0)) / np.float32(2))


def test_a_key_outside_the_workers_plan_is_not_pushed():
    core, _ = _core("sync")
    (reply,) = _send(core, pb.PUSH, 0, 0, [2], [_grad(0, 2)])
    assert reply.header.error == pb.UNKNOWN_KEY and "[2]" in reply.header.message
    assert core.slots[2].pushed == set() and core.slots[2].version == 0


def test_leave_finishes_only_the_steps_that_waited_for_the_leaver():
    core, _ = _core("sync")
    _push(core, 0, 0, [0, 1])
    _push(core, 1, 0, [2, 3])
    core.leave(2)
    core.tick()
    assert [core.slots[k].version for k in (0, 1)] == [1, 1]  # rank 0's push alone
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * _grad(0, 0))
    assert [core.slots[k].version for k in (2, 3)] == [0, 0]  # still waits for rank 3


def test_ssp_holds_a_pull_only_for_the_slow_pusher_of_its_keys():
    core, _ = _core("ssp", staleness=1)
    # stage 0's ranks run ahead; stage 1's rank 3 stays at clock 0
    for step in range(2):
        for r in (0, 2):
            _push(core, r, step, [0, 1])
            (reply,) = _send(core, pb.PULL, r, step + 1, [0, 1])
            assert reply.header.op == pb.REPLY, (r, step, reply.header.message)
    _push(core, 1, 0, [2, 3])
    (reply,) = _send(core, pb.PULL, 1, 1, [2, 3])
    assert reply.header.op == pb.REPLY
    # rank 0 pulls for clock 3: needs stage 0's rank 2 at >= 2 (it is), whatever rank 3 does
    _push(core, 0, 2, [0, 1])
    (reply,) = _send(core, pb.PULL, 0, 3, [0, 1])
    assert reply.header.op == pb.REPLY
    # the bound holds over the keys' pushers: rank 2 at 2
    assert core.admissions[-1][:3] == (0, 3, 2) and reply.header.min_clock == 2
    # rank 1 pulls stage 1's keys for clock 2: needs rank 3 at >= 1; held for rank 3 alone
    _push(core, 1, 1, [2, 3])
    assert _send(core, pb.PULL, 1, 2, [2, 3]) == []
    (h,) = list(core.held)
    assert core.consistency.waited_ranks(core.clocks, h.clock, h.slots) == [3]
    reason = core.held_reasons()[1]
    assert reason.endswith("behind: worker 3 at 0")
    # rank 0, four clocks ahead of rank 3, is held by its own stage's rank 2 only, and is
    # released past rank 1's lower-clock pull that still waits
    _push(core, 0, 3, [0, 1])
    assert _send(core, pb.PULL, 0, 4, [0, 1]) == []
    assert core.consistency.waited_ranks(core.clocks, 4, [core.slots[0]]) == [2]
    _push(core, 2, 2, [0, 1])
    released = [r for r in _send(core, pb.PULL, 2, 3, [0, 1]) if r.header.worker == 0]
    assert len(released) == 1 and released[0].header.op == pb.REPLY
    assert [h.header.worker for h in core.held] == [1]  # still waits for rank 3
    assert all(a.clock - a.min_clock <= 1 for a in core.admissions)


@pytest.mark.parametrize("split_lr", [True, False])
def test_async_split_lr_divides_over_the_keys_pushers(split_lr):
    core, _ = _core("async", split_lr=split_lr)
    _push(core, 0, 0, [0])
    _push(core, 1, 0, [2])
    share = np.float32(0.5 if split_lr else 1.0)  # two pushers per key, not four workers
    assert np.array_equal(core.slots[0].param, INIT[0] - LR * share * _grad(0, 0))
    assert np.array_equal(core.slots[2].param, INIT[2] - LR * share * _grad(1, 2))


def test_keys_initialize_per_stage_and_pulls_before_get_not_initialized():
    t = [0.0]
    core = ShardCore(ServerConfig(mode="sync", optimizer=SGD), now=lambda: t[0])
    core.register(_reg(0), _values(STAGE_KEYS[0]))
    core.register(_reg(3), {})  # stage 1's replica 1, before replica 0's values
    assert not core.initialized.is_set() and core.uninitialized_keys() == 2
    assert core.keys_initialized([0, 1]) and not core.keys_initialized([2])
    for op, grads in ((pb.PULL, []), (pb.PUSH, [_grad(3, 2)])):
        (reply,) = _send(core, op, 3, 0, [2], grads)
        assert reply.header.error == pb.NOT_INITIALIZED and "[2]" in reply.header.message
    (reply,) = _send(core, pb.PULL, 0, 0, [0, 1])
    assert reply.header.op == pb.REPLY
    core.register(_reg(1), _values(STAGE_KEYS[1]))
    assert core.initialized.is_set() and core.uninitialized_keys() == 0
    (reply,) = _send(core, pb.PULL, 3, 0, [2, 3])
    assert np.array_equal(np.frombuffer(reply.payload[0], np.float32), INIT[2])
    # a restarted initializer does not reset its keys
    _push(core, 1, 0, [2, 3])
    _push(core, 3, 0, [2, 3])
    trained = core.slots[2].param.copy()
    core.register(_reg(1), _values(STAGE_KEYS[1]))
    assert np.array_equal(core.slots[2].param, trained)


def test_wait_initialized_wakes_when_the_keys_land():
    t = [0.0]
    core = ShardCore(ServerConfig(mode="sync", optimizer=SGD), now=lambda: t[0])
    core.register(_reg(2), {})
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(core.wait_initialized([0, 1], 10)))
    waiter.start()
    time.sleep(0.1)
    assert not woke
    core.register(_reg(0), _values(STAGE_KEYS[0]))
    waiter.join(timeout=10)
    assert woke == [True]
    assert core.wait_initialized([], 0)  # no keys here: nothing to wait for


def test_a_conflicting_spec_is_refused_naming_the_key_and_both_specs():
    core, _ = _core("sync", ranks=(0, 1))
    before = {k: (s.param.copy(), set(s.pushers)) for k, s in core.slots.items()}
    with pytest.raises(PSError) as err:
        core.register(_reg(2, {0: 7, 1: 10}), {})
    assert err.value.code == pb.BAD_HEADER
    msg = err.value.message
    assert "key 0" in msg and "p0[0:7]" in msg and "p0[0:6]" in msg and "shape [7]" in msg
    assert not core.clocks.is_registered(2)
    assert {k: set(s.pushers) for k, s in core.slots.items()} == {k: p for k, (_, p)
                                                                   in before.items()}


def test_another_model_is_refused():
    core, _ = _core("sync", ranks=(0,))
    with pytest.raises(PSError) as err:
        core.register(_reg(1, signature="other"), {})
    assert err.value.code == pb.BAD_HEADER and "'other'" in err.value.message
    with pytest.raises(PSError) as err:
        core.register(_reg(1, model_keys=5), {})
    assert err.value.code == pb.BAD_HEADER and "5 keys" in err.value.message
    with pytest.raises(PSError) as err:
        core.register(_reg(1, {2: 8, 9: 4}), {})
    assert err.value.code == pb.UNKNOWN_KEY and "key 9" in err.value.message
    assert sorted(core.slots) == [0, 1] and not core.clocks.is_registered(1)


def test_limits_count_the_union_of_the_plans():
    core, _ = _core("sync", ranks=(0,), max_plan_keys=3)
    with pytest.raises(PSError) as err:
        core.register(_reg(1), _values(STAGE_KEYS[1]))
    assert err.value.code == pb.LIMIT and "4 with those it holds" in err.value.message
    core.register(_reg(2), {})  # stage 0's keys again: nothing new
    assert sorted(core.slots) == [0, 1]


def test_checkpoint_of_a_partial_plan_shard_restores_and_continues_alike(tmp_path):
    core, t = _core("sync")
    _push(core, 0, 0, [0, 1])
    _push(core, 2, 0, [0, 1])
    _push(core, 1, 0, [2, 3])  # stage 1's step 0 half done: rank 3 owes its push
    path = checkpoint.save(core, tmp_path, keep=1)
    fresh = ShardCore(ServerConfig(mode="sync", optimizer=SGD), now=lambda: t[0])
    checkpoint.restore(fresh, checkpoint.load(path))
    assert {k: s.pushers for k, s in fresh.slots.items()} == {0: {0, 2}, 1: {0, 2},
                                                               2: {1, 3}, 3: {1, 3}}
    assert fresh.initialized.is_set() and fresh.partial and fresh.model_keys == 4
    for c in (core, fresh):
        _push(c, 3, 0, [2, 3])
        _push(c, 0, 1, [0, 1])
        _push(c, 2, 1, [0, 1])
    for k in ALL_KEYS:
        assert core.slots[k].version == fresh.slots[k].version
        assert np.array_equal(core.slots[k].param, fresh.slots[k].param), k
    assert [fresh.slots[k].version for k in (0, 2)] == [2, 1]


def test_checkpoint_with_uninitialized_keys_restores_them_uninitialized(tmp_path):
    t = [0.0]
    core = ShardCore(ServerConfig(mode="sync", optimizer=SGD), now=lambda: t[0])
    core.register(_reg(0), _values(STAGE_KEYS[0]))
    core.register(_reg(3), {})
    fresh = ShardCore(ServerConfig(mode="sync", optimizer=SGD), now=lambda: t[0])
    checkpoint.restore(fresh, checkpoint.load(checkpoint.save(core, tmp_path, keep=1)))
    assert not fresh.initialized.is_set() and fresh.keys_initialized([0, 1])
    assert not fresh.keys_initialized([2, 3])


def test_onebit_adam_sync_averages_each_key_over_its_pushers():
    """sync 1-bit Adam (DeepSpeed's layout): warmup, the freeze, and compressed steps of stage
    0's keys on the partial-plan shard equal those of a 2-rank whole-plan shard; the
    RuleState a stage's worker fetches holds its own keys only."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01,
                          rule_config=OneBitConfig(freeze_step=2, chunk=64))
    partial, _ = _core("sync", optimizer=opt)
    t = [0.0]
    whole = ShardCore(ServerConfig(mode="sync", optimizer=opt), now=lambda: t[0])
    for r in (0, 1):
        whole.register(_reg(r, STAGE_KEYS[0], world=2, values=r == 0, model_keys=2),
                       _values(STAGE_KEYS[0]) if r == 0 else {})
    sign1 = Codec(pb.CODEC_SIGN1, 64)
    comps = {(r, k): Compressor(sign1, ALL_KEYS[k]) for r in (0, 2) for k in (0, 1)}
    for step in range(4):
        for theirs, ours in ((0, 0), (2, 1)):
            if step < opt.rule_config.freeze_step:
                grads = [_grad(theirs, k, step).tobytes() for k in (0, 1)]
                fields = {}
            else:  # momenta, as the workers push them after the freeze
                grads = [bytes(comps[theirs, k].encode(_grad(theirs, k, step)))
                         for k in (0, 1)]
                fields = dict(zip(("codec", "codec_chunk", "codec_flags"),
                                  sign1.wire_fields()))
            for core, rank in ((partial, theirs), (whole, ours)):
                header = pb.DataHeader(op=pb.PUSH, worker=rank, clock=step, keys=[0, 1],
                                       protocol=PROTOCOL, dtype=pb.FLOAT32,
                                       request_id=next(_ids), incarnation=INCARNATION,
                                       **fields)
                (reply,) = core.handle(b"w", [header.SerializeToString(), *grads])
                assert reply.header.op == pb.REPLY, reply.header.message
        if step + 1 == opt.rule_config.freeze_step:
            states = partial.rule_state(0)
            assert sorted(s.key for s in states) == [0, 1]
            # stage 1's worker is told about its own keys, which are still in warmup
            with pytest.raises(PSError, match="key 2 is still in warmup"):
                partial.rule_state(1)
    for k in (0, 1):
        a, b = partial.slots[k], whole.slots[k]
        assert a.rule_state.compressing and a.version == b.version == 4
        assert np.array_equal(a.param, b.param), k
        assert np.array_equal(a.state.buf1, b.state.buf1), k


# -- real processes: 2 stages x 2 replicas through 2 shards ---------------------------------------

_STAGE_WORKER = r"""
import sys
import numpy as np
import torch
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.worker import ClientConfig, PSClient, PSModel
from bitps.worker.config import OverlapConfig
from tests.encoding import EncodingClient

rank, servers, out, steps = int(sys.argv[1]), tuple(sys.argv[2].split(",")), sys.argv[3], 3
stage, replica = rank % 2, rank // 2
full = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
names = [n for n, _ in full.named_parameters()]
plan = make_plan([ParamSpec(n, tuple(p.shape)) for n, p in full.named_parameters()],
                 num_shards=len(servers), partition_bytes=1024)
# the stage keeps the model's parameter names ("1.weight"), replica 1 starts from other values
module = torch.nn.Module()
module.add_module(str(stage), full[stage])
with torch.no_grad():
    for i, (n, p) in enumerate(module.named_parameters()):
        p.copy_(((torch.arange(p.numel()) % 9 - 4) * 0.25 + i + 10 * replica).reshape(p.shape))
cfg = ClientConfig(servers=servers, rank=rank, world_size=4, initializes=replica == 0,
                   partition_bytes=1024, deadline_s=30, register_timeout_s=60)
client = PSClient(cfg)
model = PSModel(module, client, plan=plan,
                overlap=OverlapConfig(mode="on" if stage else "off"))
assert not model.plan.partial or len(model.plan.keys) < len(plan.keys)
params = dict(module.named_parameters())
for step in range(steps):
    # a loss whose gradient is exactly g(rank, step) (multiples of 1/4)
    loss = 0
    for n, p in params.items():
        g = torch.tensor(np.random.default_rng([rank, names.index(n), step])
                         .integers(-8, 9, p.numel()) * 0.25, dtype=torch.float32)
        loss = loss + (p * g.reshape(p.shape)).sum()
    loss.backward()
    model.step()
model.synchronize()
np.savez(out, **{n: p.detach().numpy() for n, p in params.items()},
         keys=np.array([k.key for k in model.plan.keys]))
model.close()
"""


def test_two_stages_two_replicas_sync_through_two_shards(cluster, tmp_path):
    """Each stage process registers only its stage's keys; replica 0 of each stage sends the
    initial values (replica 1's own values are overwritten by the first pull). Every key's
    sync step is the average of its two pushers' gradients, on the shards and in every
    worker's parameters."""
    import os
    import subprocess
    import sys

    lr = 0.25
    shards = cluster(2, mode="sync", metrics_port=-1, heartbeat_timeout_s=30,
                     optimizer=OptimizerConfig(name="sgd", lr=lr))
    servers = ",".join(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -X faulthandler: a process that dies on a signal prints every thread's stack
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _STAGE_WORKER,
                               str(r), servers,
                               str(tmp_path / f"rank{r}.npz")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * 4, outs
    torch = pytest.importorskip("torch")
    full = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
    names = [n for n, _ in full.named_parameters()]
    results = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(4)]
    slots = {k: s.core.slots[k] for s in shards for k in s.core.slots}
    plan = make_plan([ParamSpec(n, tuple(p.shape)) for n, p in full.named_parameters()],
                     num_shards=2, partition_bytes=1024)
    assert sorted(slots) == [k.key for k in plan.keys]
    for stage in (0, 1):
        mine = plan.subset(n for n in names if n.startswith(f"{stage}."))
        ranks = (stage, stage + 2)
        for r in ranks:
            assert results[r]["keys"].tolist() == [k.key for k in mine.keys]
        for k in mine.keys:
            assert slots[k.key].pushers == set(ranks) and slots[k.key].version == 3
        for i, (n, p) in enumerate((n, p) for n, p in full.named_parameters()
                                   if n.startswith(f"{stage}.")):
            expect = ((np.arange(p.numel()) % 9 - 4) * 0.25 + i).astype(np.float32)
            for step in range(3):
                g = [np.random.default_rng([r, names.index(n), step]).integers(
                    -8, 9, p.numel()) * 0.25 for r in ranks]
                expect -= np.float32(lr) * ((g[0] + g[1]) / 2).astype(np.float32)
            shard_value = np.concatenate([slots[k.key].param for k in mine.keys
                                          if k.name == n])
            assert np.array_equal(shard_value, expect), n
            for r in ranks:
                assert np.array_equal(results[r][n].reshape(-1), expect), (r, n)


def test_stages_with_compressed_pushes_and_pulls_async(cluster):
    """async, sign1 pushes and sign1 pulls: four stage workers (threads, real sockets) each
    push and pull their own stage's keys; after a last pull every worker's copies equal the
    shards' parameters bit for bit, and each key was updated by its two pushers only."""
    from bitps.proto.codecs import CodecConfig
    from bitps.worker import ClientConfig
    from tests.encoding import EncodingClient

    shards = cluster(2, mode="async", metrics_port=-1, split_lr=True,
                     optimizer=OptimizerConfig(name="sgd", lr=0.01))
    servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
    model = [ParamSpec("a.w", (64, 64)), ParamSpec("a.b", (64,)), ParamSpec("b.w", (32, 64)),
             ParamSpec("b.b", (32,))]
    plan = make_plan(model, num_shards=2, partition_bytes=4096)
    parts = [plan.subset(names) for names in (("a.w", "a.b"), ("b.w", "b.b"))]
    init = {k.key: np.linspace(-1, 1, k.length, dtype=np.float32) + k.key for k in plan.keys}
    steps, results = 4, {}

    def work(rank: int) -> None:
        part = parts[rank % 2]
        cfg = ClientConfig(servers=servers, rank=rank, world_size=4, initializes=rank < 2,
                           partition_bytes=4096, compress_min_bytes=1024, deadline_s=30,
                           push_codec=CodecConfig(name="sign1", chunk=256),
                           pull_codec=CodecConfig(name="sign1", chunk=256))
        keys = [k.key for k in part.keys]
        mine = {k: init[k].copy() for k in keys}
        try:
            with EncodingClient(cfg) as client:
                client.register(part, mine if rank < 2 else None, copies=mine)
                rng = np.random.default_rng(rank)
                for step in range(steps):
                    grads = [rng.standard_normal(len(mine[k])).astype(np.float32)
                             for k in keys]
                    client.push_pull(keys, grads, [mine[k] for k in keys], clock=step).wait()
                results[rank] = mine
        except BaseException as err:  # noqa: BLE001 - reported below
            results[rank] = err

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    for rank in range(4):
        assert not isinstance(results.get(rank), BaseException), results.get(rank)
    slots = {k: s.core.slots[k] for s in shards for k in s.core.slots}
    for rank in range(4):
        part = parts[rank % 2]
        mine = results[rank]
        for k in part.keys:
            slot = slots[k.key]
            assert slot.pushers == {rank % 2, rank % 2 + 2}
            assert slot.version == 2 * steps
            assert (slot.publisher is not None) == k.name.endswith(".w")  # biases: < 1 KiB
        # one more pull brings this worker's copies to the shards' parameters exactly
        cfg = ClientConfig(servers=servers, rank=rank, world_size=4, initializes=False,
                           partition_bytes=4096, compress_min_bytes=1024, deadline_s=30,
                           pull_codec=CodecConfig(name="sign1", chunk=256))
        keys = [k.key for k in part.keys]
        with EncodingClient(cfg) as client:
            client.register(part, None, copies=mine)
            client.pull(keys, [mine[k] for k in keys], clock=steps).wait()
        for k in keys:
            assert np.array_equal(mine[k], slots[k].param), (rank, k)


def test_a_shard_back_empty_gets_each_stages_keys_from_its_initializer():
    """A shard restarted with nothing (no checkpoint): every stage worker recovers it
    (``PSClient.complete``); replica 0 of each stage re-sends its own keys' copies as initial
    values, and replica 1 waits for them (``NOT_INITIALIZED`` is retried)."""
    import dataclasses

    from bitps.ps.server import ServerShard
    from bitps.worker import ClientConfig, PSClient

    cfg = dict(mode="sync", metrics_port=-1, heartbeat_timeout_s=30,
               optimizer=OptimizerConfig(name="sgd", lr=0.25))
    model = [ParamSpec("a.w", (16, 32)), ParamSpec("a.b", (16,)), ParamSpec("b.w", (16, 32)),
             ParamSpec("b.b", (16,))]
    shards = [ServerShard(ServerConfig(shard_id=i, num_shards=2, **cfg)).start()
              for i in range(2)]
    try:
        servers = tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)
        plan = make_plan(model, num_shards=2, partition_bytes=1024)
        parts = [plan.subset(names) for names in STAGES]
        assert all({k.shard for k in part.keys} == {0, 1} for part in parts)
        barrier, results = threading.Barrier(5, timeout=60), {}

        def work(rank: int) -> None:
            part = parts[rank % 2]
            keys = [k.key for k in part.keys]
            mine = {k.key: np.full(k.length, k.key + 0.25, np.float32) for k in part.keys}
            client = PSClient(ClientConfig(
                servers=servers, rank=rank, world_size=4, initializes=rank < 2,
                partition_bytes=1024, deadline_s=0.5, reconnect_timeout_s=20,
                reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2, heartbeat_s=0.2))
            try:
                client.register(part, mine if rank < 2 else None, copies=mine)
                grads = [np.ones(k.length, np.float32) for k in part.keys]
                client.push_pull(keys, grads, [mine[k] for k in keys], clock=0).wait()
                barrier.wait()  # shard 1 goes down and comes back empty
                barrier.wait()
                handle = client.push_pull(keys, grads, [mine[k] for k in keys], clock=1)
                client.complete(handle, mine)
                results[rank] = {k: v.copy() for k, v in mine.items()}
            except BaseException as err:  # noqa: BLE001 - reported below
                results[rank] = err
                barrier.abort()
            finally:
                client.close()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        barrier.wait()
        old = shards[1]
        old.stop(0)
        time.sleep(1.2)  # past the workers' deadline, and the ports are free again
        shards[1] = ServerShard(dataclasses.replace(
            old.cfg, grpc_port=old.ports["grpc_port"], data_port=old.ports["data_port"])).start()
        barrier.wait()
        for t in threads:
            t.join(timeout=60)
        for rank in range(4):
            assert not isinstance(results.get(rank), BaseException), results.get(rank)
        core = shards[1].core
        assert core.initialized.is_set() and sorted(core.slots) == [
            k.key for k in plan.for_shard(1)]
        for k in plan.for_shard(1):
            stage = 0 if k.name.startswith("a.") else 1
            assert core.slots[k.key].pushers == {stage, stage + 2}
            # the initializer's copy after sync step 0 (the mean of two pushes of ones, lr
            # 0.25), then step 1 on the shard that came back with that copy
            expect = np.full(k.length, k.key + 0.25 - 0.25 - 0.25, np.float32)
            assert np.array_equal(core.slots[k.key].param, expect), k
    finally:
        for s in shards:
            s.stop(0)


def test_psmodel_binds_a_stage_by_name_and_refuses_what_the_plan_lacks():
    """Checked before any connection: a parameter the whole plan does not have, or of another
    shape, is a typed error naming it."""
    torch = pytest.importorskip("torch")
    from bitps.worker import ClientConfig, PSClient, PSModel

    full = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plan = make_plan([ParamSpec(n, tuple(p.shape)) for n, p in full.named_parameters()],
                     num_shards=1)
    with PSClient(ClientConfig(servers=("127.0.0.1:9",))) as client:
        other = torch.nn.Module()
        other.add_module("2", torch.nn.Linear(8, 2))  # "2.weight": not in the plan
        with pytest.raises(UnknownParametersError, match=r"\['2.bias', '2.weight'\]"):
            PSModel(other, client, plan=plan)
        wrong = torch.nn.Module()
        wrong.add_module("1", torch.nn.Linear(8, 3))
        with pytest.raises(PlanMismatchError, match=r"'1.weight' is float32\[3, 8\]"):
            PSModel(wrong, client, plan=plan)
    # who sends initial values follows ClientConfig.initializes, not the rank
    with PSClient(ClientConfig(servers=("127.0.0.1:9",), initializes=False)) as client:
        with pytest.raises(ValueError, match="rank 0 must not pass initial values"):
            client.register(plan, {k.key: np.zeros(k.length, np.float32) for k in plan.keys})
    with PSClient(ClientConfig(servers=("127.0.0.1:9",), rank=2, world_size=4,
                               initializes=True)) as client:
        assert client.initializes


def test_async_lookahead_counts_the_keys_other_pushers():
    core, _ = _core("async", lookahead=True, split_lr=False)
    _push(core, 0, 0, [0])
    delta = core.slots[0].last_delta.copy()
    assert np.array_equal(delta, -LR * _grad(0, 0))
    (reply,) = _send(core, pb.PULL, 2, 1, [0])
    # one other pusher of key 0 (rank 2's peer), not three other workers
    got = np.frombuffer(reply.payload[0], np.float32)
    assert np.array_equal(got, core.slots[0].param + delta)


def test_a_replayed_stage_push_is_applied_once():
    core, _ = _core("sync")
    for r in (0, 2):
        header = pb.DataHeader(op=pb.PUSH, worker=r, clock=0, keys=[0], protocol=PROTOCOL,
                               dtype=pb.FLOAT32, request_id=7, incarnation=99 + r)
        frames = [header.SerializeToString(), _grad(r, 0).tobytes()]
        for _ in range(2):  # the second is a replay: answered, not applied
            (reply,) = core.handle(b"w", frames)
            assert reply.header.op == pb.REPLY, reply.header.message
    assert core.slots[0].version == 1 and core.updates_applied == 1
    assert np.array_equal(core.slots[0].param,
                          INIT[0] - LR * (_grad(0, 0) + _grad(2, 0)) / np.float32(2))
