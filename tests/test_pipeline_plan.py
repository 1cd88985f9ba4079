"""Planning a pipeline run, in one process: the min-max stage partition (against brute force),
the micro-batch tuner on a synthetic time model (picks the true best, holds with hysteresis,
follows drift), and ParallelConfig's checks (the problem statement's dict, every refusal)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from bitps.proto.settings import from_field
from bitps.worker.pipeline.config import ParallelConfig
from bitps.worker.pipeline.errors import ConfigError, PartitionError, PlanError
from bitps.worker.pipeline.microbatch import MicroBatchTuner
from bitps.worker.pipeline.partition import balance, imbalance, uniform
from bitps.worker.pipeline.schedules import get_schedule
from bitps.worker.pipeline.simulate import StageTimes, simulate

# --- partition ------------------------------------------------------------------------------


def _all_cuts(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _stage_costs(costs, ranges):
    return [sum(costs[i] for i in r) for r in ranges]


def test_balance_equals_brute_force_on_random_cases():
    rng = random.Random(18)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 3.0, rng.random() * 10]) for _ in range(n)]
        got = balance(costs, parts)
        assert len(got) == parts and all(len(r) >= 1 for r in got)
        assert [i for r in got for i in r] == list(range(n))  # contiguous, in order, complete
        best = min(max(_stage_costs(costs, c)) for c in _all_cuts(n, parts))
        assert max(_stage_costs(costs, got)) == pytest.approx(best, rel=1e-12)
        # Tie-break: the most even of the optimal cuts.
        even = min(sum(x * x for x in _stage_costs(costs, c)) for c in _all_cuts(n, parts)
                   if max(_stage_costs(costs, c)) <= best * (1 + 1e-12))
        assert sum(x * x for x in _stage_costs(costs, got)) == pytest.approx(even, rel=1e-9)
        assert balance(list(costs), parts) == got  # deterministic


def test_balance_beats_equal_layer_counts_and_reports_imbalance():
    costs = [8.0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 6.0]  # a heavy embedding and head
    ranges = balance(costs, 4)
    assert imbalance(costs, ranges) < imbalance(costs, uniform(len(costs), 4))
    assert max(_stage_costs(costs, ranges)) == 8.0
    assert balance([1, 1, 1, 1, 10], 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert imbalance([2, 2, 2, 2], [range(0, 2), range(2, 4)]) == 1.0
    assert imbalance([0, 0], [range(0, 1), range(1, 2)]) == 1.0
    assert uniform(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


@pytest.mark.parametrize("costs,parts,match", [
    ([1.0, 2.0], 3, "at most 2"), ([1.0], 0, "at least 1"), ([1.0, -1.0], 1, "layer 1 cost"),
    ([1.0, float("nan")], 2, "finite"),
])
def test_balance_refuses_impossible_partitions(costs, parts, match):
    with pytest.raises(PartitionError, match=match) as e:
        balance(costs, parts)
    assert (e.value.layers, e.value.parts) == (len(costs), parts)
    assert isinstance(e.value, ValueError)


# --- micro-batch tuner ----------------------------------------------------------------------

G, P = 96, 4


def _truth(b: int, overhead: float) -> list[StageTimes]:
    """Synthetic per-micro-batch times: a fixed overhead plus a per-sample cost; stage 2 slower."""
    base = overhead + 0.001 * b
    return [StageTimes(f=base * (1.3 if s == 2 else 1.0), b=base, w=0.5 * base, pull=0.002,
                       push=0.003) for s in range(P)]


def _true_step(schedule: str, b: int, overhead: float) -> float:
    plan = get_schedule(schedule)
    m = G // b
    return (simulate(plan.generate(P, m, 3), _truth(b, overhead)).makespan
            - simulate(plan.generate(P, m, 2), _truth(b, overhead)).makespan)


def _run(tuner: MicroBatchTuner, b: int, overhead: float, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        tuner.observe(b, _truth(b, overhead))
        b = tuner.choose()
        chosen.append(b)
    return chosen


def test_tuner_candidates_respect_range_divisibility_and_schedule():
    t = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    assert t.candidates == (4, 6, 8, 12, 16)
    # 1F1B refuses m < p: with 32 samples, 16 per micro-batch would leave m = 2 < 4.
    t = MicroBatchTuner(samples_per_step=32, schedule="1f1b", p=P, start=8)
    assert t.candidates == (4, 8)
    assert MicroBatchTuner(samples_per_step=32, schedule="gpipe", p=P, start=8).candidates == \
        (4, 8, 16)
    with pytest.raises(PlanError, match="no micro-batch size"):
        MicroBatchTuner(samples_per_step=34, schedule="1f1b", p=P, start=17)
    with pytest.raises(ValueError, match="micro-batch size 5"):
        MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=5)


@pytest.mark.parametrize("schedule,overhead", [("1f1b", 0.002), ("1f1b", 0.0), ("gpipe", 0.002),
                                               ("zb-h1", 0.008), ("2bw", 0.004)])
def test_tuner_measures_the_ends_then_picks_the_true_best(schedule, overhead):
    tuner = MicroBatchTuner(samples_per_step=G, schedule=schedule, p=P, start=8)
    assert tuner.choose() == 8  # nothing measured yet: keep the size in use
    chosen = _run(tuner, 8, overhead, steps=6)
    assert chosen[:2] == [4, 16]  # the two ends first
    true = {b: _true_step(schedule, b, overhead) for b in tuner.candidates}
    best = min(true, key=true.get)
    # The model is exact on a linear time model, so the prediction is the truth.
    for b in tuner.candidates:
        assert tuner.predict(b) == pytest.approx(true[b], rel=1e-9)
    assert true[chosen[-1]] <= true[best] * 1.03  # the best, or within the hysteresis
    if true[16] > true[best] * 1.03:
        assert chosen[-1] == best
    assert len(set(chosen[2:])) == 1  # then it stays


def test_tuner_with_one_size_scales_compute_with_samples():
    tuner = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    tuner.observe(8, _truth(8, 0.002))
    model = tuner.model(16)
    assert model[0].f == pytest.approx(2 * _truth(8, 0.002)[0].f)
    assert model[0].pull == pytest.approx(0.002)  # weights move, not samples: constant
    with pytest.raises(ValueError, match="StageTimes for 4 stages"):
        tuner.observe(8, _truth(8, 0.002)[:3])


def test_tuner_holds_under_noise_and_switches_when_times_drift():
    tuner = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    assert _run(tuner, 8, 0.002, steps=4)[-1] == 8  # best of 4..16 with this overhead
    rng = random.Random(3)
    for _ in range(20):  # +-2 % noise: averaged, no switch
        noisy = [dataclasses.replace(t, f=t.f * (1 + rng.uniform(-0.02, 0.02)))
                 for t in _truth(8, 0.002)]
        tuner.observe(8, noisy)
        assert tuner.choose() == 8
    # The per-micro-batch overhead vanishes (e.g. a faster kernel launch path): 4 becomes best
    # by 10 %. The tuner sees the change at 8 twice in a row (once could be a one-off), drops
    # the stale sizes, re-explores, and switches.
    chosen = _run(tuner, 8, 0.0, steps=6)
    true = {b: _true_step("1f1b", b, 0.0) for b in tuner.candidates}
    assert min(true, key=true.get) == 4
    assert chosen[0] == 8 and chosen[1:3] == [4, 16] and chosen[-1] == 4


def test_tuner_ignores_a_one_off_slow_step():
    """One step 40 % slower (other load on the host) moves the average, not the exploration."""
    tuner = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    assert _run(tuner, 8, 0.002, steps=4)[-1] == 8
    slow = [dataclasses.replace(t, f=t.f * 1.4, b=t.b * 1.4, w=t.w * 1.4)
            for t in _truth(8, 0.002)]
    tuner.observe(8, slow)
    assert tuner.choose() == 8 and tuner.measured == (4, 8, 16)
    tuner.observe(8, _truth(8, 0.002))
    assert tuner.choose() == 8 and tuner.measured == (4, 8, 16)


def _shared_step(b: int, overhead: float, cores: int = 2) -> float:
    """The step time of P stage processes sharing ``cores`` CPU cores (this machine: 4 stages on
    2 cores): no stage waits for compute it does not do, so the step is the replica's total
    compute over the cores, whatever bubble the simulator would count."""
    m = G // b
    return sum(m * (t.f + t.b + t.w) + t.pull + t.push for t in _truth(b, overhead)) / cores


def test_tuner_calibrated_by_measured_step_times_picks_the_measured_best():
    """Where stages share compute the simulator's bubble is not paid: measured step walls
    calibrate the prediction, so the tuner picks the size that is fastest as measured (16:
    fewest per-micro-batch overheads), not the simulator's (8)."""
    overhead = 0.002
    plain = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    assert _run(plain, 8, overhead, steps=6)[-1] == 8
    tuner = MicroBatchTuner(samples_per_step=G, schedule="1f1b", p=P, start=8)
    b, chosen = 8, []
    for _ in range(6):
        tuner.observe(b, _truth(b, overhead), step_s=_shared_step(b, overhead))
        b = tuner.choose()
        chosen.append(b)
    measured_best = min(tuner.candidates, key=lambda c: _shared_step(c, overhead))
    assert measured_best == 16 and chosen[:2] == [4, 16] and chosen[-1] == 16
    for c in (4, 8, 16):  # measured sizes: the prediction is the measurement
        assert tuner.predict(c) == pytest.approx(_shared_step(c, overhead), rel=1e-9)
    assert tuner.calibration(12) == pytest.approx(
        0.5 * (tuner.calibration(8) + tuner.calibration(16)))
    with pytest.raises(ValueError, match="step_s must be a positive"):
        tuner.observe(8, _truth(8, overhead), step_s=0.0)


