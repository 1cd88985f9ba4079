"""``bitps-bench pipeline``: measured pipeline bubbles on sleep-based stages of fixed duration.

(a) **Synthetic stages.** ``p`` (4) rank processes (``bench.pipeline_rank``, torchrun's
environment, gloo over 127.0.0.1), each stage a
:class:`~bitps.worker.pipeline.synthetic.SleepStage` whose F, B and W sleep ``t_f``, ``t_b``,
``t_w`` (20 ms each). For every case and every m (4, 8, 16), one warm-up step then ``rounds``
(3) timed steps, the cases alternated round by round in one run. A step starts at a barrier;
its wall time runs from the earliest rank's release to the last rank's end, and each rank's
bubble is ``1 - busy / wall`` with busy the sum of its recorded F/B/W intervals. Reported: the
median over the timed steps of the largest and the mean bubble over ranks, the step time, the
measured mean F/B/W durations, and peak in-flight micro-batches per rank (forward ended,
input-backward not; a half-size chunk counts 0.5).

The cases are torch.distributed.pipelining's schedules on the same stages: ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB1P) and
``ScheduleZBVZeroBubble`` (two stages per rank, each half the time). Beside each: the closed
form where one exists, (p-1)/(m+p-1) for GPipe and 1F1B.

The machine's load is recorded twice: the share of all cores busy over 2 s before the run, and
during the run the share of all cores busy with work other than the bench's rank processes
(``/proc/stat`` less the ranks' CPU time); sleeping ranks make the figures depend on the
schedule, not on the machine, unless that other load is high.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bitps.bench.proc import machine_busy
from bitps.bench.report import check, write_results

__all__ = ["run", "summarize"]

_COLUMNS = [("impl", "implementation"), ("schedule", "schedule"), ("m", "m"),
            ("bubble_max", "bubble max"), ("bubble_mean", "bubble mean"),
            ("closed_form", "closed form"), ("step_ms", "step ms"),
            ("peak_inflight", "peak in-flight (per rank)"), ("t_f_ms", "F ms"),
            ("t_b_ms", "B ms"), ("t_w_ms", "W ms")]
_TORCH_NAMES = {"torch-gpipe": "ScheduleGPipe", "torch-1f1b": "Schedule1F1B",
                "torch-zb1p": "ScheduleInterleavedZeroBubble (1 stage/rank)",
                "torch-zbv": "ScheduleZBVZeroBubble (2 stages/rank)"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_total() -> tuple[float, float]:
    """(busy, all) CPU seconds of the machine so far, from ``/proc/stat``."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - values[3] - values[4]) / tick, sum(values) / tick


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _launch(module: str, settings: dict, world: int, timeout_s: float) -> tuple[list[dict], dict]:
    """Run ``world`` ranks of ``python -m module '<settings>'`` under torchrun's environment;
    each rank's last stdout line (JSON), and the load recorded around them. A rank that
    fails or outlives ``timeout_s`` fails the run, naming the rank, after its peers stop."""
    port = _free_port()
    arg = json.dumps(settings)
    busy0, total0 = _cpu_total()
    child0 = _children_cpu()
    t0 = time.perf_counter()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", module, arg], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs, failed = [], []
    deadline = time.monotonic() + timeout_s
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} still running after {timeout_s:.0f} s")
                break
            if proc.returncode:
                failed.append(f"rank {rank} exited {proc.returncode}: {err[-2000:]}")
                break
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        raise RuntimeError(f"{module}: " + "; ".join(failed))
    wall = time.perf_counter() - t0
    busy1, total1 = _cpu_total()
    cores = os.cpu_count() or 1
    other = (busy1 - busy0) - (_children_cpu() - child0)
    load = {"wall_s": round(wall, 1), "ranks_cpu_s": round(_children_cpu() - child0, 1),
            "other_load_share": round(max(other, 0.0) / (wall * cores), 3),
            "machine_share_busy": round((busy1 - busy0) / max(total1 - total0, 1e-9), 3)}
    return outputs, load


