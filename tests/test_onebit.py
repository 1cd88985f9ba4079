"""1-bit Adam through real sockets: in-process shards on port 0, two PSClients on threads.

After warmup the shards publish sign1-compressed updates and workers add them to their own
copies; the copies must stay bit-identical to the shard's parameters (hash compared), and both
directions must carry about one bit per element."""

from __future__ import annotations

import contextlib
import hashlib
import threading

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bitps import native
from bitps.native import sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, CodecConfig, Compressor
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.schedule import LRSchedule
from bitps.proto.wire import PSError
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.ps.onebit import OneBitConfig
from bitps.ps.publish import Publisher
from bitps.worker import ClientConfig
from tests.encoding import EncodingClient

N = 20_000
FREEZE = 10
STEPS = 50


@contextlib.contextmanager
def _three_steps(shard):
    """Rank 0 alone on ``shard`` (16 KiB keys, everything compressed) after three push_pulls
    of seeded gradients: yields ``(client, plan, keys, outs)``."""
    plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=16384)
    keys = [k.key for k in plan.keys]
    copy = np.zeros(N, np.float32)
    outs = [copy[k.offset:k.offset + k.length] for k in plan.keys]
    cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                       partition_bytes=16384, compress_min_bytes=0)
    grads = [np.random.default_rng(k).standard_normal(len(o)).astype(np.float32)
             for k, o in zip(keys, outs)]
    with EncodingClient(cfg) as client:
        client.register(plan, dict(zip(keys, outs)))
        for step in range(3):
            client.push_pull(keys, grads, outs, clock=step).wait()
        yield client, plan, keys, outs


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
    with EncodingClient(cfg) as client:
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


@pytest.mark.parametrize(("mode", "moments", "scheduled", "warmup", "compact", "window"), [
    ("async", "auto", False, None, False, "steps"),
    ("async", "shard", False, None, False, "steps"),
    ("sync", "auto", False, None, True, "steps"),
    # m and v fetched at the switch as float32, not m's code and bf16 v
    ("sync", "auto", False, None, False, "steps"),
    # sync workers apply published momenta with the shard's scheduled learning rate
    ("sync", "auto", True, None, True, "steps"),
    # the warmup's Adam updates published as sign1 codes: sync switches from parameter-update
    # codes to momentum codes at freeze_step
    ("sync", "auto", True, "sign1", True, "steps"),
    ("sync", "auto", True, "sign1", False, "steps"),
    ("async", "auto", False, "sign1", False, "steps"),
    # and as bf16 codes: the publisher turns to sign1 at the switch
    ("sync", "auto", True, "bf16", True, "steps"),
    ("async", "auto", False, "bf16", False, "steps"),
    # each worker's momentum spans the shard's updates (beta1**2 per push)
    ("async", "auto", False, None, False, "updates")])
def test_workers_hold_the_shards_parameters_bit_for_bit(mode, moments, scheduled, warmup,
                                                        compact, window):
    schedule = LRSchedule(warmup_steps=3, decay_steps=STEPS, min_ratio=0.1) if scheduled \
        else LRSchedule()
    opt = OptimizerConfig(name="onebit_adam", lr=0.05,
                          delta_history=4 if mode == "async" else 16, schedule=schedule,
                          rule_config=OneBitConfig(freeze_step=FREEZE, chunk=256,
                                                   moments=moments,
                                                   warmup_codes=warmup is not None,
                                                   warmup_codec=warmup or "sign1",
                                                   compact_state=compact,
                                                   momentum_window=window))
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
            if warmup == "sign1" and mode == "sync":
                # one float32 pull (the first); every later one carries codes
                assert pulled < 4 * N + 52 * N / 6
            if warmup == "bf16" and mode == "sync":
                # the first pull float32, the warmup's 2 bytes per element, then codes
                assert pulled < 4 * N + FREEZE * 2 * N + 52 * N / 6
        assert all(by_key[k].rule_state.compressing for k in plan.keys)
        assert all(by_key[k].publisher.history for k in plan.keys)
        for s in shards:
            text = generate_latest(s.core.metrics.registry).decode()
            values = {x.name: x.value for f in text_string_to_metric_families(text)
                      for x in f.samples}
            assert values["bitps_onebit_compressing_keys"] == len(s.core.slots)
            if mode == "async" and moments == "auto" and warmup is None:
                # worker moments, no weight decay: a published update is -lr times a decoded
                # push, already one magnitude per chunk, so the shard's code is exact
                assert values["bitps_onebit_residual_norm"] == 0
            else:
                assert values["bitps_onebit_residual_norm"] > 0
    finally:
        for s in shards:
            s.stop(0)


