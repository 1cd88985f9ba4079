"""bitps-bench runs the real path and writes the agreed JSON + Markdown layout (smoke runs:
figures from a loaded test machine prove nothing, so no ratio is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pushpull_quick_writes_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), "pushpull",
                          "--quick", "--sizes-mib", "0.25", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr  # 1 = a goal missed, still a complete run
    doc = json.loads((tmp_path / "pushpull.json").read_text())
    assert set(doc) >= {"config", "versions", "machine", "rows", "checks"}
    assert doc["versions"]["pyzmq"] and doc["machine"]["cores"] >= 1
    cases = [r["case"] for r in doc["rows"]]
    assert cases == ["push+pull 0.25 MiB", "round trip 1024 B", "idle shard, 2 s"]
    for row in doc["rows"][:2]:
        assert row["bitps_ms"] > 0 and row["raw_ms"] > 0 and row["ratio"] > 0
    assert doc["rows"][2]["idle_cpu_ms_per_s"] > 0  # the scheduler's ns: never a round 0
    assert set(doc["checks"]) == {"throughput_0.25MiB_vs_raw", "small_round_trip_vs_raw",
                                  "idle_shard_cpu_ms_per_s"}
    for c in doc["checks"].values():
        assert set(c) == {"value", "goal", "ok"} and isinstance(c["ok"], bool)
    md = (tmp_path / "pushpull.md").read_text()
    assert "| push+pull 0.25 MiB |" in md and "| check | value | goal | ok |" in md


def _bench(tmp_path, *args, timeout=300) -> dict:
    out = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode in (0, 1), out.stderr  # 1 = a goal missed, still a complete run
    doc = json.loads((tmp_path / f"{args[0]}.json").read_text())
    assert set(doc) >= {"config", "versions", "machine", "rows", "checks"}
    for c in doc["checks"].values():
        assert set(c) == {"value", "goal", "ok"} and isinstance(c["ok"], bool)
    assert (tmp_path / f"{args[0]}.md").read_text().count("|") > 10
    return doc


def test_volume_table_is_exact_arithmetic(tmp_path):
    doc = _bench(tmp_path, "volume")
    rows = {(r["model"].split()[0], r["scheme"]): r for r in doc["rows"]}
    assert rows[("30B", "fp32")]["push_GB"] == 120.0
    # 1 MiB keys: 262144 / 8 bytes of signs + 1024 scales (1-bit Adam's chunk of 256) per key
    per_key = 262144 // 8 + 4 * 1024
    keys = -(-30_000_000_000 // 262144)
    assert abs(rows[("30B", "1-bit Adam (both ways)")]["push_GB"] * 1e9 - keys * per_key) \
        < 1e6  # the last key is partial
    assert doc["checks"]["stage_fp32_push_GB"]["ok"]


def test_codec_bench_runs_every_implementation(tmp_path):
    doc = _bench(tmp_path, "codec", "--mib", "1", "--repeats", "1")
    impls = {(r["operation"], r["implementation"]) for r in doc["rows"]}
    assert ("sign1 compress + EF", "torch ops") in impls
    assert ("sparse natexp8 compress + EF", "numpy reference") in impls
    assert all(r["ms"] > 0 for r in doc["rows"])


def test_kernels_bench_measures_every_case_against_its_floor(tmp_path):
    from bitps.bench.kernels import CASES, SCALING_CASES
    from bitps.bench.worker_kernels import ENCODER_SCALING_CASES, WORKER_CASES

    doc = _bench(tmp_path, "kernels", "--quick")
    rows = {r["case"]: r for r in doc["rows"]}
    assert list(rows) == [c.name for c in CASES] + [c.name for c in WORKER_CASES]
    assert doc["config"]["bandwidth_gbps"] > 0 and 0 <= doc["config"]["machine_busy_before"] <= 1
    n_bytes = doc["config"]["mib"] * 2**20
    for case in CASES:
        row = rows[case.name]
        assert row["cpu_ms"] > 0 and row["floor_ms"] > 0
        # the floor counts every array the accounting names, and the codes on top
        arrays = (case.reads + case.writes) * n_bytes / 1e6
        codes = row["floor_mb"] - arrays
        assert (codes > 0) == (case.push == "sign1" or case.pull == "sign1"), case.name
        # at most each worker's push and a published code
        assert codes < (case.workers + 1) * n_bytes / 32 / 1e6 * 1.1
        # sign1 pushes are read in the rule's kernel (Adam, 1-bit Adam): timed beside the
        # decoded path; a sync step of several codes summed in it, beside their sum first
        assert (row["decoded_first_ms"] is not None) == (case.push == "sign1"), case.name
        if case.push == "sign1":
            assert row["decoded_first_vs_floor"] * row["floor_ms"] == \
                pytest.approx(row["decoded_first_ms"])
        assert (row["summed_first_ms"] is not None) == (case.workers > 1), case.name
    assert doc["config"]["worker_bandwidth_gbps"] > 0
    for case in WORKER_CASES:
        row = rows[case.name]
        assert row["cpu_ms"] > 0 and row["floor_ms"] > 0
        arrays = (case.reads + case.writes) * n_bytes / 1e6
        codes = row["floor_mb"] - arrays
        # a raw push and a raw pull add no code bytes; a compressed push or pull does
        assert (codes > 0) == (case.push != "raw" or case.pull != "raw"), case.name
        assert codes <= 0.51 * n_bytes / 1e6  # at most a bf16 push and a sign1 pull
    # raw pulls (not 1-bit Adam's, whose sync pulls are codes) carry libzmq's receive bound
    raw_pulls = [c.name for c in WORKER_CASES if c.pull == "raw" and not c.onebit]
    assert raw_pulls and doc["config"]["raw_receive_ms"] > 0
    for case in WORKER_CASES:
        bound = rows[case.name]["raw_receive_bound_vs_floor"]
        assert (bound is not None) == (case.name in raw_pulls), case.name
        if bound is not None:  # the floor with libzmq's receive for the pull's memcpy
            floor = rows[case.name]["floor_ms"]
            memcpy = 2 * n_bytes / (doc["config"]["worker_bandwidth_gbps"] * 1e9) * 1e3
            assert bound * floor == pytest.approx(floor - memcpy
                                                  + doc["config"]["raw_receive_ms"])
    assert set(doc["checks"]) == {f"shard_cpu_vs_floor[{c.name}]" for c in CASES} \
        | {f"worker_cpu_vs_floor[{c.name}]" for c in WORKER_CASES} \
        | {f"worker_raw_receive_bound_vs_floor[{name}]" for name in raw_pulls} \
        | {f"threads_2_vs_1[{name}]" for name in SCALING_CASES} \
        | {f"threads_2_vs_1[{name} (encode)]" for name in ENCODER_SCALING_CASES}
    # each row carries its bound: memcpy of the same bytes on as many threads, same rounds
    scaled = [*SCALING_CASES, *(f"{name} (encode)" for name in ENCODER_SCALING_CASES)]
    assert [(r["case"], r["threads"]) for r in doc["config"]["scaling"]] == [
        (name, 2) for name in scaled]
    for r in doc["config"]["scaling"]:
        assert r["ms"] > 0 and r["ms_1"] > 0 and r["memcpy_ms"] > 0 and r["memcpy_ms_1"] > 0
        assert r["memcpy_speedup"] == pytest.approx(r["memcpy_ms_1"] / r["memcpy_ms"])


# One run of each kind the bench makes (1-bit Adam in every mode, 4 workers, a compensation,
# DiLoCo, sign1 with clipping); _chosen adds their peers. Every run's flags are parsed by
# test_every_convergence_run_parses below, without starting processes.
_SMOKE_RUNS = ("1-bit Adam (sync)", "1-bit Adam (ssp S=2)", "1-bit Adam (async)",
               "1-bit Adam (ssp S=2), 4 workers", "fp32 Adam (async), DC-ASGD",
               "DiLoCo H=8, sign1 (sync)", "DiLoCo H=32, sign1 (sync)",
               "sign1 + EF, clip 1.0, Adam (sync), overlap off")


@pytest.mark.timeout(900)  # 14 runs of 4-6 processes each: about 100 s alone, more when shared
def test_convergence_bench_smoke(tmp_path):
    """A few steps of a run of each kind (the sweep at --lr alone): the curves, the PNG, the
    byte counts and the checks of the runs made come out."""
    doc = _bench(tmp_path, "convergence", "--steps", "12", "--seeds", "0", "--lr", "3e-3",
                 "--sweep-lrs", "3e-3", "--runs", *_SMOKE_RUNS, timeout=600)
    from bitps.bench.convergence import RUNS, _chosen

    assert [r["run"] for r in doc["rows"]] == list(_chosen(_SMOKE_RUNS)) and \
        set(_SMOKE_RUNS) < set(RUNS)
    assert (tmp_path / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    by = {r["run"]: r for r in doc["rows"]}
    fp32 = by["fp32 Adam (sync)"]["push_bytes_per_step"]
    for run in ("1-bit Adam (sync)", "1-bit Adam (ssp S=2)", "1-bit Adam (async)",
                "1-bit Adam (ssp S=2), 4 workers"):
        assert 0 < by[run]["push_bytes_per_step"] < fp32
        assert by[run]["vs_same_mode_fp32"] > 0
    assert by["fp32 Adam (async), DC-ASGD"]["vs_same_mode_fp32"] > 0
    assert set(doc["checks"]) == {
        "compensation_fp32_adam_async_dc-asgd_vs_off_each_at_best_lr",
        "onebit_sync_final_loss_vs_fp32_each_at_best_lr",
        "onebit_ssp_final_loss_vs_fp32_each_at_best_lr",
        "onebit_async_final_loss_vs_fp32_each_at_best_lr",
        "onebit_ssp_4_workers_final_loss_vs_fp32_each_at_best_lr",
        "sign1_sync_traffic_reduction_vs_fp32",
        "fp32_async_vs_sync_final_loss_each_at_best_lr",
        "fp32_ssp_vs_sync_final_loss_each_at_best_lr",
        "diloco_h8_sync_final_loss_vs_fp32_sync",
        "local_sgd_h8_raw_final_loss_vs_fp32_sync",
        "diloco_h8_sync_bytes_per_sample_reduction_vs_fp32_sync"}
    # 12 steps: one H=8 round, so DiLoCo pushed once; H=32 never did
    diloco = by["DiLoCo H=8, sign1 (sync)"]
    assert 0 < diloco["push_bytes_per_step"] < fp32 / 100
    assert by["DiLoCo H=32, sign1 (sync)"]["push_bytes_per_step"] == 0
    for run in ("fp32 Adam (sync)", "fp32 Adam (async)", "fp32 Adam (ssp S=2)"):
        assert set(by[run]["sweep"]) == {"0.003"}  # --lr and --sweep-lrs: one point
        assert by[run]["best_final_loss"] == min(by[run]["sweep"].values())
    sign1 = by["sign1 + EF, clip 1.0, Adam (sync), overlap off"]
    assert sign1["pull_bytes_per_step"] < by["fp32 Adam (sync)"]["pull_bytes_per_step"] / 4


def test_every_convergence_run_parses():
    """Each run's launcher, shard and worker flags are accepted by their programs' own
    parsers: a run the smoke test does not make still starts."""
    from bitps.bench.convergence import RUNS
    from bitps.ps.__main__ import parse_config as shard_config
    from bitps.worker.__main__ import parse_config as worker_config
    from bitps.worker.launch.launcher import build_parser

    for name, (launch_args, worker_args) in RUNS.items():
        args = build_parser().parse_args(launch_args)
        given = [f"--{flag}={v}" for flag, v in (("mode", args.mode),
                                                 ("staleness", args.staleness),
                                                 ("optimizer", args.optimizer)) if v is not None]
        shard, _ = shard_config([*given, *args.server_arg], environ={})
        worker, _ = worker_config([*worker_args, "--algorithm", args.algorithm,
                                   "--servers", "127.0.0.1:1"], environ={})
        assert shard.mode == (args.mode or shard.mode), name
        assert worker.algorithm.name == args.algorithm, name


def test_a_convergence_runs_own_server_settings_win_over_the_benchs(tmp_path):
    """The bench passes every run its 1-bit Adam switch step and beta2; a run that sets either
    itself must get its own: the run's server args come after the bench's, and the shard's
    reader keeps the last of a flag. Before, the bench's came last and silently won."""
    from bitps.bench.convergence import launch_argv
    from bitps.ps.__main__ import parse_config as shard_config
    from bitps.worker.launch.launcher import build_parser

    def shard(run_args):
        argv = launch_argv(["--optimizer", "onebit_adam", *run_args], [], steps=10, freeze=3,
                           lr=1e-3, beta2=0.999, seed=0, run_dir=tmp_path)
        args = build_parser().parse_args(argv[argv.index("bitps.worker.launch") + 1:
                                              argv.index("--")])
        cfg, _ = shard_config([f"--optimizer={args.optimizer}", *args.server_arg], environ={})
        return cfg.optimizer

    own = shard(["--server-arg=--beta2=0.99", "--server-arg=--freeze-step=7"])
    assert own.beta2 == 0.99 and own.rule_config.freeze_step == 7
    bench = shard([])  # and without them, the bench's
    assert bench.beta2 == 0.999 and bench.rule_config.freeze_step == 3