def summarize(rank_docs: list[dict], p: int) -> list[dict]:
    """One row per (case, m) from every rank's records: the median over the timed steps of
    the largest and the mean bubble over ranks, the step time, and the peak in-flight
    micro-batches of each rank (largest over the steps)."""
    steps: dict[tuple[str, int], dict[int, list[dict]]] = {}
    for doc in rank_docs:
        for rec in doc["records"]:
            steps.setdefault((rec["case"], rec["m"]), {}).setdefault(rec["round"], []).append(
                {**rec, "rank": doc["rank"]})
    rows = []
    for (case, m), rounds in steps.items():
        b_max, b_mean, walls = [], [], []
        inflight, held = [0.0] * p, [0.0] * p
        times = {k: [] for k in ("t_f_s", "t_b_s", "t_w_s")}
        for recs in rounds.values():
            if len(recs) != p:
                raise ValueError(f"{case} m={m}: {len(recs)} ranks reported a step, expected {p}")
            wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
            bubbles = [1 - r["busy_s"] / wall for r in recs]
            b_max.append(max(bubbles))
            b_mean.append(statistics.fmean(bubbles))
            walls.append(wall)
            for r in recs:
                inflight[r["rank"]] = max(inflight[r["rank"]], r["peak_inflight"])
                held[r["rank"]] = max(held[r["rank"]], r["peak_held"])
                for k in times:
                    times[k].append(r[k])
        rows.append({"case": case, "m": m, "bubble_max": statistics.median(b_max),
                     "bubble_mean": statistics.median(b_mean),
                     "step_ms": statistics.median(walls) * 1e3, "peak_inflight": inflight,
                     "peak_held": held, "steps": len(walls),
                     **{k[:-2] + "_ms": statistics.fmean(v) * 1e3 for k, v in times.items()}})
    return rows


def _closed_form(case: str, p: int, m: int) -> float | None:
    if case in ("torch-gpipe", "torch-1f1b"):
        return (p - 1) / (m + p - 1)
    return None


def run(*, p: int = 4, ms: tuple[int, ...] = (4, 8, 16), t_f: float = 0.02,
        t_b: float = 0.02, t_w: float = 0.02, rounds: int = 3, warmup: int = 1,
        rows_per_mb: int = 2, width: int = 8, torch_cases: tuple[str, ...] | None = None,
        timeout_s: float = 600.0, out: Path | None = None, quick: bool = False) -> dict:
    """Run part (a), write ``pipeline.json``/``.md`` under ``out``, return the document."""
    from bitps.bench.pipeline_rank import CASES

    torch_cases = tuple(torch_cases or CASES)
    busy = machine_busy(2.0)
    settings = {"p": p, "ms": list(ms), "t_f": t_f, "t_b": t_b, "t_w": t_w, "rows": rows_per_mb,
                "width": width, "rounds": rounds, "warmup": warmup, "cases": list(torch_cases),
                "timeout_s": timeout_s}
    docs, load = _launch("bitps.bench.pipeline_rank", settings, p, timeout_s + 60)
    refused = {k: v for d in docs for k, v in d["refused"].items()}
    comm_s = max(d["comm_s"] for d in docs)
    rows = []
    for row in summarize(docs, p):
        rows.append({"impl": "torch.distributed.pipelining",
                     "schedule": _TORCH_NAMES[row["case"]],
                     "closed_form": _closed_form(row["case"], p, row["m"]), **row})
    rows.sort(key=lambda r: (r["m"], r["impl"], r["schedule"]))
    checks = {}
    for m in ms:
        done = [r for r in rows if r["m"] == m]
        checks[f"torch_cases_completed_m{m}"] = check(
            len(done), f"== {len(torch_cases)} (refused: {sorted(refused)})",
            len(done) == len(torch_cases))
    config = {"p": p, "ms": list(ms), "t_f_s": t_f, "t_b_s": t_b, "t_w_s": t_w,
              "rounds": rounds, "warmup": warmup, "micro_batch_shape": [rows_per_mb, width],
              "backend": "gloo", "transport": "127.0.0.1", "torch_cases": list(torch_cases),
              "torch_refused": refused, "comm_one_way_ms": round(comm_s * 1e3, 4),
              "machine_busy_before": round(busy, 3), "load_during": load, "quick": quick}
    notes = (f"Part (a): p = {p} gloo ranks over 127.0.0.1, each stage a SleepStage "
             f"(F {t_f * 1e3:g} ms, B {t_b * 1e3:g} ms, W {t_w * 1e3:g} ms; a rank with two "
             f"stages runs each at half). Per case and m: {warmup} warm-up step, then "
             f"{rounds} timed step(s), the cases alternated round by round in one run. "
             f"bubble = 1 - busy / wall per rank (wall: barrier release to the last rank's "
             f"end); max and mean over ranks, median over the timed steps. Peak in-flight: "
             f"micro-batches whose forward ended and input-backward did not, per rank "
             f"(torch's first stage runs its B inside W). One-way activation transfer: "
             f"{comm_s * 1e3:.3f} ms. Load: {busy:.0%} of all cores busy before the run; "
             f"during it, other work took {load['other_load_share']:.0%} of all cores."
             + (f" Refused by torch: {refused}." if refused else ""))
    write_results("pipeline", config=config, rows=rows, checks=checks, columns=_COLUMNS,
                  out=out, notes=notes)
    return {"rows": rows, "checks": checks}