def test_compressed_traffic_is_about_one_bit_per_element():
    """Bytes per step after warmup, both directions, from one worker's own counters."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01,
                          rule_config=OneBitConfig(freeze_step=2, chunk=2048))
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        keys = [k.key for k in plan.keys]
        copy = np.zeros(N, np.float32)
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           compress_min_bytes=0)
        with EncodingClient(cfg) as client:
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
    from bitps.proto.wire import PSError

    # shard moments: with worker moments (and no weight decay) the shard's codes are exact
    # and its residuals stay 0 (test_workers_hold_the_shards_parameters_bit_for_bit)
    opt = OptimizerConfig(name="onebit_adam", lr=0.01, rule_config=OneBitConfig(
        freeze_step=1, chunk=256, moments="shard"))
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        with _three_steps(shard) as (client, plan, keys, outs):
            saved = {k: r.copy() for k, r in client.residuals(clock=2).items()}
            assert set(saved) == set(keys) and all(np.any(r) for r in saved.values())
        core = shard.core

        def residuals() -> dict:  # the shard's codec state (ShardCore.codecs), residuals only
            return {k: c["residual"] for k, c in core.codecs.state_dict()["keys"].items()}

        def load(by_key: dict) -> None:
            history = {k: c["history"] for k, c in core.codecs.state_dict()["keys"].items()}
            core.codecs.load_state_dict({"version": 1, "keys": {
                k: {"version": 1, "residual": r, "history": history[k]}
                for k, r in by_key.items()}})

        server = residuals()
        assert set(server) == set(keys) and all(np.any(r) for r in server.values())
        before = {k: r.copy() for k, r in server.items()}
        for r in residuals().values():
            r[:] = 7  # copies: the shard's state is untouched
        assert all(np.array_equal(before[k], r) for k, r in residuals().items())
        zeroed = {k: np.zeros_like(r) for k, r in before.items()}
        with pytest.raises(PSError, match="expected"):
            load({**zeroed, keys[-1]: np.zeros(3, np.float32)})
        assert all(np.array_equal(before[k], r) for k, r in residuals().items())
        load(before)
        assert all(np.array_equal(before[k], r) for k, r in residuals().items())
        servers = (f"127.0.0.1:{shard.ports['grpc_port']}",)
        with EncodingClient(ClientConfig(servers=servers, partition_bytes=16384,
                                   compress_min_bytes=0, push_codec=CodecConfig(name="sign1")))\
                as other:
            other.plan = plan
            other.load_residuals(saved)
            assert all(np.array_equal(saved[k], r) for k, r in other.residuals().items())
    finally:
        shard.stop(0)


def test_worker_moments_save_restore_and_layout_settings():
    """Worker moments come out per key and go back in; sync accepts only the auto layout."""
    with pytest.raises(ValueError, match="onebit_moments 'shard' applies to async/ssp"):
        ServerConfig(mode="sync", optimizer=OptimizerConfig(
            name="onebit_adam", rule_config=OneBitConfig(moments="shard")))
    with pytest.raises(ValueError, match="onebit_compact_state applies to sync mode"):
        ServerConfig(mode="ssp", optimizer=OptimizerConfig(
            name="onebit_adam", rule_config=OneBitConfig(compact_state=True)))
    with pytest.raises(ValueError, match="onebit_moments 'both'"):
        OptimizerConfig(name="onebit_adam", rule_config=OneBitConfig(moments="both"))
    with pytest.raises(ValueError, match="onebit_warmup_codec 'fp8'; expected one of"):
        OneBitConfig(warmup_codes=True, warmup_codec="fp8")
    with pytest.raises(ValueError, match="without onebit_warmup_codes warmup pulls carry"):
        OneBitConfig(warmup_codec="bf16")
    opt = OptimizerConfig(name="onebit_adam", lr=0.01,
                          rule_config=OneBitConfig(freeze_step=2, chunk=256))
    shard = create_server(ServerConfig(mode="ssp", optimizer=opt, metrics_port=-1))
    try:
        with _three_steps(shard) as (client, plan, keys, outs):
            saved = {k: (t, m.copy(), v.copy()) for k, (t, m, v) in
                     client.policy_state().items()}
        assert set(saved) == set(keys)
        assert all(t == 3 and np.any(m) and np.any(v) for t, m, v in saved.values())
        servers = (f"127.0.0.1:{shard.ports['grpc_port']}",)
        with EncodingClient(ClientConfig(servers=servers, partition_bytes=16384)) as other:
            with pytest.raises(RuntimeError, match="register"):
                other.load_policy_state(saved)
            other.register(plan, dict(zip(keys, outs)))  # a restarted rank 0
            t, m, v = saved[keys[0]]
            with pytest.raises(ValueError, match="expected float32"):
                other.load_policy_state({keys[0]: (t, m[:5], v)})
            assert other.policy_state() == {}  # nothing loaded from the refused call
            other.load_policy_state(saved)
            back = other.policy_state()
            assert all(back[k][0] == t and np.array_equal(back[k][1], m)
                       and np.array_equal(back[k][2], v) for k, (t, m, v) in saved.items())
    finally:
        shard.stop(0)


@pytest.mark.parametrize("moments", ["auto", "shard"])
def test_a_nonfinite_gradient_is_refused_before_it_reaches_worker_state(moments):
    """NaN in a compressed push would poison the error-feedback residual (and the worker's Adam
    moments) for good: the client refuses it (NON_FINITE, counted), sends nothing, and keeps
    its state; the shard's parameters stay as they were."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01, rule_config=OneBitConfig(
        freeze_step=1, chunk=256, moments=moments))
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        with _three_steps(shard) as (client, plan, keys, outs):
            state = [r.copy() for r in client.residuals().values()]
            state += [a.copy() for _, m, v in client.policy_state().values() for a in (m, v)]
            before = [shard.core.slots[k].param.copy() for k in keys]
            grads = [np.ones(len(o), np.float32) for o in outs]
            grads[1][123] = np.nan
            with pytest.raises(PSError, match=f"key {keys[1]}: gradient holds NaN") as err:
                client.push_pull(keys, grads, outs, clock=3)
            assert err.value.code == pb.NON_FINITE
            after = [*client.residuals().values()]
            after += [a for _, m, v in client.policy_state().values() for a in (m, v)]
            assert len(after) == len(state) == len(keys) * (3 if moments == "auto" else 1)
            assert all(np.array_equal(a, b) for a, b in zip(after, state))
            assert client.metrics.nonfinite.value == 1
            assert all(np.array_equal(shard.core.slots[k].param, b) for k, b in zip(keys, before))
            grads[1][123] = 1.0
            client.push_pull(keys, grads, outs, clock=3).wait()  # and training goes on
            assert all(np.array_equal(o, shard.core.slots[k].param) for k, o in zip(keys, outs))
    finally:
        shard.stop(0)