def test_overlap_bench_smoke(tmp_path):
    """A small model, one ratio, few steps: the one-worker cases, two workers in sync, sign1
    with clipping; the link named (a shaped veth link where namespaces can be made, else
    loopback with the reason), CPU read from /proc, every check present."""
    doc = _bench(tmp_path, "overlap", "--quick", "--width", "128", "--depth", "4",
                 "--comm-ratios", "0.8", "--bucket-bytes", "65536", timeout=400)
    assert [r["case"] for r in doc["rows"]] == [
        "1 worker: compute-only", "1 worker: overlap off", "1 worker: overlap on",
        "2 workers sync: overlap off", "2 workers sync: overlap on",
        "sign1 + clip: compute-only", "sign1 + clip: overlap off", "sign1 + clip: overlap auto"]
    # /proc counts CPU in clock ticks (10 ms): a few steps of a small model may read 0
    assert all(r["step_ms"] > 0 and r["cpu_ms"] >= 0 <= r["shard_cpu_ms"] for r in doc["rows"])
    assert doc["config"]["link"] in ("netns", "loopback") and doc["config"]["link_note"]
    assert 0 <= doc["config"]["machine_busy_before"] <= 1
    assert set(doc["checks"]) == {"overlap_on_utilization_at_ratio_0.8",
                                  "overlap_on_step_vs_compute_only_at_ratio_0.8",
                                  "two_workers_sync_overlap_on_completes",
                                  "two_workers_sync_overlap_on_vs_off",
                                  "compressed_clip_auto_turns_overlap_on",
                                  "compressed_clip_overlap_on_vs_off"}
    assert doc["checks"]["two_workers_sync_overlap_on_completes"]["ok"]
    assert doc["checks"]["compressed_clip_auto_turns_overlap_on"]["ok"]


