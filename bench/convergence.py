"""``bitps-bench convergence``: do compression and asynchrony cost convergence? The demo model on
the pinned corpus, 2 shards and 2 workers (4 in the rows that say so) started by
``bitps-launch``, the same seeds and batches in every run, trained with fp32 Adam and 1-bit Adam
(sync, async and ssp S=2; ssp also without the worker's weight prediction, and with 4
workers), each staleness compensation on top (``ps.compensation``: fp32 async, 1-bit ssp),
sparse + error feedback, sign1 both ways with the default gradient clipping, overlap off and on
(sync) and on (async), and DiLoCo (local SGD, H = 8 and 32 inner AdamW steps per sign1
pseudo-gradient, outer Nesterov SGD on the shards, sync, async and ssp).

Every run a check judges is swept over ``sweep_lrs`` and judged at its best learning rate; the
others run at ``lr``.

Per run: the loss curve (mean of the ranks at each step), the final loss (mean over the last
10 % of steps), the first step whose 20-step moving average reaches the target loss (fp32 Adam's
final loss x ``target_factor``), and the bytes each worker moved per step (pushes as sent on the
wire, pulls as received). Curves go to ``convergence.png``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bitps.bench.config import ConvergenceBench
from bitps.bench.report import DEFAULT_OUT, check, moving_average, write_results

__all__ = ["RUNS", "launch_argv", "parse_run", "run"]

_SSP = ["--mode", "ssp", "--staleness", "2"]
_SIGN1 = ["--push-codec", "sign1", "--compress-min-bytes", "0", "--bucket-bytes", "65536"]
RUNS = {
    "fp32 Adam (sync)": (["--mode", "sync", "--optimizer", "adam"], []),
    "1-bit Adam (sync)": (["--mode", "sync", "--optimizer", "onebit_adam"],
                          ["--compress-min-bytes", "0"]),
    # clipping under overlap (worker.training.clip) on a compressed run that converges well: momenta
    # pushed bucket by bucket with predicted factors, corrected through error feedback
    "1-bit Adam (sync), overlap on": (["--mode", "sync", "--optimizer", "onebit_adam"],
                                      ["--compress-min-bytes", "0", "--overlap", "on",
                                       "--bucket-bytes", "65536"]),
    "fp32 Adam (async)": (["--mode", "async", "--optimizer", "adam"], []),
    "fp32 Adam (ssp S=2)": ([*_SSP, "--optimizer", "adam"], []),
    "1-bit Adam (ssp S=2)": ([*_SSP, "--optimizer", "onebit_adam"], ["--compress-min-bytes", "0"]),
    "1-bit Adam (ssp S=2), shard moments": (
        [*_SSP, "--optimizer", "onebit_adam", "--server-arg=--onebit-moments=shard"],
        ["--compress-min-bytes", "0"]),
    "1-bit Adam (async)": (["--mode", "async", "--optimizer", "onebit_adam"],
                           ["--compress-min-bytes", "0"]),
    # the worker's weight prediction for compressed pulls off (the shard's lookahead flag):
    # what it buys
    "1-bit Adam (ssp S=2), no weight prediction": (
        [*_SSP, "--optimizer", "onebit_adam", "--server-arg=--no-lookahead"],
        ["--compress-min-bytes", "0"]),
    "sparse + EF, Adam (sync)": (["--mode", "sync", "--optimizer", "adam"],
                                 ["--push-codec", "sparse", "--compress-min-bytes", "0"]),
    # sign1 both ways with the default clip_norm (1.0; the demo's gradient norm exceeds it in
    # about a quarter of the early steps): overlap off clips exactly, overlap on pushes buckets
    # with predicted factors and corrects them through error feedback (worker.training.clip). 64 KiB
    # buckets: the demo's 1 MB of gradients would fit one bucket of the default 1 MiB, whose
    # factor is exact, and nothing would be predicted.
    "sign1 + EF, clip 1.0, Adam (sync), overlap off": (
        ["--mode", "sync", "--optimizer", "adam"], [*_SIGN1, "--overlap", "off"]),
    "sign1 + EF, clip 1.0, Adam (sync), overlap on": (
        ["--mode", "sync", "--optimizer", "adam"], [*_SIGN1, "--overlap", "on"]),
    "sign1 + EF, clip 1.0, Adam (async), overlap on": (
        ["--mode", "async", "--optimizer", "adam"], [*_SIGN1, "--overlap", "on"]),
}
# DiLoCo: local SGD with H inner AdamW steps, then the sign1 pseudo-gradient through the shards'
# outer rule; the same steps, hence samples, as the other runs (one push and one pull per H
# steps). Inner lr 2e-3: the best of 1.5e-3, 2e-3, 3e-3 and 4.5e-3 in 600-step probes. Outer:
# DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9), and plain averaging of the workers' progress
# (SGD, lr 1), which ended best here (DiLoCo's defaults are tuned for H in the hundreds);
# the raw run is the bound compression is measured against.
_INNER = ["--inner-lr", "2e-3"]
_DILOCO = ["--algorithm", "diloco", "--lr", "0.7"]
_AVERAGE = ["--algorithm", "diloco", "--optimizer", "sgd", "--lr", "1.0"]
RUNS.update({
    "DiLoCo H=8, sign1 (sync)": (["--mode", "sync", *_AVERAGE], ["--inner-steps", "8", *_INNER]),
    "DiLoCo H=8, sign1 (sync), Nesterov outer": (["--mode", "sync", *_DILOCO],
                                                 ["--inner-steps", "8", *_INNER]),
    "local SGD H=8, raw (sync)": (["--mode", "sync", *_AVERAGE],
                                  ["--inner-steps", "8", *_INNER, "--push-codec", "raw"]),
    "DiLoCo H=32, sign1 (sync)": (["--mode", "sync", *_AVERAGE],
                                  ["--inner-steps", "32", *_INNER]),
    "DiLoCo H=8, sign1 (async)": (["--mode", "async", *_AVERAGE],
                                  ["--inner-steps", "8", *_INNER]),
    "DiLoCo H=8, sign1 (ssp S=2)": ([*_SSP, *_AVERAGE], ["--inner-steps", "8", *_INNER]),
    # Asynchronous local SGD (Liu et al. 2024): DiLoCo's Nesterov outer rule on every arrival,
    # and its delayed form (ps.outer.DelayedNesterov: a plain step per arrival, the momentum
    # every N = 2 arrivals, from their mean)
    "DiLoCo H=8, sign1 (async), Nesterov outer": (["--mode", "async", *_DILOCO],
                                                  ["--inner-steps", "8", *_INNER]),
    "DiLoCo H=8, sign1 (async), delayed Nesterov": (
        ["--mode", "async", *_DILOCO, "--optimizer", "delayed_nesterov"],
        ["--inner-steps", "8", *_INNER]),
    # DiLoCo's lr 0.7 and momentum 0.9 step about 7x the mean delta in steady state
    # (lr / (1 - momentum)), tuned for H in the hundreds; lr 0.5 and momentum 0.5 step 1x, as
    # plain averaging does, and keep some momentum
    "DiLoCo H=8, sign1 (async), delayed Nesterov, lr 0.5, momentum 0.5": (
        ["--mode", "async", *_DILOCO, "--optimizer", "delayed_nesterov", "--lr", "0.5",
         "--server-arg=--momentum=0.5"],
        ["--inner-steps", "8", *_INNER]),
    # Streaming DiLoCo: 4 fragments, each exchanged at its own step of the round, in flight
    # for one inner step
    "DiLoCo H=8, sign1, streaming 4 fragments (sync)": (
        ["--mode", "sync", *_AVERAGE],
        ["--inner-steps", "8", *_INNER, "--fragments", "4", "--fragment-overlap-steps", "1"]),
})
# Staleness compensation (ps.compensation), each on top of the lookahead: fp32 Adam async
# (gradient pushes: every method applies) and 1-bit Adam ssp (directions: the lr-scaling ones)
_COMP = {"damping": "damping", "gap_aware": "gap-aware", "dc_asgd": "DC-ASGD"}
COMPENSATED = {}
for _name, _label in _COMP.items():
    COMPENSATED[f"fp32 Adam (async), {_label}"] = "fp32 Adam (async)"
    RUNS[f"fp32 Adam (async), {_label}"] = (
        ["--mode", "async", "--optimizer", "adam", f"--server-arg=--compensation={_name}"], [])
for _name in ("damping", "gap_aware"):
    COMPENSATED[f"1-bit Adam (ssp S=2), {_COMP[_name]}"] = "1-bit Adam (ssp S=2)"
    RUNS[f"1-bit Adam (ssp S=2), {_COMP[_name]}"] = (
        [*_SSP, "--optimizer", "onebit_adam", f"--server-arg=--compensation={_name}"],
        ["--compress-min-bytes", "0"])
# 4 workers (2 shards): twice the samples per step; judged against sync fp32 with 4 workers
_W4 = ["--workers", "4"]
W4_WINDOW = "1-bit Adam (ssp S=2), 4 workers, momentum per update, beta1 0.95"
W4_BOUND = "fp32 Adam (ssp S=2), 4 workers, beta1 0.95"
RUNS.update({
    "fp32 Adam (sync), 4 workers": ([*_W4, "--mode", "sync", "--optimizer", "adam"], []),
    "1-bit Adam (ssp S=2), 4 workers": ([*_W4, *_SSP, "--optimizer", "onebit_adam"],
                                        ["--compress-min-bytes", "0"]),
    # each worker's momentum spanning the shard's last 1/(1-beta1) updates, not its own steps
    # (OneBitConfig.momentum_window), at beta1 0.95: the configuration docs/algorithms.md
    # recommends from 4 workers on
    W4_WINDOW: ([*_W4, *_SSP, "--optimizer", "onebit_adam",
                 "--server-arg=--onebit-momentum-window=updates", "--server-arg=--beta1=0.95"],
                ["--compress-min-bytes", "0"]),
    # what asynchrony alone costs at W = 4: fp32 Adam in ssp at the beta1 that served it best
    # of the compensations tried (docs/benchmarks.md, 1-bit Adam notes)
    W4_BOUND: ([*_W4, *_SSP, "--optimizer", "adam", "--server-arg=--beta1=0.95"], []),
})
DILOCO_RUN = "DiLoCo H=8, sign1 (sync)"
LOCAL_SGD_RAW = "local SGD H=8, raw (sync)"
BASELINE = "fp32 Adam (sync)"
# Each 1-bit run is judged against fp32 Adam in the same consistency mode: ssp alone changes
# the loss (every push is applied on its own), which is not compression's doing. The shard-moment
# layout (frozen v on the shard) is reported, not checked: ssp
# defaults to worker moments.
# Each pair is judged at each run's best learning rate of the sweep (both are swept).
PAIRS = {"onebit_sync": ("1-bit Adam (sync)", "fp32 Adam (sync)", 1.01),
         "onebit_ssp": ("1-bit Adam (ssp S=2)", "fp32 Adam (ssp S=2)", 1.01),
         "onebit_async": ("1-bit Adam (async)", "fp32 Adam (async)", 1.01),
         "onebit_ssp_4_workers": ("1-bit Adam (ssp S=2), 4 workers",
                                  "fp32 Adam (sync), 4 workers", 1.02),
         "onebit_ssp_4_workers_momentum_per_update": (W4_WINDOW, "fp32 Adam (sync), 4 workers",
                                                      1.02)}
# Bounds: the uncompressed peer of a line's run against the line's peer; above the goal, no
# compressed run of that mode is expected to meet the line.
BOUNDS = {"fp32_ssp_4_workers_beta1_0.95": (W4_BOUND, "fp32 Adam (sync), 4 workers", 1.02)}
# Clipping under overlap must not change convergence: overlap on against off, same codec.
OVERLAP_PAIRS = {
    "onebit_sync": ("1-bit Adam (sync), overlap on", "1-bit Adam (sync)"),
    "sign1_clip": ("sign1 + EF, clip 1.0, Adam (sync), overlap on",
                   "sign1 + EF, clip 1.0, Adam (sync), overlap off")}
# Compressed pulls: a sync worker's bytes per step, pushes + pulls, against fp32's.
TRAFFIC_RUN = "sign1 + EF, clip 1.0, Adam (sync), overlap off"
REPORTED = {"1-bit Adam (ssp S=2), shard moments": "fp32 Adam (ssp S=2)",
            "1-bit Adam (ssp S=2), no weight prediction": "fp32 Adam (ssp S=2)",
            **COMPENSATED,
            "DiLoCo H=8, sign1 (sync), Nesterov outer": "fp32 Adam (sync)",
            "local SGD H=8, raw (sync)": "fp32 Adam (sync)",
            "DiLoCo H=32, sign1 (sync)": "fp32 Adam (sync)",
            "DiLoCo H=8, sign1 (async)": "fp32 Adam (async)",
            "DiLoCo H=8, sign1 (async), Nesterov outer": "fp32 Adam (async)",
            "DiLoCo H=8, sign1 (async), delayed Nesterov": "fp32 Adam (async)",
            "DiLoCo H=8, sign1 (async), delayed Nesterov, lr 0.5, momentum 0.5":
                "fp32 Adam (async)",
            "DiLoCo H=8, sign1 (ssp S=2)": "fp32 Adam (ssp S=2)",
            "DiLoCo H=8, sign1, streaming 4 fragments (sync)": "fp32 Adam (sync)"}
# Asynchrony must not cost convergence: async and ssp fp32 Adam against sync, each at the best
# of a learning-rate sweep (the other runs use --lr).
SWEPT = ("fp32 Adam (sync)", "fp32 Adam (async)", "fp32 Adam (ssp S=2)", "1-bit Adam (sync)",
         "1-bit Adam (ssp S=2)", "1-bit Adam (async)", "1-bit Adam (ssp S=2), no weight prediction",
         *COMPENSATED, "fp32 Adam (sync), 4 workers", "1-bit Adam (ssp S=2), 4 workers",
         W4_WINDOW, W4_BOUND)
ASYNC_PAIRS = {"async": ("fp32 Adam (async)", "fp32 Adam (sync)"),
               "ssp": ("fp32 Adam (ssp S=2)", "fp32 Adam (sync)")}


def launch_argv(launch_args: list[str], worker_args: list[str], *, steps: int, freeze: int,
                lr: float, beta2: float, seed: int, run_dir: Path) -> list[str]:
    """One run's ``bitps-launch`` command: the bench's settings first, then the run's own
    (``launch_args``), so that a run's own server setting (``--freeze-step``, ``--beta2``, ...)
    wins: the launcher hands server args on in order, and the last of a flag counts."""
    return [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--workers", "2",
            "--lr", str(lr), "--run-dir", str(run_dir),
            f"--server-arg=--freeze-step={freeze}", f"--server-arg=--beta2={beta2}",
            *launch_args, "--",
            "--steps", str(steps), "--log-every", "1", "--seed", str(seed), *worker_args]


def _launch(name: str, launch_args: list[str], worker_args: list[str], *, steps: int,
            freeze: int, lr: float, beta2: float, seed: int, run_dir: Path) -> dict:
    workers = _workers(launch_args)
    argv = launch_argv(launch_args, worker_args, steps=steps, freeze=freeze, lr=lr,
                       beta2=beta2, seed=seed, run_dir=run_dir)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: bitps-launch exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return parse_run(run_dir, workers=workers, steps=steps)


def parse_run(run_dir: Path, *, workers: int, steps: int) -> dict:
    """One finished run's loss curve (mean of the ranks), bytes per worker per step and seconds,
    from its ``steps.jsonl`` and ``summary.json``."""
    losses = np.zeros((workers, steps))
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        e = json.loads(line)
        losses[e["rank"], e["step"]] = e["loss"]
    done = json.loads((run_dir / "summary.json").read_text())["workers"]
    return {"curve": losses.mean(axis=0),
            "push_bytes": sum(d["push_wire_bytes"] for d in done) / workers / steps,
            "pull_bytes": sum(d["pull_bytes"] for d in done) / workers / steps,
            "seconds": max(d["seconds"] for d in done)}


def _workers(launch_args: list[str]) -> int:
    """The workers a run starts: 2, or its own ``--workers`` (the last one given wins)."""
    given = [int(launch_args[i + 1]) for i, a in enumerate(launch_args[:-1]) if a == "--workers"]
    return given[-1] if given else 2


def _steps_to(curve: np.ndarray, target: float, window: int = 20) -> int | None:
    avg = moving_average(curve, window)
    hit = np.nonzero(avg <= target)[0]
    return int(hit[0]) + window if hit.size else None


def _plot(curves: dict[str, np.ndarray], path: Path, freeze: int) -> None:
    """Every run's curve: the 2-worker runs without compensation on the left, the
    compensated and 4-worker ones (with their peers) on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    right = {n for n in curves if n in COMPENSATED or "4 workers" in n}
    right |= {COMPENSATED[n] for n in right if n in COMPENSATED}
    fig, axes = plt.subplots(1, 2, figsize=(16, 6), dpi=110, sharey=True)
    for ax, names, title in ((axes[0], [n for n in curves if n not in right or n in
                                        COMPENSATED.values()], "runs (2 workers)"),
                             (axes[1], [n for n in curves if n in right],
                              "staleness compensation, 4 workers")):
        for name in names:
            smooth = moving_average(curves[name], 10)
            ax.plot(np.arange(smooth.size) + 10, smooth, label=name, lw=1.0)
        ax.axvline(freeze, color="grey", ls=":", lw=1, label=f"1-bit Adam freeze ({freeze})")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("loss (mean of the ranks, 10-step average)")
    fig.suptitle("bitps demo model: compression and asynchrony vs fp32 Adam")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _mean_runs(runs: list[dict]) -> dict:
    return {"curve": np.mean([r["curve"] for r in runs], axis=0),
            **{k: float(np.mean([r[k] for r in runs]))
               for k in ("push_bytes", "pull_bytes", "seconds")}}


