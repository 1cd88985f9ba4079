"""ZB-V (two chunks per rank in a V): the plan keeps the action contract per virtual stage and
completes in the simulator for every (p <= 8, m <= 32); its peers and local hand-offs follow
from (rank, chunk, op); its in-flight chunks stay within 1F1B's memory; with uniform times and
no communication its bubble is only the last rank's start-up, the closed form; and on real gloo
processes (p = 2, 4) it yields the gradients of single-process gradient accumulation over the
2p virtual stages of one ``nn.Sequential``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bitps.worker.pipeline.actions import COMPUTE, Action, Op, peer, rank_chunk, virtual_stage
from bitps.worker.pipeline.errors import DeadlockError, PlanError
from bitps.worker.pipeline.schedules import closed_form_bubble, get_schedule
from bitps.worker.pipeline.simulate import StageTimes, check, simulate
from tests.test_pipeline_runtime import (
    HEADER_BYTES,
    MICRO,
    WIDTH,
    collect,
    finish,
    init_stage,
    make_model,
    micro_batches,
    reference_grads,
    report_dict,
    stage_module,
    start_stages,
)

UNIFORM = StageTimes(f=1.0, b=1.0, w=1.0)


def test_the_v_places_chunk_0_down_the_ranks_and_chunk_1_back_up():
    p = 4
    assert [virtual_stage(r, 0, p) for r in range(p)] == [0, 1, 2, 3]
    assert [virtual_stage(r, 1, p) for r in range(p)] == [7, 6, 5, 4]
    assert all(rank_chunk(virtual_stage(r, c, p), p) == (r, c) for r in range(p) for c in (0, 1))
    assert peer(0, 0, Op.SEND_F, p, 2) == (1, 0)
    assert peer(3, 0, Op.SEND_F, p, 2) == (3, 1)  # the bottom of the V: local
    assert peer(3, 1, Op.RECV_F, p, 2) == (3, 0)
    assert peer(2, 1, Op.SEND_F, p, 2) == (1, 1)  # chunk 1 sends forward to rank - 1
    assert peer(2, 1, Op.SEND_B, p, 2) == (3, 1)  # and its gradients to rank + 1
    assert peer(0, 1, Op.SEND_F, p, 2) is None  # rank 0's chunk 1 computes the loss
    assert peer(0, 0, Op.RECV_F, p, 2) is None  # rank 0's chunk 0 takes the inputs
    assert peer(2, 0, Op.SEND_F, p, 1) == (3, 0)  # one chunk: the plain line
    with pytest.raises(ValueError, match="not a transfer"):
        peer(0, 0, Op.F, p, 2)


def test_every_config_completes_within_1f1b_memory_and_every_bad_size_is_refused():
    zbv = get_schedule("zb-v")
    assert zbv.chunks == 2 and zbv.flushes and zbv.splits_backward
    for p in range(1, 9):
        for m in range(1, 33):
            assert zbv.refusal(p, m) is None
            zbv.check(p, m)  # the contract checker and the simulator's deadlock guard
            plan = zbv.generate(p, m, 2)
            assert len(plan) == p and all(a.stage == r for r, acts in enumerate(plan)
                                          for a in acts)
            r = simulate(plan, UNIFORM, schedule="zb-v")
            computes = [a for acts in plan for a in acts if a.op in COMPUTE]
            assert len(computes) == p * 2 * m * 2 * 3  # ranks x chunks x mbs x steps x F,B,W
            # 2p chunks of half a stage each: the p full-stage micro-batches of 1F1B's stage 0
            assert max(r.peak_inflight) <= 2 * p
            assert max(r.max_live_versions) == 1
            local = [a for a in plan[p - 1] if a.op in (Op.SEND_F, Op.RECV_F, Op.SEND_B,
                                                        Op.RECV_B)
                     and peer(p - 1, a.chunk, a.op, p, 2)[0] == p - 1]
            assert len(local) == 4 * m * 2  # the V's bottom: both directions, both ends
    for p, m in ((0, 4), (2, 0)):
        for call in (zbv.check, zbv.generate):
            with pytest.raises(PlanError) as e:
                call(p, m)
            assert (e.value.schedule, e.value.p, e.value.m) == ("zb-v", p, m)
            assert "'zb-v'" in str(e.value) and f"p={p}" in str(e.value) and f"m={m}" in str(
                e.value)
    with pytest.raises(PlanError, match="steps must be at least 1"):
        zbv.generate(2, 4, 0)


def test_rank_0_starts_its_backwards_at_once_and_the_order_is_the_v():
    plan = get_schedule("zb-v").generate(2, 4)
    compute = [f"{a.op.value}{a.mb}.c{a.chunk}" for a in plan[0] if a.op in COMPUTE]
    assert compute[:6] == ["F0.c0", "F1.c0", "F2.c0", "F0.c1", "B0.c1", "W0.c1"]
    ops = [str(a) for a in plan[1]][:6]  # rank p-1 hands F0 to its own chunk 1 at once
    assert ops == ["PULL", "RECV_F0", "F0", "SEND_F0", "RECV_F0.c1", "F0.c1"]
    assert str(plan[1][-1]) == "PUSH" and str(plan[1][0]) == "PULL"


@pytest.mark.parametrize("times", [UNIFORM, StageTimes(f=0.04, b=0.04, w=0.04),
                                   StageTimes(f=1.0, b=1.0, w=0.5),
                                   StageTimes(f=1.0, b=1.0, w=0.75)])
def test_uniform_bubble_is_the_last_ranks_start_up_only(times):
    zbv = get_schedule("zb-v")
    for p in range(1, 9):
        for m in range(2 * p - 1, 33):
            r = simulate(zbv.generate(p, m), times)
            idle = (p - 1) * times.f / 2
            want = idle / (idle + m * (times.f + times.b + times.w))
            assert closed_form_bubble("zb-v", p, m, times) == pytest.approx(want)
            assert r.bubble_max == pytest.approx(want, abs=1e-9)
    # p = 4, m = 8: 3/51, about half of ZB-H1's 3/27 at the same memory
    assert simulate(zbv.generate(4, 8), UNIFORM).bubble_max == pytest.approx(3 / 51)
    assert closed_form_bubble("zb-h1", 4, 8, UNIFORM) == pytest.approx(3 / 27)
    assert closed_form_bubble("zb-v", 4, 3, UNIFORM) is None  # m < 2p - 1: simulate it
    assert closed_form_bubble("zb-v", 4, 8, StageTimes(f=1.0, b=1.0, w=0.25)) is None


def test_a_chunk_takes_half_the_ranks_times_and_a_local_hand_off_no_comm():
    plan = get_schedule("zb-v").generate(1, 2)  # one rank: both chunks, hand-offs all local
    r = simulate(plan, StageTimes(f=2.0, b=2.0, w=2.0), comm_s=5.0)
    assert r.busy == (12.0,) and r.makespan == 12.0  # 2 mbs x 2 chunks x 3 ops x 1.0, no comm
    spans = dict(zip((str(a) for a in plan[0]), r.timeline[0]))
    assert spans["F0"] == (0.0, 1.0) and spans["F0.c1"] == (1.0, 2.0)


def test_the_checker_and_the_deadlock_guard_speak_chunks():
    good = get_schedule("zb-v").generate(2, 3)
    # chunk 1 of rank 1 (virtual stage 2) forwards without receiving from its chunk 0
    broken = [list(acts) for acts in good]
    i = next(i for i, a in enumerate(broken[1]) if a.op is Op.RECV_F and a.chunk == 1)
    del broken[1][i]
    with pytest.raises(PlanError, match=r"F before its RECV_F"):
        check(broken, schedule="zb-v")
    bad = [list(acts) for acts in good]
    bad[0].insert(1, Action(op=Op.SEND_B, stage=0, mb=0, chunk=0))
    with pytest.raises(PlanError, match="virtual stage 0 of 4 has no peer for SEND_B"):
        check(bad, schedule="zb-v")
    # rank 1 waits for its own chunk 0's hand-off before running chunk 0: a deadlock on itself
    acts = list(good[1])
    j = next(i for i, a in enumerate(acts) if a.op is Op.RECV_F and a.chunk == 1 and a.mb == 0)
    moved = acts.pop(j)
    acts.insert(1, moved)
    with pytest.raises(DeadlockError, match=r"stage 1 waits at RECV_F0.c1 for SEND_F0 of stage "
                       r"1 chunk 0"):
        simulate([good[0], acts], UNIFORM, schedule="zb-v")


# -- real gloo processes ----------------------------------------------------------------------
def rank_chunks(model, r: int, p: int):
    """Rank ``r``'s two chunks of the V: virtual stages ``r`` and ``2p - 1 - r`` of ``2p``."""
    return [stage_module(model, virtual_stage(r, c, p), 2 * p) for c in (0, 1)]