# --- ParallelConfig -------------------------------------------------------------------------

PROBLEM = {"data_parallel_size": 2, "pipeline_parallel_size": 4, "micro_batch_size": 8,
           "gradient_accumulation_steps": 4}


def test_problem_statement_dict_is_accepted():
    cfg = ParallelConfig.from_mapping(PROBLEM)
    cfg.check(num_layers=24, global_batch=64)
    assert (cfg.global_batch, cfg.replica_batch, cfg.world_size) == (64, 32, 8)
    assert cfg.schedule == "1f1b" and not cfg.dynamic_micro_batch
    dyn = dataclasses.replace(cfg, dynamic_micro_batch=True)
    dyn.check(num_layers=24)
    assert dyn.micro_batch_choices() == (4, 8)  # 16 would leave m = 2 < p = 4 for 1F1B


def test_tuner_from_config():
    cfg = ParallelConfig.from_mapping({**PROBLEM, "dynamic_micro_batch": True})
    tuner = MicroBatchTuner.from_config(cfg, threshold=0.05)
    assert (tuner.samples_per_step, tuner.p, tuner.current, tuner.threshold) == (32, 4, 8, 0.05)
    assert tuner.candidates == cfg.micro_batch_choices() == (4, 8)


def test_fields_make_settings():
    for f in dataclasses.fields(ParallelConfig):
        s = from_field(ParallelConfig, f.name, help=f.name)
        assert s.default == f.default
    assert "2bw" in from_field(ParallelConfig, "schedule", help="").choices
    assert tuple(from_field(ParallelConfig, "balance", help="").choices) == ("profile", "uniform")


