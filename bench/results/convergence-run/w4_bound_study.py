"""W = 4, ssp S=2: the bound (fp32 Adam) at its own best lr and with the compensations, and
1-bit Adam with two compensations at once (2026-12-06, night; w4_bound_study.json). The
convergence bench's settings and launch function, seeds 0 and 1. Arguments, in threes: ``fp32``,
``onebit``, ``sync``, ``onebit_raw_push``, ``onebit_sync`` or ``onebit_w2`` (fp32 Adam or
1-bit Adam in ssp S=2, fp32 Adam in sync, with 4 workers, as the bench runs them; 1-bit Adam in
ssp with float32 pushes; 1-bit Adam in sync; 1-bit Adam in ssp S=2 with 2 workers), a
server lr, comma-separated server settings (``-``: none), e.g.
``fp32 0.003 compensation=damping``."""
import json
import sys
import time
from pathlib import Path

from bitps.bench import convergence as c
from bitps.bench.config import ConvergenceBench

BASE = {"fp32": (["--workers", "4", "--mode", "ssp", "--staleness", "2", "--optimizer", "adam"],
                 []),
        "onebit": c.RUNS["1-bit Adam (ssp S=2), 4 workers"],
        "onebit_w2": c.RUNS["1-bit Adam (ssp S=2)"],  # 2 workers, for what W = 4 changes
        "sync": c.RUNS["fp32 Adam (sync), 4 workers"],
        # 1-bit Adam with float32 pushes (every tensor under compress_min_bytes): only the
        # shards' published updates are sign1, which tells the two compressions' costs apart
        "onebit_raw_push": (c.RUNS["1-bit Adam (ssp S=2), 4 workers"][0],
                            ["--compress-min-bytes", str(1 << 40)]),
        # 1-bit Adam in sync with 4 workers: what compression costs at W = 4 without asynchrony
        "onebit_sync": (["--workers", "4", *c.RUNS["1-bit Adam (sync)"][0]],
                        list(c.RUNS["1-bit Adam (sync)"][1]))}

def run(base: str, lr: float, settings: str) -> dict:
    """One point: ``BASE[base]`` at server lr ``lr`` with ``settings`` (comma-separated server
    settings, ``-``: none), seeds 0 and 1 as the bench launches them; each seed's final loss
    (the mean of the last tenth of the steps) and their mean."""
    cfg = ConvergenceBench()
    freeze = max(1, round(cfg.steps * cfg.freeze_fraction))
    tail = max(1, cfg.steps // 10)
    la, wa = BASE[base]
    la = list(la) + [f"--server-arg=--{a}" for a in settings.split(",") if a != "-"]
    finals = []
    t0 = time.time()
    for seed in cfg.seeds:
        r = c._launch(f"w4 {base} {settings}", la, list(wa), steps=cfg.steps, freeze=freeze,
                      lr=lr, beta2=cfg.beta2, seed=seed,
                      run_dir=Path(f"/tmp/w4bound/{base}-{settings}-{lr:g}-{seed}"))
        finals.append(float(r["curve"][-tail:].mean()))
    return {"base": base, "lr": lr, "settings": settings, "finals": finals,
            "final_loss": sum(finals) / len(finals), "s": round(time.time() - t0)}


if __name__ == "__main__":
    args = sys.argv[1:]
    for base, lr, settings in zip(args[::3], map(float, args[1::3]), args[2::3]):
        print(json.dumps(run(base, lr, settings)), flush=True)