def test_memory_bench_smoke(tmp_path):
    """Every allocator replays the recorded trace; every budget and policy trains."""
    doc = _bench(tmp_path, "memory", "--quick", "--micro", "3", "--in-flight", "2", timeout=300)
    replay = [r for r in doc["rows"] if r["part"] == "replay"]
    assert {r["config"] for r in replay} >= {"buddy", "buddy+trim", "best-fit (default)"}
    assert all(r["allocs"] > 0 for r in replay)
    training = [r for r in doc["rows"] if r["part"] == "training"]
    assert len(training) == 12 and all(r.get("grads_identical", True) for r in training)
    assert "schedule_vs_lru_bytes_at_50pct" in doc["checks"]
    # The optimum is a lower bound: no policy offloads fewer bytes at the same budget.
    for budget in ("75%", "50%", "10%"):
        at = {r["config"]: r["evicted_mib_per_step"] for r in training if r["budget"] == budget}
        assert at["optimum (Belady bound)"] <= min(at["pool lru"], at["pool schedule"])
        assert at["optimum (Belady bound)"] > 0


def test_fewest_evicted_is_beladys_optimum_on_hand_traces():
    """Three tensors of 4 bytes in 8: the one freed last is offloaded (4 bytes); with sizes
    3, 3, 4 only the 2 bytes over capacity must go; nothing when everything fits, and a
    tensor freed before the next birth never counts."""
    from bitps.bench.memory import _fewest_evicted

    def trace(sizes, frees):
        return [("alloc", i, n) for i, n in enumerate(sizes)] + [("free", i) for i in frees]

    assert _fewest_evicted(trace([4, 4, 4], [0, 1, 2]), 8) == 4
    assert _fewest_evicted(trace([3, 3, 4], [2, 1, 0]), 8) == 2
    assert _fewest_evicted(trace([4, 4, 4], [0, 1, 2]), 12) == 0
    # ids are reused after a free, as Python ids are
    reuse = [("alloc", 0, 8), ("free", 0), ("alloc", 0, 8), ("alloc", 1, 4), ("free", 1),
             ("free", 0)]
    assert _fewest_evicted(reuse, 8) == 4


