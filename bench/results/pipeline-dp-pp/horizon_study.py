"""Part (c)'s settings, one run each (2026-12-06 22:59-23:14; horizon_study.json): the
prediction horizon h with the shards' Adam beta1 at 0.97, a server lr warm-up, and 1F1B in
the same window. Arguments, in fours: a schedule (``1f1b``, ``2bw``), h (``--weight-prediction``;
ignored for 1F1B), a server lr, and comma-separated server settings (``-``: none), e.g.
``2bw 3 0.0015 beta1=0.97``. Each run is part (c)'s own (``_dp_pp_run``, seed 0: the stages'
default, which the runs recorded were launched with, before part (c) passed ``--seed``)."""
import json
import sys
import tempfile
import time
from pathlib import Path

from bitps.bench import pipeline as bp

if __name__ == "__main__":
    args = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="horizon-") as tmp:
        for sched, h, lr, settings in zip(args[::4], args[1::4], map(float, args[2::4]),
                                          args[3::4]):
            server = tuple(f"--server-arg=--{a}" for a in settings.split(",") if a != "-")
            extra = ("--weight-prediction", h) if sched == "2bw" else ()
            t0 = time.time()
            row = bp._dp_pp_run((f"{sched} h{h} {settings}", sched, extra, server), lr, 0,
                                150, 8, 4, Path(tmp), 900)
            print(json.dumps({"schedule": sched, "h": h, "lr": lr, "server_args": settings,
                              "final": row["final_loss"], "s": round(time.time() - t0)}),
                  flush=True)
