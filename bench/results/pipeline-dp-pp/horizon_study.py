"""Part (c)'s settings, one run each (2026-12-06 23:00-23:14; horizon_study.json): the
prediction horizon h with the shards' Adam beta1 at 0.97, a server lr warm-up, and 1F1B in
the same window. Arguments, in fours: a schedule (``1f1b``, ``2bw``), h (``--weight-prediction``;
ignored for 1F1B), a server lr, and comma-separated server settings (``-``: none), e.g.
``2bw 3 0.0015 beta1=0.97``."""
import json
import sys
import time
from pathlib import Path

from bitps.bench import pipeline as bp

if __name__ == "__main__":
    args = sys.argv[1:]
    for sched, h, lr, settings in zip(args[::4], args[1::4], map(float, args[2::4]), args[3::4]):
        tag = settings.replace("=", "").replace(",", "_")
        run_dir = Path(f"/tmp/twobw/{sched}-h{h}-{lr:g}-{tag}-{time.time():.0f}")
        launcher = ["--shards", "2", "--mode", "async", "--dp", "2", "--pp", "2",
                    "--micro-batch-size", "8", "--lr", f"{lr:g}",
                    "--gradient-accumulation-steps", "4", "--schedule", sched]
        launcher += [f"--server-arg=--{a}" for a in settings.split(",") if a != "-"]
        extra = ("--weight-prediction", h) if sched == "2bw" else ()
        t0 = time.time()
        summary, _ = bp.launch_pipeline(run_dir, launcher, [
            "--model", "deep", "--steps", "150", "--push-codec", "sign1", "--log-every", "1",
            *extra], 900)
        last = [d for d in summary["stages"] if d is not None and d["stage"] == 1]
        final = sum(d["final_loss"] for d in last) / len(last)
        print(json.dumps({"schedule": sched, "h": h, "lr": lr, "server_args": settings,
                          "final": final, "s": round(time.time() - t0)}), flush=True)