def run_zbv(cfg: dict) -> None:
    """One zb-v step of this rank (two chunks of a fresh model, no PS): both chunks'
    gradients, the report, and a second step at another micro-batch size (the headers carry
    the new shapes on every chain)."""
    from bitps.worker.pipeline.runtime import StageRuntime

    ctx = init_stage(cfg)
    p, m, r = cfg["p"], cfg["m"], ctx.stage
    chunks = rank_chunks(make_model(), r, p)
    rt = StageRuntime(ctx, chunks, loss_fn=F.mse_loss)
    plan = get_schedule("zb-v").generate(p, m)
    xs, ys = micro_batches(m)
    report = rt.run_step(plan[r], inputs=xs if r == 0 else None, targets=ys if r == 0 else None)
    grads = {n: q.grad.tolist() for c in chunks for n, q in c.named_parameters()}
    for c in chunks:
        c.zero_grad(set_to_none=True)
    xs2, ys2 = micro_batches(m, seed=7, b=2 * MICRO)
    again = rt.run_step(plan[r], inputs=xs2 if r == 0 else None,
                        targets=ys2 if r == 0 else None)
    grads2 = {n: q.grad.tolist() for c in chunks for n, q in c.named_parameters()}
    finish(dict(stage=r, report=report_dict(report), grads=grads, again=report_dict(again),
                grads2=grads2))


