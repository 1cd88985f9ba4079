"""The convergence bench's remaining launches, in priority order, into the run directory of the
same run (/tmp/conv-runs/<run index>-<lr index>-<seed>), as bench.convergence._train_all names
them. Rows: the 4-worker ones (3 lrs), then the compensated ones (lrs 1.5e-3 and 3e-3: 6e-3
was the worst point of every base run in this run), then the reference rows (--lr)."""
from pathlib import Path

from bitps.bench import convergence as c
from bitps.bench.config import ConvergenceBench

cfg = ConvergenceBench()
freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
names = list(c.RUNS)
root = Path("/tmp/conv-runs")
order = [n for n in names if "4 workers" in n] + list(c.COMPENSATED) + names[9:23]
for name in order:
    i = names.index(name)
    if name in c.COMPENSATED:
        points = [1.5e-3, 3e-3]
    elif name in c.SWEPT:
        points = sorted({cfg.lr, *cfg.sweep_lrs})
    else:
        points = [cfg.lr]
    allp = sorted({cfg.lr, *cfg.sweep_lrs}) if name in c.SWEPT else [cfg.lr]
    for lr in points:
        j = allp.index(lr)
        for seed in cfg.seeds:
            d = root / f"{i}-{j}-{seed}"
            if (d / "summary.json").exists():
                continue
            if d.exists():
                import shutil
                shutil.rmtree(d)
            la, wa = c.RUNS[name]
            c._launch(name, la, wa, steps=cfg.steps, freeze=freeze, lr=lr, beta2=cfg.beta2,
                      seed=seed, run_dir=d)
            print("done", name, lr, seed, flush=True)