def test_a_late_warmup_push_after_the_switch_is_a_gradient_not_a_direction():
    """async, worker moments: rank 0 crosses freeze_step and pushes Adam directions; rank 1's
    warmup gradient (clock below freeze_step) then lands. The shard gives it a warmup step
    (full Adam, no code published) instead of reading it as a direction; the copies still end
    equal to the shard's."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01,
                          rule_config=OneBitConfig(freeze_step=2, chunk=256))
    shard = create_server(ServerConfig(mode="async", optimizer=opt, metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        keys = [k.key for k in plan.keys]
        slot = lambda: shard.core.slots[keys[0]]  # noqa: E731
        servers = (f"127.0.0.1:{shard.ports['grpc_port']}",)
        copies = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
        rng = np.random.default_rng(0)
        with EncodingClient(ClientConfig(servers=servers, rank=0, world_size=2,
                                   compress_min_bytes=0)) as fast, \
                EncodingClient(ClientConfig(servers=servers, rank=1, world_size=2,
                                      compress_min_bytes=0)) as slow:
            registering = threading.Thread(target=slow.register, args=(plan,))
            registering.start()
            fast.register(plan, {keys[0]: copies[0]})
            registering.join()
            for step in range(3):  # clocks 0, 1 warm up; clock 2 is a direction
                grad = rng.standard_normal(N).astype(np.float32)
                fast.push_pull(keys, [grad], [copies[0]], clock=step).wait()
            assert slot().rule_state.compressing and len(slot().publisher.history) == 1
            steps_before = slot().state.step
            grad = rng.standard_normal(N).astype(np.float32)
            slow.push_pull(keys, [grad], [copies[1]], clock=0).wait()
            assert slot().state.step == steps_before + 1  # the shard's Adam took a step
            assert not slot().publisher.history  # no code: workers behind it pull parameters
            assert not np.any(slot().rule_state.server.residual)
            fast.pull(keys, [copies[0]], clock=3).wait()
            for copy in copies:
                assert np.array_equal(copy, slot().param)
    finally:
        shard.stop(0)


def _compact_state(key: int, m_code: bytes, den_bits: bytes, n: int, chunk: int):
    """A sync 1-bit Adam shard's RuleState message with onebit_compact_state (the layout of
    ``proto/onebit.proto``): m's sign1 code and the denominators in bf16."""
    msg = pb.KeyRuleState(key=key, arrays=[
        pb.StateArray(name="exp_avg", codec=pb.CODEC_SIGN1, codec_chunk=chunk, length=n,
                      data=m_code),
        pb.StateArray(name="denominator", dtype=pb.BFLOAT16, length=n, data=den_bits)])
    msg.fields.update({"bias_correction2_sqrt": 0.5})
    return msg