def train_through_shard(cfg: dict) -> None:
    """``STEPS`` zb-v steps of this rank through a sync shard, overlap on: one ``PSModel`` over
    a module holding both chunks' children (the whole model's names); the parameters after."""
    from collections import OrderedDict

    from torch import nn

    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker import ClientConfig, PSClient, PSModel
    from bitps.worker.config import OverlapConfig
    from bitps.worker.pipeline.runtime import StageRuntime
    from tests.test_pipeline_equality import STEPS, M

    ctx = init_stage(cfg)
    p, r = cfg["p"], ctx.stage
    model = make_model()
    chunks = rank_chunks(model, r, p)
    both = nn.Sequential(OrderedDict(kv for c in chunks for kv in c.named_children()))
    client = PSClient(ClientConfig(servers=(cfg["server"],), rank=r, world_size=p,
                                   initializes=True, clip_norm=0.0))
    whole = make_plan([ParamSpec(n, tuple(q.shape)) for n, q in model.named_parameters()],
                      num_shards=client.num_shards, partition_bytes=client.cfg.partition_bytes)
    ps_model = PSModel(both, client, plan=whole, overlap=OverlapConfig(mode="on"))
    rt = StageRuntime(ctx, chunks, loss_fn=F.mse_loss, ps_model=ps_model)
    plan = get_schedule("zb-v").generate(p, M)[r]
    xs, ys = micro_batches(STEPS * M)
    losses = []
    for k in range(STEPS):
        mbs = slice(k * M, (k + 1) * M)
        report = rt.run_step(plan, inputs=xs[mbs] if r == 0 else None,
                             targets=ys[mbs] if r == 0 else None)
        losses.append(report.losses)
    ps_model.synchronize()
    out = dict(stage=r, params={n: q.tolist() for n, q in both.named_parameters()},
               losses=losses, keys=len(ps_model.keys), overlapped=ps_model.last_stats.overlapped)
    ps_model.close()
    finish(out)


