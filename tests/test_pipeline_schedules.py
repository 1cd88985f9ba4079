"""Schedules as data and the event simulator (acceptance 1): every registered schedule completes
for every (p <= 8, m <= 32) it accepts, matches its closed-form bubble, keeps its in-flight and
weight-version bounds, and refuses what it cannot run with a PlanError naming p, m and the
schedule; the simulator's deadlock detector and contract checker catch hand-made bad plans."""

from __future__ import annotations

import pytest

from bitps.worker.pipeline.actions import COMPUTE, Action, Op
from bitps.worker.pipeline.errors import DeadlockError, PlanError, UnknownScheduleError
from bitps.worker.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    closed_form_bubble,
    get_schedule,
    register_schedule,
)
from bitps.worker.pipeline.simulate import StageTimes, check, simulate

UNIFORM = StageTimes(f=1.0, b=1.0, w=1.0)
NAMES = ("gpipe", "1f1b", "zb-h1", "2bw")


def _steps(schedule: Schedule) -> int:
    return 1 if schedule.flushes else 3


def test_registry_holds_the_four_schedules_and_names_the_choices():
    assert set(NAMES) <= set(SCHEDULES)
    for name in NAMES:
        assert get_schedule(name).name == name
    with pytest.raises(UnknownScheduleError) as e:
        get_schedule("interleaved")
    assert "interleaved" in str(e.value) and all(n in str(e.value) for n in NAMES)
    assert e.value.choices == tuple(sorted(SCHEDULES))
    with pytest.raises(ValueError, match="already registered"):
        register_schedule(type(get_schedule("1f1b")))


