"""Assemble bitps-bench convergence's results from the run directories of one run
(/tmp/conv-runs: <run index>-<lr index>-<seed>, as bench.convergence._train_all names them),
with the bench's own functions: rows, checks, the plot, JSON + Markdown. Runs without a
directory for every seed of a point are left out (and named in the notes)."""
import json
import sys
from pathlib import Path

from bitps.bench import convergence as c
from bitps.bench.config import ConvergenceBench
from bitps.bench.report import write_results

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
root = Path("/tmp/conv-runs")
cfg = ConvergenceBench()
freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
tail = max(1, cfg.steps // 10)

def parse(d: Path, workers: int) -> dict:
    return c.parse_run(d, workers=workers, steps=cfg.steps)


names = list(c.RUNS)
results, lrs, sweeps, missing = {}, {}, {}, []
for i, name in enumerate(names):
    points = sorted({cfg.lr, *cfg.sweep_lrs}) if name in c.SWEPT else [cfg.lr]
    w = c._workers(c.RUNS[name][0])
    for j, lr in enumerate(points):
        dirs = [root / f"{i}-{j}-{s}" for s in cfg.seeds]
        if not all((d / "summary.json").exists() for d in dirs):
            continue
        r = c._mean_runs([parse(d, w) for d in dirs])
        sweeps.setdefault(name, {})[str(lr)] = float(r["curve"][-tail:].mean())
        if lr == cfg.lr:
            results[name], lrs[name] = r, lr
    if name not in results:
        missing.append(name)
        sweeps.pop(name, None)
target = float(results[c.BASELINE]["curve"][-tail:].mean()) * cfg.target_factor
rows = c._rows(results, lrs, tail, target)
c._plot({n: r["curve"] for n, r in results.items()}, out / "convergence.png", freeze)
by = {r["run"]: r for r in rows}
sweep_checks = c._sweep_checks(by, {n: s for n, s in sweeps.items() if n in by})
checks = {**c._loss_checks(by), **sweep_checks, **c._traffic_checks(by)}
config = {"steps": cfg.steps, "freeze_step": freeze, "lr": cfg.lr, "sweep_lrs": list(cfg.sweep_lrs),
          "compensated_sweep_lrs": [1.5e-3, 3e-3], "beta2": cfg.beta2, "seeds": list(cfg.seeds),
          "target_loss": target, "not_run": missing,
          "runs": {n: {"launch": a, "worker": wk} for n, (a, wk) in c.RUNS.items() if n in by}}
notes = c._notes(cfg, freeze, tail, target) + (
    " The compensated runs were swept over [0.0015, 0.003] only (6e-3 was the worst point of "
    "every base run in this run), in the same run directories, launched in priority order by "
    "bench/results/convergence-run/drive.py and assembled by its assemble.py with the bench's "
    "functions" + (f"; not run this time (time): {missing}" if missing else "") + ".")
write_results("convergence", config=config, rows=rows, checks=checks, out=out, notes=notes,
              columns=c._COLUMNS)
(out / "convergence_curves.json").write_text(json.dumps(
    {n: [round(float(x), 5) for x in r["curve"]] for n, r in results.items()}))
for k, v in checks.items():
    print(("ok  " if v["ok"] else "FAIL"), k, v["value"], v["goal"])
