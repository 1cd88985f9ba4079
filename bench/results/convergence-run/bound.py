"""The bound for the 4-worker line: fp32 Adam in ssp S=2 with 4 workers (what asynchrony
alone costs at W = 4), at lr 1.5e-3 (the best point of 1-bit ssp with 4 workers), seeds 0, 1,
the bench's settings and launch function."""
import json
from pathlib import Path

from bitps.bench import convergence as c
from bitps.bench.config import ConvergenceBench

cfg = ConvergenceBench()
freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
tail = max(1, cfg.steps // 10)
la = ["--workers", "4", "--mode", "ssp", "--staleness", "2", "--optimizer", "adam"]
finals = []
for seed in cfg.seeds:
    r = c._launch("fp32 Adam (ssp S=2), 4 workers", la, [], steps=cfg.steps, freeze=freeze,
                  lr=1.5e-3, beta2=cfg.beta2, seed=seed,
                  run_dir=Path(f"/tmp/conv-bound/{seed}"))
    finals.append(float(r["curve"][-tail:].mean()))
print(json.dumps({"run": "fp32 Adam (ssp S=2), 4 workers", "lr": 1.5e-3, "finals": finals,
                  "final_loss": sum(finals) / len(finals)}))