def test_a_compact_optimizer_state_is_kept_as_sent_and_checked_for_size():
    """sync with onebit_compact_state: RuleState sends m as its sign1 code and the shard's
    denominators in bf16; the worker keeps the code as m and the denominators as float32,
    with no square root of its own; a float32 state (m and v) still loads, its denominators
    made with the shard's kernel; state bytes that do not fit the key are refused with what
    was expected."""
    from bitps.native import casts
    from bitps.worker.algorithms.onebit import OneBitMomentum, OneBitParams

    n, chunk = 1000, 256
    momentum = OneBitMomentum(OneBitParams(chunk=chunk, lr=0.01, beta1=0.9, beta2=0.999,
                                           eps=1e-8))
    rng = np.random.default_rng(0)
    m = rng.standard_normal(n).astype(np.float32)
    m_code = bytes(Compressor(Codec(pb.CODEC_SIGN1, chunk), n).encode(m))
    den = (rng.random(n) + 1e-3).astype(np.float32)
    bits = np.empty(n, np.uint16)
    casts.bf16_encode(den, None, bits)
    # the arrays the denominators load into, made and written ahead (SyncMomenta.bind): no
    # page faults at the switch
    momentum.reserve({3: n, 4: n, 5: n})
    spare = dict(momentum._spare)
    momentum.reserve({3: n + 1})  # a key reserved already keeps its array
    assert momentum._spare == spare and all(not a.any() for a in spare.values())
    momentum.load(_compact_state(3, m_code, bits.tobytes(), n, chunk), n)
    assert momentum.denominator[3] is spare[3]
    want_den = np.zeros(n, np.float32)
    casts.bf16_decode_add(bits, n, want_den)
    assert momentum.loaded(3) and 3 not in momentum.m
    assert momentum.m_code[3].tobytes() == m_code
    assert np.array_equal(momentum.denominator[3], want_den)
    want_m = np.zeros(n, np.float32)
    Codec(pb.CODEC_SIGN1, chunk).decode_add(m_code, n, want_m)
    assert np.array_equal(momentum.momentum_of(3), want_m)
    v = rng.random(n).astype(np.float32)
    momentum.load(pb.KeyRuleState(key=5, arrays=[
        pb.StateArray(name="exp_avg", dtype=pb.FLOAT32, length=n, data=m.tobytes()),
        pb.StateArray(name="exp_avg_sq", dtype=pb.FLOAT32, length=n, data=v.tobytes())],
        fields={"bias_correction2_sqrt": 0.5}), n)
    want = np.empty(n, np.float32)
    native.onebit_denominator(v, np.float32(0.5), np.float32(1e-8), want)
    assert np.array_equal(momentum.m[5], m) and np.array_equal(momentum.denominator[5], want)
    assert momentum.denominator[5] is spare[5]
    with pytest.raises(PSError) as err:
        momentum.load(_compact_state(4, m_code, bits.tobytes()[:-2], n, chunk), n)
    assert err.value.code == pb.BAD_LENGTH and "expected" in err.value.message
    with pytest.raises(PSError) as err:
        momentum.load(pb.KeyRuleState(key=6, arrays=[
            pb.StateArray(name="exp_avg", dtype=pb.FLOAT32, length=n, data=m.tobytes())]), n)
    assert err.value.code == pb.BAD_HEADER and "denominator" in err.value.message
    assert not momentum.loaded(4) and not momentum.loaded(6)
    assert momentum._spare == {4: spare[4]}  # a refused state leaves its array reserved


