"""The shards' Adam beta1 (and the lr-scaling compensations) for part (c)'s 1F1B and 2BW with
weight prediction, one run each (2026-12-06; beta1_study.json). Arguments, in threes: a case of
``bitps.bench.pipeline.DP_PP_CASES``, a server lr, and comma-separated server settings (``-``:
none), e.g. ``"2bw + prediction" 0.0015 beta1=0.97``. Each run is part (c)'s own
(``_dp_pp_run``, seed 0: the stages' default, which the runs recorded were launched with, before
part (c) passed ``--seed``), the settings added to the case's own server flags."""
import json
import sys
import tempfile
import time
from pathlib import Path

from bitps.bench import pipeline as bp

if __name__ == "__main__":
    args = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="beta1-") as tmp:
        for case, lr, settings in zip(args[::3], map(float, args[1::3]), args[2::3]):
            name, schedule, extra, server = {c[0]: c for c in bp.DP_PP_CASES}[case]
            server += tuple(f"--server-arg=--{a}" for a in settings.split(",") if a != "-")
            t0 = time.time()
            row = bp._dp_pp_run((f"{name} {settings}", schedule, extra, server), lr, 0, 150, 8,
                                4, Path(tmp), 900)
            print(json.dumps({"case": case, "lr": lr, "server_args": settings,
                              "final": row["final_loss"], "s": round(time.time() - t0)}),
                  flush=True)