@pytest.mark.parametrize("name", NAMES)
def test_every_accepted_config_completes_and_every_refused_one_names_p_m_schedule(name):
    schedule = get_schedule(name)
    accepted = refused = 0
    for p in range(1, 9):
        for m in range(1, 33):
            if schedule.refusal(p, m) is not None:
                refused += 1
                for call in (schedule.check, schedule.generate):
                    with pytest.raises(PlanError) as e:
                        call(p, m)
                    assert (e.value.schedule, e.value.p, e.value.m) == (name, p, m)
                    assert f"'{name}'" in str(e.value) and f"p={p}" in str(e.value)
                    assert f"m={m}" in str(e.value)
                continue
            accepted += 1
            schedule.check(p, m)  # the contract checker and the simulator's deadlock guard
            plan = schedule.generate(p, m, _steps(schedule))
            r = simulate(plan, UNIFORM, schedule=name)
            computes = sum(a.op in COMPUTE for acts in plan for a in acts)
            assert sum(len(t) for t in r.timeline) == sum(len(acts) for acts in plan)
            per_mb = 3 if schedule.splits_backward else 2
            assert computes == p * m * _steps(schedule) * per_mb
            assert max(r.max_live_versions) <= 2
    assert accepted > 0
    # 1F1B and ZB-H1 refuse exactly m < p (torch's rule: the warm-up hang of other systems);
    # 2BW m < p - 1 (three live versions); GPipe nothing.
    slack = {"gpipe": None, "1f1b": 0, "zb-h1": 0, "2bw": 1}[name]
    assert refused == (0 if slack is None else
                       sum(1 for p in range(1, 9) for m in range(1, p - slack)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("times", [UNIFORM, StageTimes(f=1.0, b=2.0, w=0.5),
                                   StageTimes(f=0.02, b=0.03, w=0.01)])
def test_flushing_bubble_is_exactly_the_closed_form(name, times):
    schedule = get_schedule(name)
    for p in range(1, 9):
        for m in range(p, 33):
            r = simulate(schedule.generate(p, m), times)
            expected = (p - 1) / (m + p - 1)
            assert closed_form_bubble(name, p, m, times) == pytest.approx(expected)
            assert r.bubble == pytest.approx([expected] * p, abs=1e-9)
            assert r.bubble_max == pytest.approx(expected, abs=1e-9)
            assert r.bubble_mean == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("times", [UNIFORM, StageTimes(f=2.0, b=2.0, w=1.0),
                                   StageTimes(f=1.5, b=1.0, w=1.0),
                                   StageTimes(f=3.0, b=2.0, w=1.0)])
def test_zb_h1_bubble_is_its_closed_form_and_below_1f1b(times):
    zb, one = get_schedule("zb-h1"), get_schedule("1f1b")
    for p in range(2, 9):
        for m in range(p, 33, 3):
            r = simulate(zb.generate(p, m), times)
            idle = (p - 1) * (times.f + times.b - times.w)
            assert r.makespan == pytest.approx(m * (times.f + times.b + times.w) + idle)
            assert r.bubble_max == pytest.approx(zb.closed_form_bubble(p, m, times))
            assert r.bubble_max < simulate(one.generate(p, m), times).bubble_max
    # Where T_W exceeds T_F or T_B the formula does not hold, so none is claimed.
    assert zb.closed_form_bubble(4, 8, StageTimes(f=1.0, b=1.0, w=2.0)) is None
    assert closed_form_bubble("2bw", 4, 8, UNIFORM) is None


def test_problem_statement_point_p4_m8():
    """The issue's figure: 1F1B at p=4, m=8 idles 3/11 = 27 %; ZB-H1 with equal F, B, W 1/9."""
    assert simulate(get_schedule("1f1b").generate(4, 8), UNIFORM).bubble_max == \
        pytest.approx(3 / 11)
    assert simulate(get_schedule("zb-h1").generate(4, 8), UNIFORM).bubble_max == \
        pytest.approx(1 / 9)


def test_peak_inflight_bounds():
    for p in range(1, 9):
        for m in [*range(1, 13), 16, 23, 32]:
            gpipe = simulate(get_schedule("gpipe").generate(p, m), UNIFORM)
            assert gpipe.peak_inflight == (m,) * p
            if m < p:
                continue
            one = simulate(get_schedule("1f1b").generate(p, m), UNIFORM)
            assert one.peak_inflight == tuple(min(p - s, m) for s in range(p))
            zb = simulate(get_schedule("zb-h1").generate(p, m), UNIFORM)
            assert max(zb.peak_inflight) == p  # 1F1B's peak (stage 0's), on every stage
            two = simulate(get_schedule("2bw").generate(p, m, steps=3), UNIFORM)
            assert two.peak_inflight == one.peak_inflight


@pytest.mark.parametrize("p,m", [(4, 3), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32), (2, 3)])
def test_2bw_has_no_steady_bubble_and_two_versions(p, m):
    steps = 8
    r = simulate(get_schedule("2bw").generate(p, m, steps), UNIFORM)
    assert r.steady_bubble(2, steps - 3) == pytest.approx(0.0, abs=1e-9)
    assert r.max_live_versions == (2,) * p
    one = simulate(get_schedule("gpipe" if m < p else "1f1b").generate(p, m, steps), UNIFORM)
    assert r.makespan < one.makespan  # no flush between steps
    assert one.steady_bubble(2, steps - 3) == pytest.approx((p - 1) / (m + p - 1))


def test_2bw_versions_are_one_step_stale_and_pulled_after_the_push_two_steps_back():
    p, m, steps = 4, 8, 5
    plan = get_schedule("2bw").generate(p, m, steps)
    for s, acts in enumerate(plan):
        for a in acts:
            if a.op in COMPUTE:
                assert a.step == a.mb // m and a.version == max(a.step - 1, 0)
        pulls = [(i, a) for i, a in enumerate(acts) if a.op is Op.PULL]
        assert [a.version for _, a in pulls] == [0, *range(1, steps - 1)]
        index = {(a.op, a.step): i for i, a in enumerate(acts) if a.op in (Op.PUSH, Op.PULL)}
        for k in range(2, steps):
            assert index[(Op.PULL, k)] == index[(Op.PUSH, k - 2)] + 1
            first_f = next(i for i, a in enumerate(acts) if a.op is Op.F and a.step == k)
            assert index[(Op.PULL, k)] < first_f < index[(Op.PUSH, k - 1)] or s == p - 1
        last_bw = max(i for i, a in enumerate(acts) if a.op is Op.BW and a.step == 1)
        assert index[(Op.PUSH, 1)] == last_bw + (2 if s > 0 else 1)  # after its SEND_B


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_flushing_steps_repeat_with_pull_and_push_per_step(name):
    p, m, steps = 4, 6, 3
    schedule = get_schedule(name)
    plan = schedule.generate(p, m, steps)
    for acts in plan:
        pulls = [a for a in acts if a.op is Op.PULL]
        pushes = [a for a in acts if a.op is Op.PUSH]
        assert [a.version for a in pulls] == [a.step for a in pulls] == list(range(steps))
        assert [a.step for a in pushes] == list(range(steps))
        for a in acts:
            assert a.version == a.step and (a.mb is None or a.mb // m == a.step)
        last = {"W" if schedule.splits_backward else "BW"}
        for i, a in enumerate(acts):
            if a.op is Op.PUSH:
                assert acts[i - 1].op.value in last | {"SEND_B"}
    one = simulate(schedule.generate(p, m), UNIFORM).makespan
    assert simulate(plan, UNIFORM).makespan == pytest.approx(steps * one)


def test_pull_and_push_times_and_communication_delay_the_plan():
    plan = get_schedule("1f1b").generate(4, 8, steps=2)
    base = simulate(plan, UNIFORM)
    slow = simulate(plan, StageTimes(f=1.0, b=1.0, w=1.0, pull=0.5, push=2.0), comm_s=0.1)
    assert slow.makespan > base.makespan
    assert slow.busy == base.busy  # pull, push and transfers are not compute
    starts = [t[0] for t in slow.timeline[0]]
    assert starts == sorted(starts)
    # Step 1's PULL waits for step 0's PUSH to reach the shards (2.0 after it was posted).
    i_push = next(i for i, a in enumerate(plan[0]) if a.op is Op.PUSH)
    i_pull = next(i for i, a in enumerate(plan[0]) if a.op is Op.PULL and a.step == 1)
    assert slow.timeline[0][i_pull][0] == pytest.approx(slow.timeline[0][i_push][0] + 2.0)


def test_slow_stage_sets_the_pace():
    p, m = 4, 8
    times = [UNIFORM, UNIFORM, StageTimes(f=2.0, b=2.0, w=2.0), UNIFORM]
    r = simulate(get_schedule("1f1b").generate(p, m), times)
    assert r.makespan >= m * 6.0
    assert r.bubble[2] < r.bubble[0]
    with pytest.raises(ValueError, match="3 StageTimes"):
        simulate(get_schedule("1f1b").generate(p, m), times[:3])


def _act(op: Op, stage: int, mb: int | None = None) -> Action:
    return Action(op=op, stage=stage, mb=mb)


def test_deadlock_detector_names_the_stage_and_action():
    # Both stages receive first: stage 0 waits for a gradient stage 1 sends only after its
    # forward, which waits for the activation stage 0 sends only after its backward.
    plan = [
        [_act(Op.PULL, 0), _act(Op.RECV_B, 0, 0), _act(Op.F, 0, 0), _act(Op.SEND_F, 0, 0),
         _act(Op.BW, 0, 0), _act(Op.PUSH, 0)],
        [_act(Op.PULL, 1), _act(Op.RECV_F, 1, 0), _act(Op.F, 1, 0), _act(Op.BW, 1, 0),
         _act(Op.SEND_B, 1, 0), _act(Op.PUSH, 1)],
    ]
    with pytest.raises(DeadlockError) as e:
        simulate(plan, UNIFORM, schedule="hand-made")
    err = e.value
    assert isinstance(err, PlanError)
    assert (err.stage, err.action, err.index, err.schedule, err.p, err.m) == \
        (0, "RECV_B0", 1, "hand-made", 2, 1)
    assert "stage 1 waits at RECV_F0" in str(err) and "stage 0 waits at RECV_B0" in str(err)


def test_a_receive_whose_send_never_comes_deadlocks():
    plan = get_schedule("gpipe").generate(2, 2)
    plan[0] = [a for a in plan[0] if not (a.op is Op.SEND_F and a.mb == 1)]
    with pytest.raises(DeadlockError, match="stage 1 waits at RECV_F1"):
        simulate(plan, UNIFORM)
    with pytest.raises(PlanError, match="never sent"):
        check(plan)


@pytest.mark.parametrize("edit,match", [
    (lambda acts: [a for a in acts if a.op is not Op.RECV_F], "F before its RECV_F"),
    (lambda acts: [a for a in acts if a.op is not Op.PULL], "not pulled"),
    (lambda acts: [a for a in acts if not (a.op is Op.W and a.mb == 0)], "exactly one backward"),
    (lambda acts: [a for a in acts if a.op is not Op.PUSH], "no PUSH"),
    (lambda acts: sorted(acts, key=lambda a: a.op is not Op.W), "W before"),
])
def test_contract_checker_names_the_broken_rule(edit, match):
    plan = get_schedule("zb-h1").generate(3, 4)
    check(plan)
    plan[1] = edit(list(plan[1]))
    with pytest.raises(PlanError, match=match):
        check(plan, schedule="zb-h1")


def test_three_live_versions_are_refused_and_counted():
    def a(op: Op, mb: int | None, version: int) -> Action:
        return Action(op=op, stage=0, mb=mb, version=version)

    plan = [[a(Op.PULL, None, 0), a(Op.F, 0, 0), a(Op.PULL, None, 1), a(Op.F, 1, 1),
             a(Op.PULL, None, 2), a(Op.F, 2, 2), a(Op.BW, 0, 0), a(Op.BW, 1, 1),
             a(Op.BW, 2, 2), a(Op.PUSH, None, 2)]]
    assert simulate(plan, UNIFORM).max_live_versions == (3,)
    with pytest.raises(PlanError, match="more than 2 weight versions") as e:
        check(plan, schedule="hand-made")
    assert "action 4 (PULL)" in str(e.value)  # pulling version 2 while 0 and 1 are in flight


# Profiled op times and bubble rates (1F1B, ZB-H1) from the table in the trailing docstring of
# sail-sg/zero-bubble-pipeline-parallelism megatron/core/pipeline_parallel/efficiency.py:
# p, m, T_F, T_B, T_W, T_comm; bubble rate = (makespan - m (F+B+W)) / makespan.
ZB_TABLE = [(8, 24, 18522, 18086, 9337, 601, 0.2431, 0.1585),
            (8, 32, 18513, 18086, 9331, 626, 0.1985, 0.1242),
            (8, 64, 18546, 18097, 9321, 762, 0.1240, 0.0674),
            (16, 48, 11347, 11248, 8132, 377, 0.2552, 0.1397)]


@pytest.mark.parametrize("p,m,f,b,w,c,rate_1f1b,rate_h1", ZB_TABLE)
def test_bubble_rates_match_the_zero_bubble_papers_table(p, m, f, b, w, c, rate_1f1b, rate_h1):
    times, ideal = StageTimes(f=f, b=b, w=w), m * (f + b + w)
    for name, rate in (("1f1b", rate_1f1b), ("zb-h1", rate_h1)):
        makespan = simulate(get_schedule(name).generate(p, m), times, comm_s=c).makespan
        assert (makespan - ideal) / makespan == pytest.approx(rate, abs=5e-5)


def _compute_order(acts):
    return [(a.op.value, a.mb) for a in acts if a.op in COMPUTE]


def test_orders_match_torch_pipelining_single_stage_per_rank():
    """torch.distributed.pipelining as the oracle: its rank-op builder with one stage per rank
    gives 1F1B (warm-up p - rank - 1) and, with zero bubble on (ScheduleInterleavedZeroBubble's
    settings: ``rank`` weight backwards held back), ZB-H1: the same compute order as ours."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rank_ops = getattr(torch_schedules, "_get_1f1b_rank_ops", None)
    if rank_ops is None:
        pytest.skip("this torch has no _get_1f1b_rank_ops")
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "BW", "BACKWARD_INPUT": "B",
             "BACKWARD_WEIGHT": "W"}
    for p in range(1, 9):
        for m in range(p, 17):
            for name, zero_bubble in (("1f1b", False), ("zb-h1", True)):
                plan = get_schedule(name).generate(p, m)
                for rank in range(p):
                    warmup = min(p - rank - 1, m)
                    ops = rank_ops(1, p, warmup, m - warmup, warmup, rank, lambda _, r=rank: r,
                                   lambda _, r=rank: r, num_1f1b_microbatches=rank,
                                   enable_zero_bubble=zero_bubble)
                    theirs = [(kinds[a.computation_type.name], a.microbatch_index)
                              for a in ops if a is not None]
                    assert theirs == _compute_order(plan[rank]), (name, p, m, rank)


def test_per_action_overhead_is_idle_time_paid_per_compute_action():
    """``action_overhead_s`` delays every compute action without counting as busy: one stage,
    m micro-batches of F and BW, so 2m actions each pay it once."""
    from bitps.worker.pipeline.schedules import get_schedule
    from bitps.worker.pipeline.simulate import StageTimes, simulate

    plan = get_schedule("gpipe").generate(1, 4)
    base = simulate(plan, StageTimes(f=1.0, b=1.0, w=1.0))
    slow = simulate(plan, StageTimes(f=1.0, b=1.0, w=1.0), action_overhead_s=0.25)
    assert base.makespan == 12.0 and slow.makespan == 12.0 + 8 * 0.25
    assert slow.busy == base.busy == (12.0,)
    assert slow.bubble_max == pytest.approx(2.0 / 14.0)
    zbv = get_schedule("zb-v").generate(4, 8)  # twice the compute actions of zb-h1
    h1 = get_schedule("zb-h1").generate(4, 8)
    cost = {name: simulate(p, StageTimes(1.0, 1.0, 1.0), action_overhead_s=0.1).makespan
            - simulate(p, StageTimes(1.0, 1.0, 1.0)).makespan for name, p in
            (("zb-v", zbv), ("zb-h1", h1))}
    assert cost["zb-v"] > cost["zb-h1"]
    with pytest.raises(ValueError, match="action_overhead_s must be >= 0"):
        simulate(plan, StageTimes(1.0, 1.0, 1.0), action_overhead_s=-1.0)