def _cells(md: str, first_cell: str) -> list[str]:
    """The cells of the Markdown table row that starts with ``first_cell``."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r}")


def test_e2e_quick_and_report_figures_equal_the_json(tmp_path):
    """A real emulated-cluster run (namespaces where they can be made, else loopback) of the
    peers and two bitps runs, then ``bitps-bench report``: every figure the report prints for
    the e2e runs and for the claims is the JSON's."""
    from bitps.bench.report import _fmt

    cases = ["compute-only", "ceiling (no traffic)", "DDP fp32", "bitps sync fp32",
             "bitps async fp32", "bitps async sign1"]
    out = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), "e2e",
                          "--quick", "--name", "e2e-tiny", "--cases", *cases],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads((tmp_path / "e2e-tiny.json").read_text())
    assert [r["run"] for r in doc["rows"]] == cases
    assert doc["config"]["memcpy_gbps"] > 0 and doc["config"]["target_loss"] > 0
    by = {r["run"]: r for r in doc["rows"]}
    for name in cases[2:]:
        r = by[name]
        assert r["lr"] == 3e-3 and r["final_loss"] > 0 and r["samples_per_s"] > 0
        assert r["wire_mb_per_step"] is None or r["wire_mb_per_step"] > 0
    assert by["bitps sync fp32"]["shard_cpu_ms"] and not by["DDP fp32"]["shard_cpu_ms"]
    # on namespaces (a measured link), each bitps run's link floor from its steps' bytes
    for name in cases[2:]:
        floor = by[name].get("link_floor_vs_ceiling")
        if doc["config"]["raw_link"] and name.startswith("bitps"):
            assert 0 < floor <= 1, name
        else:
            assert floor is None, name
    curves = json.loads((tmp_path / "e2e-tiny_curves.json").read_text())
    assert len(curves["DDP fp32"]["loss"]) == 30

    rep = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), "report"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "REPORT.md").read_text()
    for png in ("loss_time", "loss_samples", "throughput", "wire"):
        assert (tmp_path / f"e2e-tiny_{png}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"(e2e-tiny_{png}.png)" in md
    for name in cases:
        cells = _cells(md, name)
        assert cells[2] == _fmt(by[name]["samples_per_s"])  # the e2e table's samples/s
        assert cells[4] == _fmt(by[name]["step_ms"])
    from bitps.bench.e2e_report import best_run

    best = best_run(doc["rows"])
    ddp = by["DDP fp32"]
    thr = _cells(md, "throughput (samples/s)")
    assert thr[2:4] == [_fmt(ddp["samples_per_s"]), _fmt(best["samples_per_s"])]
    step = _cells(md, "step time (ms)")
    assert step[2:4] == [_fmt(ddp["step_ms"]), _fmt(best["step_ms"])]
    eff = _cells(md, "async vs sync efficiency (samples/s ratio)")
    assert eff[3] == _fmt(by["bitps async fp32"]["samples_per_s"]
                          / by["bitps sync fp32"]["samples_per_s"])
    head = _cells(md, "e2e-tiny")  # the per-scenario headline row
    assert head[1] == best["run"]
    assert head[3] == _fmt(best["samples_per_s"] / ddp["samples_per_s"])
    assert head[7] == _fmt(ddp.get("time_to_target_s"))


def test_straggler_checks_measure_the_bound_a_staleness_bound_sets():
    """With a persistent straggler a staleness bound holds every worker to the slow one's
    pace: the checks report that bound from the ceiling run's slowest rank beside the ratios."""
    from bitps.bench.config import E2EBench
    from bitps.bench.e2e_report import checks as _checks

    by = {"ceiling (no traffic)": {"run": "ceiling (no traffic)", "lr": None, "step_ms": 1500.0,
                                   "samples_per_s": 6.9, "rank_cpu_ms": [980, 980]},
          "bitps sync fp32": {"run": "bitps sync fp32", "lr": 4e-4, "samples_per_s": 4.0,
                              "time_to_target_s": None},
          "bitps ssp sign1": {"run": "bitps ssp sign1", "lr": 4e-4, "samples_per_s": 5.2,
                              "time_to_target_s": 80.0},
          "bitps async sign1": {"run": "bitps async sign1", "lr": 4e-4, "samples_per_s": 6.0,
                                "time_to_target_s": None}}
    checks = _checks(by, E2EBench(model="lm", straggler=True))
    # 2 workers x batch 4 at one step per 1.5 s = 5.333 samples/s, against sync's 4.0
    assert checks["straggler_ssp_limit_vs_sync_samples_per_s"]["value"] == 1.333
    assert checks["straggler_ssp_vs_sync_samples_per_s"]["value"] == "bitps ssp sign1: 1.300"
    assert checks["straggler_ssp_vs_sync_samples_per_s"]["ok"]
    assert checks["straggler_ssp_reaches_target_first"]["ok"]
    assert checks["straggler_async_vs_sync_samples_per_s"]["value"] == "bitps async sign1: 1.500"
    # an ssp run of batches split by speed is held to no one: the bound is every rank computing
    # all the time, the ceiling's rank speeds summed (1 and 2/3 steps/s of batch 4)
    by["ceiling (no traffic)"]["rank_steps_per_s"] = [1.0, 1 / 1.5]
    by["bitps ssp 1-bit Adam, batch by speed"] = {
        "run": "bitps ssp 1-bit Adam, batch by speed", "lr": 4e-4, "samples_per_s": 6.2,
        "time_to_target_s": 70.0, "rank_samples": [300, 180], "rank_steps": [60, 60]}
    checks = _checks(by, E2EBench(model="lm", straggler=True))
    assert checks["straggler_ssp_limit_vs_sync_samples_per_s"]["value"] == round(
        4 * (1 + 1 / 1.5) / 4.0, 3)
    assert checks["straggler_ssp_vs_sync_samples_per_s"]["value"] == \
        "bitps ssp 1-bit Adam, batch by speed: 1.550"


def test_e2e_checks_judge_bounded_compressed_runs_against_ddp_and_the_users_lr():
    """The asynchrony checks: an async/ssp 1-bit run to the target, the best bitps time over
    the best DDP variant's (0.8 on the LM, under 1 elsewhere), the run at DDP's lr within 3 %;
    under a straggler the first bounded run against sync 1-bit Adam (0.85)."""
    from bitps.bench.config import E2EBench
    from bitps.bench.e2e_report import RECOMMENDED
    from bitps.bench.e2e_report import checks as _checks

    def row(name, t, final=2.4, speed=6.0):
        return {"run": name, "lr": 2e-4, "samples_per_s": speed, "time_to_target_s": t,
                "final_loss": final}

    by = {r["run"]: r for r in (
        row("DDP fp32", 120.0, final=2.38), row("DDP bf16", 100.0, final=2.38),
        row("bitps sync 1-bit Adam", 90.0), row("bitps ssp 1-bit Adam", 79.0),
        row("bitps async 1-bit Adam", None), row(RECOMMENDED, 85.0, final=2.45))}
    lm = _checks(by, E2EBench(model="lm"))
    assert lm["async_or_ssp_1bit_reaches_target"]["value"] == "bitps ssp 1-bit Adam: 79.0 s"
    assert lm["best_bitps_time_to_target_vs_best_ddp"] == {
        "value": "bitps ssp 1-bit Adam: 0.790", "goal": "<= 0.8", "ok": True}
    assert lm["recommended_at_ddp_lr_final_loss_vs_ddp_fp32"]["value"] == round(2.45 / 2.38, 4)
    assert lm["recommended_at_ddp_lr_final_loss_vs_ddp_fp32"]["ok"]
    by["bitps ssp 1-bit Adam"]["time_to_target_s"] = 95.0  # now sync 1-bit Adam is first
    moe = _checks(by, E2EBench(model="moe"))
    assert moe["best_bitps_time_to_target_vs_best_ddp"]["value"] == \
        "bitps ssp 1-bit Adam at DDP fp32's lr: 0.850"
    assert moe["best_bitps_time_to_target_vs_best_ddp"]["goal"] == "< 1.0"
    for r in by.values():
        r["time_to_target_s"] = None if "ssp" in r["run"] or "async" in r["run"] else 90.0
    assert not _checks(by, E2EBench(model="lm"))["async_or_ssp_1bit_reaches_target"]["ok"]
    by["bitps ssp 1-bit Adam"]["time_to_target_s"] = 80.0
    slow = _checks(by, E2EBench(model="lm", straggler=True))
    assert slow["straggler_bounded_time_to_target_vs_sync_1bit_adam"] == {
        "value": "bitps ssp 1-bit Adam: 0.889", "goal": "<= 0.85", "ok": False}


def test_a_quick_run_never_overwrites_a_full_runs_results(tmp_path, monkeypatch):
    """``--quick`` without ``--out`` writes under ``<results>/quick``, for every scenario."""
    import bitps.bench.__main__ as cli

    monkeypatch.setattr(cli, "DEFAULT_OUT", tmp_path)
    args = cli.build_parser().parse_args(["codec", "--quick"])
    cli.run_scenario(args)
    assert (tmp_path / "quick" / "codec.json").exists()
    assert not (tmp_path / "codec.json").exists()


def test_out_is_taken_before_or_after_the_scenario(tmp_path):
    """``bitps-bench SCENARIO --out DIR`` (once refused) and ``bitps-bench --out DIR SCENARIO``
    both write to DIR; a scenario's ``--out`` wins over the top-level one."""
    done = subprocess.run([sys.executable, "-m", "bitps.bench", "volume", "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "volume.json").exists()

    from bitps.bench.__main__ import build_parser

    parse = build_parser().parse_args
    assert parse(["pushpull", "--out", "a"]).out == Path("a")
    assert parse(["--out", "a", "pushpull"]).out == Path("a")
    assert parse(["--out", "a", "e2e", "--out", "b"]).out == Path("b")
    assert parse(["all", "--quick"]).out is None


def test_e2e_link_floor_counts_each_steps_bytes_serial_or_hidden():
    """The link's floor under a run (``bench.e2e_floor``): a step pushed after backward takes
    the ceiling's step plus its busiest direction's bytes over the link; an overlapped one the
    larger of the two. The busiest direction: with a shard beside each rank, a rank's node
    sends its pushes to the other shards and its shard's answers to the other ranks."""
    from bitps.bench.e2e import _link_steps
    from bitps.bench.e2e_floor import busiest_direction, link_floor

    # two colocated ranks: node 0 sends half of rank 0's pushes and half of rank 1's pulls
    assert busiest_direction([100.0, 60.0], [200.0, 40.0], colocated=True) == \
        max(50 + 20, 30 + 100, 100 + 30, 20 + 50)
    # shards on their own nodes: a rank's node carries all of its own traffic
    assert busiest_direction([100.0, 60.0], [200.0, 40.0], colocated=False) == 200.0
    with pytest.raises(ValueError, match="one push and one pull"):
        busiest_direction([1.0], [1.0, 2.0], colocated=True)
    # ceiling 1 s, link 100 B/s: serial 1 + 0.5 s, overlapped max(1, 0.5) and max(1, 3)
    steps = [(True, 50.0), (False, 50.0), (False, 300.0)]
    assert link_floor(steps, 1.0, 100.0) == pytest.approx(3 / (1.5 + 1.0 + 3.0))
    assert link_floor([], 1.0, 100.0) == 1.0
    with pytest.raises(ValueError, match="must be > 0"):
        link_floor(steps, 1.0, 0.0)
    # each step's compute at the ceiling's lower quartile (0.9 s), against its mean (1 s)
    assert link_floor(steps, 1.0, 100.0, compute_s=0.9) == pytest.approx(
        3 / (1.4 + 0.9 + 3.0))
    # from two ranks' step lines: the steps after skip, serial where either rank was
    def lines(serial):
        return [{"push_bytes": 10.0 * i, "pull_bytes": 20.0 * i, "serial": serial(i)}
                for i in range(5)]
    got = _link_steps([lines(lambda i: i == 3), lines(lambda i: False)], 1, colocated=True)
    assert got == [(False, 30.0), (True, 45.0), (False, 60.0)]
    assert _link_steps([[{"end": 1.0}] * 5] * 2, 1, colocated=True) is None  # DDP: no bytes


def test_e2e_reports_one_bit_adams_warmup_and_compressed_phases_apart():
    """A 1-bit Adam run's step time, rank and shard CPU per step in each phase (the averages
    over the run hide which costs what), from the ranks' step lines and the shards' CPU marked
    at rank 0's; the switch's step is in neither."""
    from bitps.bench.config import E2EBench
    from bitps.bench.e2e import CASES, _freeze_step, _phases

    # rank 0: 100 ms steps, 80 ms CPU in warm-up, 50 ms after; rank 1: 10 ms slower per step
    def rank(extra):
        t = cpu = 0.0
        out = []
        for step in range(20):
            t += 0.1 + extra + (0.5 if step == 8 else 0.0)  # step 8: the switch
            cpu += 0.08 if step < 8 else 0.05
            out.append({"end": t, "cpu": cpu})
        return out

    phases = _phases([rank(0.0), rank(0.01)], skip=2, freeze=8)
    assert phases["warmup"]["steps"] == 5 and phases["compressed"]["steps"] == 10
    assert round(phases["warmup"]["step_ms"], 6) == 110.0  # the slower rank's
    assert phases["warmup"]["rank_cpu_ms"] == [80.0, 80.0]
    assert phases["compressed"]["rank_cpu_ms"] == [50.0, 50.0]
    assert "shard_cpu_ms" not in phases["warmup"]  # no shard marks (DDP)
    # each shard's CPU when rank 0 logged each step: 30 ms a step in warm-up, 10 after
    marks = {step: [0.03 * min(step, 8) + 0.01 * max(step - 8, 0), 0.0] for step in range(20)}
    phases = _phases([rank(0.0), rank(0.01)], skip=2, freeze=8, shard_marks=marks)
    assert phases["warmup"]["shard_cpu_ms"] == [30.0, 0.0]
    assert phases["compressed"]["shard_cpu_ms"] == [10.0, 0.0]
    assert _phases([rank(0.0)], skip=2, freeze=None) is None
    s = E2EBench(model="lm")
    onebit = next(c for c in CASES if c.name == "bitps sync 1-bit Adam")
    fp32 = next(c for c in CASES if c.name == "bitps sync fp32")
    assert _freeze_step(onebit, s, 120) == 24 and _freeze_step(fp32, s, 120) is None


def test_a_shaped_link_without_ip_falls_back_to_loopback(monkeypatch, tmp_path):
    """The device machine's image has no ``ip``: ``bitps-bench overlap --device cuda`` died in
    the teardown (``FileNotFoundError: 'ip'``) instead of running unshaped on loopback."""
    from bench.link import shaped_link

    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, no tc
    with shaped_link("1gbit") as link:
        assert link.kind == "loopback" and "not found" in link.note


def test_a_straggler_async_run_splits_the_samples_by_speed_and_merges_the_ranks_curves():
    """Under ``--straggler`` an async run (DiLoCo's too) splits ``workers x steps`` by the
    ceiling's rank speeds, so both ranks stop together; sync and ssp keep equal steps, and a
    split without speeds is refused. The curve then merges every rank's steps in the order
    they ended, two points a step, and the report's windows and step counts follow."""
    import pytest

    from bitps.bench.config import E2EBench
    from bitps.bench.e2e import CASES, STRAGGLER_CASES, _curve, rank_steps
    from bitps.bench.e2e_report import _catch_up, _learning, _Marks

    by = {c.name: c for c in CASES + STRAGGLER_CASES}
    slow = E2EBench(model="lm", straggler=True)
    fast_slow = [3.0, 2.0]  # steps/s: worker 1 at 1/1.5 of worker 0's pace
    assert rank_steps(by["bitps async sign1"], slow, 60, fast_slow) == [72, 48]
    assert rank_steps(by["bitps async DiLoCo H=5, DyLU"], slow, 60, fast_slow) == [72, 48]
    for name in ("bitps ssp sign1", "bitps sync DiLoCo H=5", "DDP fp32"):
        assert rank_steps(by[name], slow, 60, fast_slow) == [60, 60]
    assert rank_steps(by["bitps async sign1"], E2EBench(model="lm"), 60, None) == [60, 60]
    with pytest.raises(ValueError, match="run the ceiling first"):
        rank_steps(by["bitps async sign1"], slow, 60, None)

    # rank 0 steps every 1 s with loss 10 - t, rank 1 every 1.5 s with loss 20 - t
    ranks = [[{"start": 0.0, "end": 1.0 * (i + 1), "loss": 10 - 1.0 * (i + 1)}
              for i in range(6)],
             [{"start": 0.0, "end": 1.5 * (i + 1), "loss": 20 - 1.5 * (i + 1)}
              for i in range(4)]]
    loss, t, per_step = _curve(ranks, merged=True, batch=4)
    assert per_step == 2 and len(loss) == 10 and list(t) == sorted(t)
    assert list(t[:3]) == [1.0, 1.5, 2.0] and list(loss[:3]) == [9.0, 18.5, 8.0]
    mean, t_mean, one = _curve([r[:4] for r in ranks], merged=False, batch=4)
    assert one == 1 and list(t_mean) == [1.5, 3.0, 4.5, 6.0]  # each step's slowest rank
    # batch by speed: rank 0 took 5 of each step's 8 samples, rank 1 three; a step's mean is
    # over its samples, and a merged step's two points average to it
    shares = [[{**e, "samples": n} for e in r[:4]] for r, n in zip(ranks, (5, 3))]
    mean, _, _ = _curve(shares, merged=False, batch=4)
    assert mean[0] == (5 * 9.0 + 3 * 18.5) / 8
    loss, _, _ = _curve(shares, merged=True, batch=4)
    assert list(loss[:2]) == [9.0 * 5 / 4, 18.5 * 3 / 4]
    assert sum(loss[:2]) / 2 == (5 * 9.0 + 3 * 18.5) / 8
    assert rank_steps(by["bitps ssp 1-bit Adam, batch by speed"], slow, 60, fast_slow) == [60, 60]

    r = {"loss": [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.0, 1.0], "time": [float(i) for i in
                                                                   range(1, 9)],
         "points_per_step": 2}
    marks = _Marks(window=1, target=4.5, equal_time=4.0, ceiling=None, compute=None,
                   fp32_wire=None)
    row = _learning(r, marks, batch=4)
    # windows of 1 step = 2 points: (6+5)/2, (5+4)/2 = 4.5 at point 2, i.e. step 2, t = 3
    assert row["steps_to_target"] == 2 and row["time_to_target_s"] == 3.0
    assert row["samples_to_target"] == 3 * 4 * 2 // 2
    assert row["loss_at_equal_time"] == 3.5  # points 2 and 3 (t <= 4)
    sync = {"loss": [9.0] * 9 + [3.0], "time": [2.0 * (i + 1) for i in range(10)]}
    c = _catch_up(r, sync, "sync", window=1)  # sync's final (last 10 %) = 3.0
    assert c["loss"] == 3.0 and c["time_s"] == 5.0 and c["vs_time"] == 5.0 / 20.0
    # a run that dips to the level and climbs away has not reached it
    climbs = {**r, "loss": [6.0, 2.0, 2.0, 5.0, 5.0, 2.5, 2.5, 2.5]}
    # the moving average stays at or below 3 from the window of points 5 and 6 on
    assert _catch_up(climbs, sync, "sync", window=1)["time_s"] == 7.0
    climbs["loss"][-1] = 4.0
    assert _catch_up(climbs, sync, "sync", window=1)["vs_time"] is None


def test_straggler_checks_report_the_async_time_bound_and_diloco_catch_up():
    from bitps.bench.config import E2EBench
    from bitps.bench.e2e_report import checks

    by = {"ceiling (no traffic)": {"run": "ceiling (no traffic)", "lr": None,
                                   "rank_steps_per_s": [1.0, 1 / 1.5], "step_ms": 1500.0,
                                   "samples_per_s": 6.0, "rank_cpu_ms": [900, 600]},
          "bitps async DiLoCo H=5, DyLU": {
              "run": "bitps async DiLoCo H=5, DyLU", "lr": 4e-4, "samples_per_s": 5.0,
              "catch_up": {"of": "bitps sync DiLoCo H=5", "loss": 2.5, "time_s": 70.0,
                           "of_time_s": 100.0, "vs_time": 0.7}}}
    out = checks(by, E2EBench(model="lm", straggler=True))
    # 2 ranks at 1 and 2/3 steps/s: the same samples take 2 x (2/3) / (5/3) = 0.8 of sync's
    assert out["straggler_async_time_bound_vs_sync"] == {
        "value": 0.8, "goal": "<= 0.8 (is the goal reachable)", "ok": True}
    assert out["straggler_async_diloco_time_to_sync_diloco_final"] == {
        "value": "70.0 s of 100.0 s: 0.700", "goal": "<= 0.8", "ok": True}


def test_local_sgd_exposed_communication_is_the_mean_over_steps():
    """A DiLoCo rank's exchange blocks one step in H: the median step exposes none, which is how
    the committed straggler table came to show 0 ms for the DiLoCo rows. Local SGD reports the
    mean over steps; every other run the median step's, robust to one slow step."""
    from bitps.bench.e2e import exposed_per_step

    # H = 5: step 4 of each round blocks 0.5 s (rank 0) or 1.0 s (rank 1)
    ranks = [[{"exposed": 0.5 if i % 5 == 4 else 0.0} for i in range(20)],
             [{"exposed": 1.0 if i % 5 == 4 else 0.0} for i in range(20)]]
    assert exposed_per_step(ranks, 0, local=False) == 0.0
    assert exposed_per_step(ranks, 0, local=True) == pytest.approx((0.1 + 0.2) / 2)
    # the skipped steps do not count: after 10 of 20, two exchanges in 10 steps
    assert exposed_per_step(ranks, 10, local=True) == pytest.approx((0.1 + 0.2) / 2)
    steady = [[{"exposed": e} for e in (0.01, 0.01, 0.9, 0.01)]]  # one slow step
    assert exposed_per_step(steady, 0, local=False) == 0.01


def test_e2e_reports_how_far_the_ceiling_drifted_over_the_run():
    """The ceiling, run once more after every other run, against its first run: the notes say
    how far this machine's speed moved, which every CPU beyond compute carries."""
    from bitps.bench.e2e_report import _drift, _drift_note

    first = {"samples_per_s": 6.0, "rank_cpu_s_per_step": [1.0, 1.1]}
    again = {"samples_per_s": 4.5, "rank_cpu_s_per_step": [1.3, 1.21]}
    drift = _drift(first, again)
    assert drift["samples_per_s_vs_first"] == pytest.approx(0.75)
    assert drift["rank_cpu_ms"] == [1300, 1210]
    assert drift["rank_cpu_vs_first"] == pytest.approx([1.3, 1.1])
    assert "(0.75x its first run's), rank CPU [1300, 1210] ms/step (1.30, 1.10x)" in \
        _drift_note(drift)
    assert _drift(first, None) is None and _drift_note(None) == ""


def test_e2e_reports_each_ranks_cpu_beyond_compute_per_phase_and_checks_it():
    """Issue 27: a rank's CPU beyond compute is its CPU less the same rank's in the ceiling
    run, per 1-bit Adam phase (the run's average mixes them), and every bitps learning run is
    checked against 150 ms a step at its worst rank and phase."""
    from bitps.bench.config import E2EBench
    from bitps.bench.e2e_report import _beyond_compute, beyond_compute_worst, checks

    ceiling = {"rank_cpu_s_per_step": [1.000, 1.010]}
    fp32 = {"run": "bitps sync fp32", "lr": 2e-4, "samples_per_s": 5.0}
    _beyond_compute(fp32, {"rank_cpu_s_per_step": [1.120, 1.170]}, ceiling)
    assert fp32["beyond_compute_ms"] == [120, 160]
    onebit = {"run": "bitps sync 1-bit Adam", "lr": 2e-4, "samples_per_s": 6.0,
              "phases": {"warmup": {"rank_cpu_ms": [1200.0, 1150.0]},
                         "compressed": {"rank_cpu_ms": [1100.0, 1120.0]}}}
    _beyond_compute(onebit, {"rank_cpu_s_per_step": [1.120, 1.125]}, ceiling)
    assert onebit["phases"]["warmup"]["beyond_compute_ms"] == [200, 140]
    assert onebit["phases"]["compressed"]["beyond_compute_ms"] == [100, 110]
    assert onebit["phase_beyond_compute_ms"] == "[200, 140] / [100, 110]"
    # the worst phase counts, not the run's average (120, 115)
    assert beyond_compute_worst(onebit) == 200 and beyond_compute_worst(fp32) == 160
    other = {"run": "bitps async sign1", "lr": 2e-4, "samples_per_s": 7.0}
    _beyond_compute(other, {"rank_cpu_s_per_step": [1.0]}, ceiling)  # another world size
    assert beyond_compute_worst(other) is None
    out = checks({r["run"]: r for r in (fp32, onebit, other)}, E2EBench(model="lm"))
    assert out["worker_cpu_beyond_compute_ms[bitps sync fp32]"]["value"] == 160
    assert not out["worker_cpu_beyond_compute_ms[bitps sync 1-bit Adam]"]["ok"]
    assert "worker_cpu_beyond_compute_ms[bitps async sign1]" not in out
    # a run of batches by speed computes other shares than the ceiling: no figure is read
    from bitps.bench.e2e_report import split_by_speed

    assert split_by_speed({"rank_samples": [295, 183], "rank_steps": [60, 60]}, 4)
    assert not split_by_speed({"rank_samples": [288, 192], "rank_steps": [72, 48]}, 4)  # async
    assert not split_by_speed({"rank_steps": [60, 60]}, 4)  # recorded before 2026-12-07
