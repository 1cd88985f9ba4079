"""W = 4, ssp S=2 1-bit Adam with each staleness compensation (2026-12-06, 20:55-21:58): the
convergence bench's settings and launch function, seeds 0 and 1 (``w4_bound_study.run``, the same
launch this driver made inline when it ran); the first five points in one launch, damping at
1.2e-2 and 9e-3 in a second right after it, the shards' Adam beta1 (which the workers' moments
use) in a third at 21:41. Against sync fp32 Adam with 4 workers (1.302, the committed run) and
what was then taken for the bound, fp32 ssp S=2 with 4 workers (1.373 at 1.5e-3, bound.py;
w4_bound_study.json has it at its best lr: 1.318 with beta1 0.95)."""
import json

from w4_bound_study import run  # this directory is the script's, first on sys.path

PLAN = [("none", 1.5e-3), ("compensation=damping", 3e-3), ("compensation=damping", 6e-3),
        ("compensation=gap_aware", 1.5e-3), ("compensation=gap_aware", 3e-3),
        ("compensation=damping", 1.2e-2), ("compensation=damping", 9e-3),
        ("beta1=0.95", 1.5e-3), ("beta1=0.97", 1.5e-3), ("beta1=0.95", 3e-3),
        ("beta1=0.97", 3e-3)]

if __name__ == "__main__":
    for settings, lr in PLAN:
        point = run("onebit", lr, "-" if settings == "none" else settings)
        print(json.dumps({"compensation": settings, **point}), flush=True)