@pytest.mark.parametrize("change,num_layers,error,match", [
    ({"pipeline_parallel_size": 8}, 6, ConfigError, "at most the model's 6 layers"),
    ({"gradient_accumulation_steps": 2}, 24, PlanError, "p=4 stages with m=2"),
    ({"schedule": "zb-h1", "gradient_accumulation_steps": 3}, 24, PlanError, "'zb-h1'"),
    ({"dynamic_micro_batch": True, "micro_batch_size": 32, "micro_batch_max": 16}, 24,
     ConfigError, r"micro_batch_size=32: expected a size in \[micro_batch_min"),
    ({"dynamic_micro_batch": True, "micro_batch_size": 2}, 24, ConfigError,
     r"micro_batch_size=2: expected a size in \[micro_batch_min, micro_batch_max\] = \[4, 16\]"),
])
def test_inconsistent_configs_are_refused_by_check(change, num_layers, error, match):
    cfg = ParallelConfig.from_mapping({**PROBLEM, **change})
    with pytest.raises(error, match=match):
        cfg.check(num_layers=num_layers)


@pytest.mark.parametrize("values,match", [
    ({**PROBLEM, "tensor_parallel_size": 2}, "tensor_parallel_size.*only the keys"),
    ({**PROBLEM, "data_parallel_size": 0}, "data_parallel_size=0: expected an integer >= 1"),
    ({**PROBLEM, "micro_batch_size": 8.0}, "micro_batch_size=8.0: expected an int"),
    ({**PROBLEM, "schedule": "interleaved"}, "schedule='interleaved': expected one of"),
    ({**PROBLEM, "balance": "parameters"}, "balance='parameters'"),
    ({**PROBLEM, "micro_batch_min": 17}, "micro_batch_min=17: expected at most"),
    ({**PROBLEM, "lookahead": 1}, "lookahead=1: expected a bool"),
])
def test_bad_fields_are_refused_at_construction(values, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig.from_mapping(values)


def test_global_batch_must_match():
    with pytest.raises(ConfigError, match="global_batch=60: expected .* = 64"):
        ParallelConfig.from_mapping(PROBLEM).check(num_layers=24, global_batch=60)