@pytest.mark.parametrize("compact", [True, False])
def test_the_state_fetched_at_the_switch_is_what_the_shard_holds(compact):
    """sync: the state each worker fetches at the switch (RuleState) is m's sign1 code and the
    denominators in bf16 with ``onebit_compact_state`` (float32 m and v without it, 8 bytes per
    element), and the shard's own m and denominators are what those bytes decode to, so
    replicas stay exact."""
    from bitps.native import casts

    chunk = 256
    opt = OptimizerConfig(name="onebit_adam", lr=0.01, rule_config=OneBitConfig(
        freeze_step=2, chunk=chunk, compact_state=compact))
    shard = create_server(ServerConfig(mode="sync", optimizer=opt, metrics_port=-1))
    try:
        with _three_steps(shard) as (client, _, keys, outs):
            slots = shard.core.slots
            states = shard.core.rule.rule_state(slots)
            assert [s.key for s in states] == sorted(slots)
            # the next worker's fetch of the same versions gets the messages made for the
            # first (compact: the switch is CPU-bound); float32 ones are made again
            again = shard.core.rule.rule_state(slots)
            assert all((a is b) == compact and a == b for a, b in zip(again, states))
            for msg in states:
                ob, n = slots[msg.key].rule_state, slots[msg.key].length
                m, v = (a for a in msg.arrays)
                sent = len(m.data) + len(v.data)
                if not compact:
                    assert sent == 8 * n
                    assert np.array_equal(np.frombuffer(m.data, np.float32), ob.buf1)
                    assert np.array_equal(np.frombuffer(v.data, np.float32), ob.buf2)
                    continue
                assert (m.codec, v.name, v.dtype) == (pb.CODEC_SIGN1, "denominator",
                                                      pb.BFLOAT16)
                assert sent == sign1.payload_bytes(n, chunk) + 2 * n < 2.2 * n
                m_out, den = np.zeros(n, np.float32), np.zeros(n, np.float32)
                sign1.decode_add(m.data, n, m_out, chunk=chunk)
                casts.bf16_decode_add(v.data, n, den)
                # what the shard applies with: rounded to bf16 where it was made
                assert np.array_equal(den, ob.denominator)
                exact = np.empty(n, np.float32)
                native.onebit_denominator(ob.buf2, np.float32(ob.bias_correction2_sqrt),
                                          np.float32(1e-8), exact)
                assert not np.array_equal(den, exact)
                assert np.abs(den - exact).max() <= 2 ** -8 * exact.max()
                # m has moved on since (one compressed step): it is its last published code's
                assert np.array_equal(m_out, ob.buf1)
                assert np.any(den) and np.any(m_out)
            # an update moves every key on: its state is made anew
            client.push_pull(keys, [np.ones(len(o), np.float32) for o in outs], outs,
                             clock=3).wait()
            newer = shard.core.rule.rule_state(slots)
            assert all(n.version == s.version + 1 and n is not s and n != s
                       for n, s in zip(newer, states))
    finally:
        shard.stop(0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_of_the_other_phases_codec_is_refused(mode):
    """Issue 29: the shard reads a 1-bit Adam push by its clock (the worker's step plus its
    shift for that shard, after the shard came back from an older checkpoint). A payload made
    for the other side of freeze_step (the worker's encoder follows the shards' steps, but a
    push redone after a recovery carries what was encoded before it) had sign1 momenta or
    directions taken as warm-up gradients (or bf16 gradients as momenta): parameters
    corrupted without a trace. Now the push is refused (``BAD_DTYPE``), nothing changed."""
    opt = OptimizerConfig(name="onebit_adam", lr=0.01,
                          rule_config=OneBitConfig(freeze_step=2, chunk=256))
    shard = create_server(ServerConfig(mode=mode, optimizer=opt, metrics_port=-1))
    try:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        keys = [k.key for k in plan.keys]
        slot = lambda: shard.core.slots[keys[0]]  # noqa: E731 - registration sets the slots
        copy = np.zeros(N, np.float32)
        rng = np.random.default_rng(0)
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           compress_min_bytes=0)
        with EncodingClient(cfg) as client:
            client.register(plan, {keys[0]: copy})
            grads = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
            assert client.codec_at(2).name == "sign1" and client.codec_at(1).name == "bf16"
            if mode == "sync":  # the shard past the switch, the worker's step before it
                for step in (0, 1):
                    client.push_pull(keys, [grads[step]], [copy], clock=step).wait()
                step, shift = 1, 1  # a bf16 gradient for the shard's step 2
            else:  # the worker past the switch, the shard's step before it
                client.push_pull(keys, [grads[0]], [copy], clock=0).wait()
                step, shift = 2, -1  # a direction for the shard's step 1
            # encoded before the worker learnt the shard's step (a redo after recovery sends
            # the payload it has), then sent at that step
            payload = client.encode(keys, [grads[2]], clock=step)
            client.transport.shift[0] = shift
            before = (slot().param.copy(), slot().version)
            with pytest.raises(PSError) as err:
                client.transport.push_pull(keys, payload, [copy], clock=step).wait()
            assert err.value.code == pb.BAD_DTYPE and "freeze_step 2" in str(err.value)
            assert np.array_equal(slot().param, before[0]) and slot().version == before[1]
    finally:
        shard.stop(0)