def stage_main(cfg: dict) -> None:
    {"zbv": run_zbv, "shard": train_through_shard}[cfg["scenario"]](cfg)


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_on_gloo_gives_single_process_gradients_over_2p_virtual_stages(p):
    m = 2 * p
    outs = collect(start_stages(dict(scenario="zbv", p=p, m=m), p, script=Path(__file__)),
                   timeout=45)  # about 12 s (p = 2) to 26 s (p = 4) on 2 loaded cores
    outs.sort(key=lambda o: o["stage"])
    sim = simulate(get_schedule("zb-v").generate(p, m), UNIFORM)
    for key, seed, b in (("grads", 1, MICRO), ("grads2", 7, 2 * MICRO)):
        xs, ys = micro_batches(m, seed=seed, b=b)
        want, want_losses = reference_grads(make_model(), xs, ys)
        got = {n: g for o in outs for n, g in o[key].items()}
        assert set(got) == set(want)  # every parameter of the model, each on one rank
        for n, g in got.items():
            torch.testing.assert_close(torch.tensor(g), want[n], rtol=1e-6, atol=0,
                                       msg=f"zb-v p={p} {key} {n}")
        report = outs[0]["report" if key == "grads" else "again"]
        assert report["losses"] == pytest.approx(want_losses, rel=1e-6)  # rank 0: the loss
    for o in outs:
        r, rank = o["report"], o["stage"]
        assert 0 < r["busy_s"] <= r["wall_s"] and 0 <= r["bubble"] < 1
        assert r["micro_batch_size"] == MICRO and o["again"]["micro_batch_size"] == 2 * MICRO
        assert min(r["times"]) > 0  # F, B and W each timed
        chains = 2 * ((rank > 0) + (rank < p - 1))  # the V's bottom hand-off moves no bytes
        assert r["sent"] == r["received"] == chains * (HEADER_BYTES + m * MICRO * WIDTH * 4)
        assert r["peak_inflight"] == sim.peak_inflight[rank] <= 2 * p
        assert (r["losses"] != []) == (rank == 0)


@pytest.mark.parametrize("p", [2, 4])
def test_zbv_through_a_sync_shard_ends_with_single_process_parameters(p):
    from bitps.bench.faults import start_server
    from tests.test_pipeline_equality import LR, reference

    shard = start_server("--mode", "sync", "--optimizer", "sgd", "--lr", str(LR))
    try:
        outs = collect(start_stages(dict(scenario="shard", p=p, server=shard.grpc_address,
                                         deadline_s=25), p, script=Path(__file__)),
                       timeout=45)
    finally:
        shard.kill()
    outs.sort(key=lambda o: o["stage"])
    want, want_losses = reference()
    initial = dict(make_model().named_parameters())
    names = set()
    for o in outs:
        assert o["keys"] > 0 and o["overlapped"]
        for n, q in o["params"].items():
            got = torch.tensor(q)
            assert not torch.equal(got, initial[n]), f"{n} never changed"
            torch.testing.assert_close(got, want[n], rtol=1e-6, atol=0,
                                       msg=f"zb-v p={p} rank {o['stage']} {n}")
            names.add(n)
    assert names == set(want)
    for got_step, want_step in zip(outs[0]["losses"], want_losses, strict=True):
        assert got_step == pytest.approx(want_step, rel=1e-6)


def test_a_two_chunk_runtime_refuses_what_it_does_not_provide():
    from bitps.worker.pipeline.runtime import StageContext, StageRuntime

    ctx = StageContext(stage=0, num_stages=1)
    chunks = rank_chunks(make_model(), 0, 1)
    with pytest.raises(ValueError, match="a list of 2"):
        StageRuntime(ctx, chunks * 2, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="runs on gloo"):
        StageRuntime(ctx, chunks, loss_fn=F.mse_loss, pool=object())
    rt = StageRuntime(ctx, chunks, loss_fn=F.mse_loss)
    xs, ys = micro_batches(2)
    with pytest.raises(ValueError, match="holds 2 chunk"):
        rt.run_step([Action(op=Op.F, stage=0, mb=0, chunk=2)], inputs=xs, targets=ys)
    with pytest.raises(ValueError, match="needs targets"):
        rt.run_step(get_schedule("zb-v").generate(1, 2)[0], inputs=xs)
    flush_free = get_schedule("2bw").generate(1, 2, 3)[0]
    with pytest.raises(ValueError, match="flushing plans only"):
        rt.run_step(flush_free, inputs=micro_batches(6)[0], targets=micro_batches(6)[1])
    # one rank holding the whole V in one process: local hand-offs only, single-process grads
    report = rt.run_step(get_schedule("zb-v").generate(1, 2)[0], inputs=xs, targets=ys)
    want, want_losses = reference_grads(make_model(), xs, ys)
    for n, q in ((n, q) for c in chunks for n, q in c.named_parameters()):
        torch.testing.assert_close(q.grad, want[n], rtol=1e-6, atol=0)
    assert report.losses == pytest.approx(want_losses, rel=1e-6)
    assert report.p2p_bytes_sent == report.p2p_bytes_received == 0


if __name__ == "__main__":
    stage_main(json.loads(sys.argv[1]))