_COLUMNS = [("run", "run"), ("lr", "lr"), ("final_loss", "final loss"),
            ("vs_fp32", "vs fp32 Adam (sync)"),
            ("vs_same_mode_fp32", "vs fp32 Adam, same mode (best lr)"),
            ("steps_to_target", "steps to target"),
            ("push_bytes_per_step", "push B/step"),
            ("pull_bytes_per_step", "pull B/step"),
            ("traffic_vs_fp32", "traffic reduction"), ("seconds", "seconds"),
            ("best_lr", "best lr"), ("best_final_loss", "final loss at best lr"),
            ("sweep", "lr sweep: final loss")]


def run(cfg: ConvergenceBench | None = None, *, out: Path | None = None) -> dict:
    """Run every configuration once per seed (curves averaged over seeds), write
    ``convergence.json``/``.md``/``.png`` under ``out``. ``cfg.runs``: just these runs (and
    the sync fp32 baseline, and the peers their checks need); checks whose runs are missing
    are left out."""
    cfg = (cfg or ConvergenceBench()).sized()
    runs = _chosen(cfg.runs)
    out = Path(out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
    tail = max(1, cfg.steps // 10)
    results, lrs, sweeps = _train_all(cfg, runs, freeze, tail)
    target = float(results[BASELINE]["curve"][-tail:].mean()) * cfg.target_factor
    rows = _rows(results, lrs, tail, target)
    _plot({n: r["curve"] for n, r in results.items()}, out / "convergence.png", freeze)
    by = {r["run"]: r for r in rows}
    sweep_checks = _sweep_checks(by, sweeps)  # first: the others read each run's best
    checks = {**_loss_checks(by), **sweep_checks, **_traffic_checks(by)}
    config = {"steps": cfg.steps, "freeze_step": freeze, "lr": cfg.lr,
              "sweep_lrs": list(cfg.sweep_lrs), "beta2": cfg.beta2, "seeds": list(cfg.seeds),
              "target_loss": target,
              "runs": {n: {"launch": a, "worker": w} for n, (a, w) in runs.items()}}
    write_results("convergence", config=config, rows=rows, checks=checks, out=out,
                  notes=_notes(cfg, freeze, tail, target), columns=_COLUMNS)
    (out / "convergence_curves.json").write_text(json.dumps(
        {n: [round(float(x), 5) for x in r["curve"]] for n, r in results.items()}))
    return {"rows": rows, "checks": checks}


def _chosen(only: tuple[str, ...]) -> dict:
    """The runs to make: every one, or ``only`` with the baseline and their peers."""
    unknown = [n for n in only if n not in RUNS]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; expected some of {list(RUNS)}")
    peers = {name: peer for name, peer, _ in (*PAIRS.values(), *BOUNDS.values())}
    wanted = {BASELINE, *only, *(REPORTED.get(n, peers.get(n, BASELINE)) for n in only),
              *([LOCAL_SGD_RAW] if DILOCO_RUN in only else [])}
    return {n: a for n, a in RUNS.items() if not only or n in wanted}


def _train_all(cfg: ConvergenceBench, runs: dict, freeze: int,
               tail: int) -> tuple[dict, dict, dict]:
    """Every run at ``cfg.lr`` (the swept ones at every sweep point too), averaged over the
    seeds: results and learning rates by run, and each swept run's final loss by lr."""
    results, lrs, sweeps = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bitps-conv-") as tmp:
        for i, (name, (launch_args, worker_args)) in enumerate(runs.items()):
            points = sorted({cfg.lr, *cfg.sweep_lrs}) if name in SWEPT else [cfg.lr]
            for j, run_lr in enumerate(points):
                r = _mean_runs([
                    _launch(name, launch_args, worker_args, steps=cfg.steps, freeze=freeze,
                            lr=run_lr, beta2=cfg.beta2, seed=seed,
                            run_dir=Path(tmp) / f"{i}-{j}-{seed}")
                    for seed in cfg.seeds])
                sweeps.setdefault(name, {})[str(run_lr)] = float(r["curve"][-tail:].mean())
                if run_lr == cfg.lr:  # every comparison but the sweep's is at --lr
                    results[name], lrs[name] = r, run_lr
    return results, lrs, sweeps


def _rows(results: dict, lrs: dict, tail: int, target: float) -> list[dict]:
    base = results[BASELINE]
    base_final = float(base["curve"][-tail:].mean())
    fp32_bytes = base["push_bytes"] + base["pull_bytes"]
    rows = []
    for name, r in results.items():
        final = float(r["curve"][-tail:].mean())
        moved = r["push_bytes"] + r["pull_bytes"]
        rows.append({"run": name, "lr": lrs[name], "final_loss": final,
                     "vs_fp32": final / base_final,
                     "steps_to_target": _steps_to(r["curve"], target),
                     "push_bytes_per_step": r["push_bytes"], "pull_bytes_per_step": r["pull_bytes"],
                     # a run too short for one local-SGD round moved nothing
                     "traffic_vs_fp32": fp32_bytes / moved if moved else None,
                     "seconds": r["seconds"]})
    return rows


def _have(by: dict, *names: str) -> bool:
    return all(n in by for n in names)


def _loss_checks(by: dict) -> dict:
    """Each 1-bit run against fp32 in its mode, each bound against its line's peer, and
    overlap on against off; the reported runs get their ratio to their peer
    (``vs_same_mode_fp32``) in their rows."""
    checks = {}
    judged = [(f"{key}_final_loss", pair, "") for key, pair in PAIRS.items()]
    judged += [(f"{key}_bound", pair, " (else the line is out of reach in this mode)")
               for key, pair in BOUNDS.items()]
    for key, (name, peer, goal), why in judged:
        if not _have(by, name, peer):
            continue
        ratio = _best(by[name]) / _best(by[peer])
        by[name]["vs_same_mode_fp32"] = ratio
        checks[f"{key}_vs_fp32_each_at_best_lr"] = check(round(ratio, 4), f"<= {goal}{why}",
                                                         ratio <= goal)
    for name, peer in REPORTED.items():
        if not _have(by, name, peer):
            continue
        by[name]["vs_same_mode_fp32"] = _best(by[name]) / _best(by[peer])
    for name, base in COMPENSATED.items():  # on by default only where it wins
        if not _have(by, name, base):
            continue
        ratio = _best(by[name]) / _best(by[base])
        key = name.replace("(", "").replace(")", "").replace(",", "").replace("=", "")
        checks[f"compensation_{'_'.join(key.lower().split())}_vs_off_each_at_best_lr"] = check(
            round(ratio, 4), "< 1 (else off by default)", ratio < 1)
    for key, pair in OVERLAP_PAIRS.items():
        if not _have(by, *pair):
            continue
        on, off = (by[n]["final_loss"] for n in pair)
        checks[f"{key}_overlap_on_final_loss_vs_off"] = check(round(on / off, 4), "<= 1.01",
                                                              on / off <= 1.01)
    return checks


def _best(row: dict) -> float:
    """The run's final loss at its best learning rate (swept runs), else at ``--lr``."""
    return row.get("best_final_loss", row["final_loss"])


def _sweep_checks(by: dict, sweeps: dict) -> dict:
    """Asynchrony against sync, each at the best of its sweep (recorded in the rows)."""
    for name in SWEPT:
        if not _have(by, name):
            continue
        by[name]["sweep"] = sweeps[name]
        by[name]["best_lr"] = float(min(sweeps[name], key=sweeps[name].get))
        by[name]["best_final_loss"] = min(sweeps[name].values())
    checks = {}
    for key, (name, peer) in ASYNC_PAIRS.items():
        if not _have(by, name, peer):
            continue
        ratio = by[name]["best_final_loss"] / by[peer]["best_final_loss"]
        checks[f"fp32_{key}_vs_sync_final_loss_each_at_best_lr"] = check(
            round(ratio, 4), "<= 1.03", ratio <= 1.03)
    return checks


def _traffic_checks(by: dict) -> dict:
    """Compressed pulls' traffic, and DiLoCo's loss and bytes against sync fp32."""
    checks = {}
    if _have(by, TRAFFIC_RUN):
        traffic = by[TRAFFIC_RUN]["traffic_vs_fp32"]
        checks["sign1_sync_traffic_reduction_vs_fp32"] = check(round(traffic, 2), ">= 20",
                                                               traffic >= 20)
    if not _have(by, DILOCO_RUN):
        return checks
    d = by[DILOCO_RUN]
    ratio = d["final_loss"] / by[BASELINE]["final_loss"]
    d["vs_same_mode_fp32"] = ratio
    checks["diloco_h8_sync_final_loss_vs_fp32_sync"] = check(round(ratio, 4), "<= 1.02",
                                                             ratio <= 1.02)
    if _have(by, LOCAL_SGD_RAW):  # local SGD without compression: what the codec is not to blame
        bound = by[LOCAL_SGD_RAW]["final_loss"] / by[BASELINE]["final_loss"]
        checks["local_sgd_h8_raw_final_loss_vs_fp32_sync"] = check(
            round(bound, 4), "<= 1.02 (else the goal above is out of reach at H=8)",
            bound <= 1.02)
    # equal steps, so equal samples: bytes per step is bytes per sample times the batch
    reduction = d["traffic_vs_fp32"] or 0.0
    checks["diloco_h8_sync_bytes_per_sample_reduction_vs_fp32_sync"] = check(
        round(reduction, 1), ">= 200", reduction >= 200)
    return checks


def _notes(cfg: ConvergenceBench, freeze: int, tail: int, target: float) -> str:
    return (f"{cfg.steps} steps, 2 shards x 2 workers (4 where the row says so), batch 8 x 128 "
            f"bytes per rank, seeds {list(cfg.seeds)} (curves averaged), Adam lr {cfg.lr}; "
            f"every run a check judges is also swept over {list(cfg.sweep_lrs)} (each point's "
            f"final loss in the sweep column) and judged at its best lr; beta2 {cfg.beta2} (v's "
            f"memory, 1/(1-beta2) = {1 / (1 - cfg.beta2):.0f} steps, must be shorter than the "
            f"warmup for a frozen v to mean anything), 1-bit Adam freeze_step {freeze} "
            f"({cfg.freeze_fraction:.0%}); final loss = mean of the last {tail} steps of the "
            f"ranks' mean; vs fp32 Adam (sync) = against the sync fp32 run at --lr; vs fp32 "
            f"Adam, same mode = each at its best lr against its peer (a compensated run: "
            f"against the same run without it); target = {cfg.target_factor} x sync fp32 Adam's "
            f"final loss = {target:.3f}; bytes per worker per step (pushes on the wire, pulls "
            f"as received); seconds: the slowest worker's, on a machine shared with other work "
            f"(not a speed figure); curves: convergence.png.")