def test_a_publisher_recoded_keeps_its_residual_and_drops_its_history():
    """``Publisher.recode`` (1-bit Adam's first compressed update after bf16 warmup codes):
    the error feedback carries over, the history in the old codec goes (a worker behind it
    pulls the parameters), and the same codec changes nothing."""
    n = 1000
    pub = Publisher(Codec(pb.CODEC_BF16), n, history=8)
    param = np.zeros(n, np.float32)
    delta = (np.random.default_rng(0).standard_normal(n) * 1e-3).astype(np.float32)
    pub.publish(1, pub.server.publish(delta.copy(), param))
    assert pub.reply_frame(0, 1)[0] == pb.CODEC_BF16 and len(pub.history[0][1]) == 2 * n
    residual = pub.server.residual.copy()
    assert residual.any()
    np.testing.assert_array_equal(param + residual, delta)  # error feedback: nothing lost
    pub.recode(Codec(pb.CODEC_BF16))
    assert pub.reply_frame(0, 1)[0] == pb.CODEC_BF16
    sign = Codec(pb.CODEC_SIGN1, 256)
    pub.recode(sign)
    assert pub.codec == pub.server.codec == sign
    assert pub.reply_frame(0, 1) == (pb.CODEC_RAW, None)
    np.testing.assert_array_equal(pub.server.residual, residual)
    assert pub.state_dict()["codec"] == [pb.CODEC_SIGN1, 256, 0]
