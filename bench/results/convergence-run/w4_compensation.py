"""W = 4, ssp S=2 1-bit Adam with each staleness compensation (2026-12-06, 20:55-21:58): the
convergence bench's settings and launch function, seeds 0 and 1; the first five points in one
launch, damping at 1.2e-2 and 9e-3 in a second right after it, the shards' Adam beta1 (which the
workers' moments use) in a third at 21:41. Against sync fp32
Adam with 4 workers (1.302, the committed run) and the bound fp32 ssp S=2 with 4 workers (1.373
at 1.5e-3, bound.py)."""
import json
import time
from pathlib import Path

from bitps.bench import convergence as c
from bitps.bench.config import ConvergenceBench

if __name__ == "__main__":
    cfg = ConvergenceBench()
    freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
    tail = max(1, cfg.steps // 10)
    base_la, wa = c.RUNS["1-bit Adam (ssp S=2), 4 workers"]
    plan = [("none", 1.5e-3), ("compensation=damping", 3e-3), ("compensation=damping", 6e-3),
            ("compensation=gap_aware", 1.5e-3), ("compensation=gap_aware", 3e-3),
            ("compensation=damping", 1.2e-2), ("compensation=damping", 9e-3),
            ("beta1=0.95", 1.5e-3), ("beta1=0.97", 1.5e-3), ("beta1=0.95", 3e-3),
            ("beta1=0.97", 3e-3)]
    out = []
    for comp, lr in plan:
        la = list(base_la) + [f"--server-arg=--{a}" for a in comp.split(",") if a != "none"]
        finals = []
        for seed in cfg.seeds:
            t0 = time.time()
            r = c._launch(f"w4 {comp}", la, wa, steps=cfg.steps, freeze=freeze, lr=lr,
                          beta2=cfg.beta2, seed=seed,
                          run_dir=Path(f"/tmp/w4comp/{comp}-{lr}-{seed}"))
            finals.append(float(r["curve"][-tail:].mean()))
            print(comp, lr, seed, finals[-1], f"{time.time()-t0:.0f}s", flush=True)
        out.append({"compensation": comp, "lr": lr, "finals": finals,
                    "final_loss": sum(finals) / len(finals)})
        print(json.dumps(out[-1]), flush=True)
    Path("/tmp/w4comp/result.json").write_text(json.dumps(out, indent=1))
