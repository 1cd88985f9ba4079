"""The shards' Adam beta1 (and the lr-scaling compensations) for part (c)'s 1F1B and 2BW with
weight prediction, one run each (2026-12-06; beta1_study.json). Arguments, in threes: a case of
``bitps.bench.pipeline.DP_PP_CASES``, a server lr, and comma-separated server settings (``-``:
none), e.g. ``"2bw + prediction" 0.0015 beta1=0.97``."""
import json
import sys
import time
from pathlib import Path

from bitps.bench import pipeline as bp

if __name__ == "__main__":
    args = sys.argv[1:]
    for case, lr, settings in zip(args[::3], map(float, args[1::3]), args[2::3]):
        name, schedule, extra, _ = {c[0]: c for c in bp.DP_PP_CASES}[case]
        tag = settings.replace("=", "").replace(",", "_")
        run_dir = Path(f"/tmp/twobw/{case.replace(' ', '')}-{lr:g}-{tag}")
        launcher = ["--shards", "2", "--mode", "async", "--dp", "2", "--pp", "2",
                    "--micro-batch-size", "8", "--lr", f"{lr:g}",
                    "--gradient-accumulation-steps", "4", "--schedule", schedule]
        launcher += [f"--server-arg=--{a}" for a in settings.split(",") if a != "-"]
        t0 = time.time()
        summary, _ = bp.launch_pipeline(run_dir, launcher, [
            "--model", "deep", "--steps", "150", "--push-codec", "sign1", "--log-every", "1",
            *extra], 900)
        last = [d for d in summary["stages"] if d is not None and d["stage"] == 1]
        final = sum(d["final_loss"] for d in last) / len(last)
        print(json.dumps({"case": case, "lr": lr, "server_args": settings, "final": final,
                          "s": round(time.time() - t0)}), flush=True)
