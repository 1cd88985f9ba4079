"""``bitps-bench pipeline``: measured pipeline bubbles on sleep-based stages of fixed duration.

(a) **Synthetic stages.** ``p`` (4) rank processes (``bench.pipeline_rank``, torchrun's
environment, gloo over 127.0.0.1), each stage a
:class:`~bitps.worker.pipeline.synthetic.SleepStage` whose F, B and W sleep ``t_f``, ``t_b``,
``t_w`` (40 ms each; at least 20). For every case and every m (4, 8, 16), one warm-up step
then ``rounds`` (3) timed steps, the cases alternated round by round in one run. A step
starts at a barrier; its wall time runs from the earliest rank's release to the last rank's
end, and each rank's bubble is ``1 - busy / wall`` with busy the sum of its recorded F/B/W
intervals. Reported: the median over the timed steps of the largest and the mean bubble over
ranks, the step time, the measured mean F/B/W durations, and peak in-flight micro-batches per
rank (forward ended, input-backward not; a half-size chunk counts 0.5).

The cases: our schedules (``gpipe``, ``1f1b``, ``zb-h1``, ``2bw``) run by our
``StageRuntime``, each beside our simulator's figures for the same plan with each stage's
measured mean F/B/W and, as the transfer cost, the hop the case measured (F start on stage
s + 1 less F end on stage s where s + 1 waited; :func:`hop_latency`), and the closed form
where one exists; the flush-free ``2bw`` runs ``flush_free_steps`` steps as
one plan, with the steady-state bubble of steps ``1 .. N-2`` measured and simulated. Then
torch.distributed.pipelining's schedules on the same stages: ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB1P) and
``ScheduleZBVZeroBubble`` (two stages per rank, each half the time). Acceptance 3 is reported
as checks: measured within 0.03 of simulated for each of our schedules at each m; the best
flushing schedule at p = 4, m = 8 <= 0.12 and no worse than torch's best there with no more
in-flight micro-batches; the flush-free steady state <= 0.05. ``excess ms`` (measured step -
simulated makespan) and the median gap between a rank's actions are the overhead floor the
simulator does not model.

(b) **The deep demo model on p = 4** (``bitps-launch --dp 1 --pp 4``, one sync shard): the
runs of :data:`DEEP_CASES` one after another (baseline 1F1B on a uniform split, balanced by the
profile, fixed micro-batch sizes 4/8/16 at one global batch, + dynamic micro-batching,
+ look-ahead and ZB-H1, the flush-free 2BW), bubble and samples/s from every stage's step
events, the measured balance (slowest/mean stage busy time), and the problem statement's rows
(its claims, copied) beside them. (c) **dp = 2 x pp = 2 through the PS**: two async shards,
sign1 (1-bit) pushes, 1F1B, 2BW and 2BW with weight prediction at equal samples: loss curve,
throughput, final-loss ratios.
Rows of (b) and (c) go under ``deep_rows`` and ``dp_pp_rows`` of the JSON, each with its own
Markdown table; their checks join (a)'s.

The run waits for a quiet window (at most ``quiet_busy`` of all cores busy over 2 s, for up to
``quiet_wait_s``), and the load is recorded twice: that reading before the run, and during it
the share of all cores busy with work other than the bench's rank processes (``/proc/stat``
less the ranks' CPU time); sleeping ranks make the figures depend on the schedule, not on the
machine, unless that other load is high (the ``quiet_window`` check says so).
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

from bitps.bench.config import PipelineBench
from bitps.bench.proc import machine_busy
from bitps.bench.report import DEFAULT_OUT, check, write_results

__all__ = ["run", "summarize"]

_COLUMNS = [("impl", "implementation"), ("schedule", "schedule"), ("m", "m"),
            ("bubble_max", "bubble max"), ("sim_bubble_max", "simulated max"),
            ("bubble_mean", "bubble mean"), ("sim_bubble_mean", "simulated mean"),
            ("closed_form", "closed form"), ("steady_bubble", "steady state"),
            ("sim_steady_bubble", "simulated steady"), ("step_ms", "step ms"),
            ("hop_ms", "hop ms"), ("excess_ms", "excess ms"),
            ("median_gap_ms", "median gap ms"),
            ("peak_inflight", "peak in-flight (per rank)"),
            ("peak_held", "held to W"), ("t_f_ms", "F ms"), ("t_b_ms", "B ms"),
            ("t_w_ms", "W ms")]
_TORCH_NAMES = {"torch-gpipe": "ScheduleGPipe", "torch-1f1b": "Schedule1F1B",
                "torch-zb1p": "ScheduleInterleavedZeroBubble (1 stage/rank)",
                "torch-zbv": "ScheduleZBVZeroBubble (2 stages/rank)"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quiet_window(max_busy: float, wait_s: float) -> tuple[float, float]:
    """Wait until the machine's cores are at most ``max_busy`` busy over 2 s (``/proc/stat``),
    or ``wait_s`` has passed; (the last reading, seconds waited). Sleeping stages measure the
    schedule only while other work leaves the cores free enough to wake them on time."""
    t0 = time.monotonic()
    while True:
        busy = machine_busy(2.0)
        waited = time.monotonic() - t0
        if busy <= max_busy or waited >= wait_s:
            return busy, waited


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
    the largest and the mean bubble over ranks, the step time, the peak in-flight
    micro-batches of each rank (largest over the steps) and each rank's mean F/B/W."""
    steps: dict[tuple[str, int], dict[int, list[dict]]] = {}
    for doc in rank_docs:
        for rec in doc["records"]:
            steps.setdefault((rec["case"], rec["m"]), {}).setdefault(rec["round"], []).append(
                {**rec, "rank": doc["rank"]})
    rows = []
    for (case, m), rounds in steps.items():
        b_max, b_mean, walls = [], [], []
        inflight, held = [0.0] * p, [0.0] * p
        by_rank: list[list[float]] = [[] for _ in range(p)]
        gaps: list[float] = []
        kinds = ("t_f_s", "t_b_s", "t_w_s")
        per_rank = [[[] for _ in kinds] for _ in range(p)]
        for recs in rounds.values():
            if len(recs) != p:
                raise ValueError(f"{case} m={m}: {len(recs)} ranks reported a step, expected {p}")
            wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
            bubbles = [1 - r["busy_s"] / wall for r in recs]
            b_max.append(max(bubbles))
            b_mean.append(statistics.fmean(bubbles))
            walls.append(wall)
            for r, b in zip(recs, bubbles):
                by_rank[r["rank"]].append(b)
                spans = sorted(r["intervals"], key=lambda iv: iv[1])
                gaps += [b[1] - a[2] for a, b in zip(spans, spans[1:])]
            for r in recs:
                inflight[r["rank"]] = max(inflight[r["rank"]], r["peak_inflight"])
                held[r["rank"]] = max(held[r["rank"]], r["peak_held"])
                for i, k in enumerate(kinds):
                    per_rank[r["rank"]][i].append(r[k])
        stage_times = [[statistics.fmean(v) for v in rank] for rank in per_rank]
        rows.append({"case": case, "m": m, "bubble_max": statistics.median(b_max),
                     "bubble_mean": statistics.median(b_mean),
                     "bubble_per_rank": [statistics.median(b) for b in by_rank],
                     # most gaps between a rank's intervals wait for nothing: the floor
                     "median_gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
                     "step_ms": statistics.median(walls) * 1e3, "peak_inflight": inflight,
                     "peak_held": held, "steps": len(walls), "stage_times_s": stage_times,
                     **{k[:-2] + "_ms": statistics.fmean(t[i] for t in stage_times) * 1e3
                        for i, k in enumerate(kinds)}})
    return rows


def steady_bubble(recs: list[dict], m: int, first_step: int, last_step: int) -> float:
    """The measured counterpart of ``SimResult.steady_bubble``: over the window from the first
    compute start of step ``first_step`` (any rank) to the last compute end of step
    ``last_step``, the largest per-rank idle fraction, compute of other steps counting as busy.
    ``recs`` are one step's records of every rank with their ``intervals``; a flush-free plan
    runs each kind in micro-batch order on a rank, so the k-th F (B, W) is micro-batch k."""
    spans_by_rank = []
    for rec in recs:
        seen: dict[str, int] = {}
        spans = []
        for kind, start, end in sorted(rec["intervals"], key=lambda iv: iv[1]):
            mb = seen.get(kind, 0)
            seen[kind] = mb + 1
            spans.append((mb // m, start, end))
        spans_by_rank.append(spans)
    inside = [(a, b) for spans in spans_by_rank for k, a, b in spans
              if first_step <= k <= last_step]
    if not inside:
        raise ValueError(f"no compute in steps {first_step}..{last_step}")
    t0, t1 = min(a for a, _ in inside), max(b for _, b in inside)
    worst = 0.0
    for spans in spans_by_rank:
        busy = sum(max(0.0, min(b, t1) - max(a, t0)) for _, a, b in spans)
        worst = max(worst, 1.0 - busy / (t1 - t0))
    return worst


def hop_latency(recs: list[dict]) -> list[float]:
    """The forward transfer cost as the pipeline met it, from one step's records of every rank
    (ordered by rank): for every micro-batch and stage, the start of its F on stage ``s + 1``
    less the end of its F on stage ``s``, where stage ``s + 1`` was idle by then (so the wait
    was the transfer's: send posted, received, the receiver awake and started) — the
    simulator's ``comm_s``. Each rank runs its forwards in micro-batch order."""
    forwards = [[(a, b) for k, a, b in sorted(r["intervals"], key=lambda iv: iv[1]) if k == "F"]
                for r in recs]
    ends = [sorted(b for _, _, b in r["intervals"]) for r in recs]
    hops = []
    for s in range(len(recs) - 1):
        for (_, sent), (start, _) in zip(forwards[s], forwards[s + 1]):
            before = [e for e in ends[s + 1] if e <= start]
            if not before or before[-1] <= sent:  # the receiver waited for this message
                hops.append(start - sent)
    return hops


def _simulate(row: dict, p: int, steps: int, comm_s: float, overhead_s: float = 0.0):
    """Our simulator on the plan of ``row``'s schedule with each stage's measured times, the
    transfer cost ``comm_s`` and the per-action overhead ``overhead_s``."""
    from bitps.worker.pipeline.schedules import get_schedule
    from bitps.worker.pipeline.simulate import StageTimes, simulate

    schedule = get_schedule(row["case"])
    plan = schedule.generate(p, row["m"], steps=steps)
    # the simulator takes a rank's whole-stage times and gives each chunk its share; the
    # recorder's means are per action, i.e. per chunk
    k = schedule.chunks
    times = [StageTimes(f=k * f, b=k * b, w=k * w) for f, b, w in row["stage_times_s"]]
    return plan, simulate(plan, times, comm_s, action_overhead_s=overhead_s,
                          schedule=row["case"], m=row["m"])


def _rounds(docs: list[dict], case: str, m: int) -> dict[int, list[dict]]:
    """Every rank's records of ``case`` at ``m`` by round, each round's in rank order."""
    per_round: dict[int, list[dict]] = {}
    for doc in sorted(docs, key=lambda d: d["rank"]):
        for rec in doc["records"]:
            if rec["case"] == case and rec["m"] == m:
                per_round.setdefault(rec["round"], []).append(rec)
    return per_round


def _our_row(row: dict, docs: list[dict], p: int, steps: int) -> dict:
    from bitps.worker.pipeline.schedules import closed_form_bubble, get_schedule
    from bitps.worker.pipeline.simulate import StageTimes

    schedule = get_schedule(row["case"])
    per_round = _rounds(docs, row["case"], row["m"])
    # hop_latency pairs stage s with s + 1, which a V's chunks do not follow: for a V take the
    # hop of the same links measured by ZB-H1 at this m (one chunk per rank, same tensors)
    hop_case = row["case"] if schedule.chunks == 1 else "zb-h1"
    hops = [h for recs in _rounds(docs, hop_case, row["m"]).values() for h in hop_latency(recs)]
    hop_s = statistics.median(hops) if hops else 0.0
    # The per-action overhead is the median gap between a rank's compute intervals (most wait
    # for nothing); a measured hop ends at the receiver's F start, so it holds the receiver's
    # overhead too: the transfer alone is the hop less that.
    overhead_s = (row["median_gap_ms"] or 0.0) / 1e3
    comm_s = max(hop_s - overhead_s, 0.0)
    plan, sim = _simulate(row, p, 1 if schedule.flushes else steps, comm_s, overhead_s)
    k = schedule.chunks
    mean = StageTimes(f=k * row["t_f_ms"] / 1e3, b=k * row["t_b_ms"] / 1e3,
                      w=k * row["t_w_ms"] / 1e3)
    out = {"impl": "bitps", "schedule": schedule.name, **row,
           "closed_form": closed_form_bubble(schedule, p, row["m"], mean),
           "hop_ms": hop_s * 1e3, "hops_measured": len(hops),
           "sim_comm_ms": comm_s * 1e3, "sim_overhead_ms": overhead_s * 1e3,
           "sim_bubble_max": sim.bubble_max, "sim_bubble_mean": sim.bubble_mean,
           "sim_step_ms": sim.makespan * 1e3, "sim_peak_inflight": list(sim.peak_inflight),
           "diff_max": row["bubble_max"] - sim.bubble_max,
           "diff_mean": row["bubble_mean"] - sim.bubble_mean,
           "excess_ms": row["step_ms"] - sim.makespan * 1e3}
    # the excess over the simulator spread over the busiest rank's actions: the overhead floor
    out["excess_ms_per_action"] = out["excess_ms"] / max(len(acts) for acts in plan)
    if not schedule.flushes:
        first, last = 1, steps - 2
        out["steady_bubble"] = statistics.median(
            steady_bubble(recs, row["m"], first, last) for recs in per_round.values())
        out["sim_steady_bubble"] = sim.steady_bubble(first, last)
        out["steady_steps"] = f"{first}..{last} of {steps}"
    return out


def _torch_row(row: dict, p: int) -> dict:
    closed = (p - 1) / (row["m"] + p - 1) if row["case"] in ("torch-gpipe", "torch-1f1b") \
        else None
    return {"impl": "torch.distributed.pipelining", "schedule": _TORCH_NAMES[row["case"]],
            **row, "closed_form": closed}


def _checks(rows: list[dict], p: int, ms: tuple[int, ...], cases: tuple[str, ...],
            refused: dict) -> dict:
    """Acceptance 3 as lines: each with the figure and whether it holds."""
    checks = {}
    for m in ms:
        done = [r for r in rows if r["m"] == m]
        checks[f"cases_completed_m{m}"] = check(
            len(done), f"== {len(cases)} (refused: {sorted(refused)})", len(done) == len(cases))
    ours = [r for r in rows if r["impl"] == "bitps"]
    for r in ours:
        d = r["diff_max"]
        checks[f"{r['schedule']}_m{r['m']}_measured_vs_simulated"] = check(
            round(d, 4), "|measured - simulated| bubble max <= 0.03", abs(d) <= 0.03)
    for r in ours:
        if "steady_bubble" in r:
            checks[f"{r['schedule']}_m{r['m']}_steady_state_bubble"] = check(
                round(r["steady_bubble"], 4), "<= 0.05", r["steady_bubble"] <= 0.05)
    m = 8
    flushing = [r for r in ours if r["m"] == m and "steady_bubble" not in r]
    theirs = [r for r in rows if r["impl"] != "bitps" and r["m"] == m]
    if p == 4 and flushing:
        best = min(flushing, key=lambda r: r["bubble_max"])
        checks["best_flushing_bubble_p4_m8"] = check(
            f"{best['bubble_max']:.4f} ({best['schedule']})", "<= 0.12",
            best["bubble_max"] <= 0.12)
        if theirs:
            top = min(theirs, key=lambda r: r["bubble_max"])
            ok = (best["bubble_max"] <= top["bubble_max"]
                  and max(best["peak_inflight"]) <= max(top["peak_inflight"])
                  and max(best["peak_held"]) <= max(top["peak_held"]))
            checks["best_flushing_vs_torch_best_m8"] = check(
                f"{best['schedule']} {best['bubble_max']:.4f}, in-flight "
                f"{max(best['peak_inflight']):g}/held {max(best['peak_held']):g} vs "
                f"{top['schedule']} {top['bubble_max']:.4f}, in-flight "
                f"{max(top['peak_inflight']):g}/held {max(top['peak_held']):g}",
                "bubble <= torch's best, in-flight and held <= its", ok)
    return checks


def run(cfg: PipelineBench | None = None, *, out: Path | None = None) -> dict:
    """Run ``cfg.parts`` (part (a) always), write ``pipeline.json``/``.md`` under ``out``,
    return the document. Part (a) starts once the machine is at most ``quiet_busy`` busy (or
    after ``quiet_wait_s``); (b) and (c) follow, their rows under ``deep_rows`` /
    ``dp_pp_rows``."""
    cfg = (cfg or PipelineBench()).sized()
    rows, checks, config, notes = _part_a(cfg)
    # (a) is on disk before (b) and (c) start: a failure there keeps it
    write_results("pipeline", config=config, rows=rows, checks=checks, columns=_COLUMNS,
                  out=out, notes=notes)
    sections = _parts_b_c(cfg, checks)
    write_results("pipeline", config=config, rows=rows, checks=checks, columns=_COLUMNS,
                  out=out, notes=notes)
    for section in sections:
        append_section(Path(out or DEFAULT_OUT), *section)
    return {"rows": rows + [r for s in sections for r in s[2]], "checks": checks}


def _part_a(cfg: PipelineBench) -> tuple[list[dict], dict, dict, str]:
    """Part (a): every case at every m on sleep-based stages; its rows, checks, config and
    notes."""
    from bitps.bench.pipeline_rank import CASES, OUR_CASES

    cases = tuple(cfg.cases or CASES)
    t_f, t_b, t_w = (t / 1e3 for t in cfg.t_ms)
    busy, waited = quiet_window(cfg.quiet_busy, cfg.quiet_wait_s)
    settings = {"p": cfg.p, "ms": list(cfg.ms), "t_f": t_f, "t_b": t_b, "t_w": t_w,
                "rows": cfg.rows_per_mb, "width": cfg.width, "rounds": cfg.rounds,
                "warmup": cfg.warmup, "cases": list(cases),
                "flush_free_steps": cfg.flush_free_steps, "nice": cfg.nice,
                "timeout_s": cfg.timeout_s}
    docs, load = _launch("bitps.bench.pipeline_rank", settings, cfg.p, cfg.timeout_s + 60)
    refused = {k: v for d in docs for k, v in d["refused"].items()}
    rows = [_our_row(r, docs, cfg.p, cfg.flush_free_steps) if r["case"] in OUR_CASES
            else _torch_row(r, cfg.p) for r in summarize(docs, cfg.p)]
    order = {c: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: (r["m"], order[r["case"]]))
    checks = _checks(rows, cfg.p, cfg.ms, cases, refused)
    other = load["other_load_share"]
    checks["quiet_window"] = check(
        f"{busy:.2f} busy before, {other:.2f} other load during", f"<= {cfg.quiet_busy} both "
        "(else the figures measure the machine)",
        busy <= cfg.quiet_busy and other <= cfg.quiet_busy)
    config = {"p": cfg.p, "ms": list(cfg.ms), "t_f_s": t_f, "t_b_s": t_b, "t_w_s": t_w,
              "rounds": cfg.rounds, "warmup": cfg.warmup,
              "micro_batch_shape": [cfg.rows_per_mb, cfg.width],
              "backend": "gloo", "transport": "127.0.0.1", "cases": list(cases),
              "flush_free_steps": cfg.flush_free_steps, "refused": refused,
              "rank_nice": sorted({str(d["nice"]) for d in docs}),
              "comm_one_way_ms": round(max(d["comm_s"] for d in docs) * 1e3, 4),
              "stage_link_one_way_ms": round(max(d["link_s"] for d in docs) * 1e3, 4),
              "machine_busy_before": round(busy, 3),
              "quiet_waited_s": round(waited, 1),
              "load_during": load, "quick": cfg.quick, "parts": list(cfg.parts)}
    return rows, checks, config, _notes_a(cfg, docs, load, busy, refused)


def _notes_a(cfg: PipelineBench, docs: list[dict], load: dict, busy: float,
             refused: dict) -> str:
    t_f, t_b, t_w = (t / 1e3 for t in cfg.t_ms)
    comm_s = max(d["comm_s"] for d in docs)
    link_s = max(d["link_s"] for d in docs)
    steps = cfg.flush_free_steps
    return (f"Part (a): p = {cfg.p} gloo ranks over 127.0.0.1, each stage a SleepStage "
            f"(F {t_f * 1e3:g} ms, B {t_b * 1e3:g} ms, W {t_w * 1e3:g} ms; a rank with two "
            f"stages runs each at half). Per case and m: {cfg.warmup} warm-up step, then "
            f"{cfg.rounds} timed step(s), the cases alternated round by round in one run. "
            f"bubble = 1 - busy / wall per rank (busy: the stage's recorded F/B/W sleeps; "
            f"wall: barrier release to the last rank's end); max and mean over ranks, median "
            f"over the timed steps. simulated: our event simulator on the same plan with each "
            f"stage's measured mean F/B/W and, as the transfer cost, the case's measured hop "
            f"(median over micro-batches and stages of F start on s + 1 - F end on s where "
            f"s + 1 was idle; zb-v takes zb-h1's at the same m, its V not pairing s with "
            f"s + 1; ping-pong probes before the run: StageLink "
            f"{link_s * 1e3:.3f} ms, raw gloo {comm_s * 1e3:.3f} ms one way) less the "
            f"per-action overhead, and that overhead (the case's median gap between a rank's "
            f"compute intervals), paid before every compute action as idle time; "
            f"excess = measured step - simulated makespan. The "
            f"flush-free 2bw runs {steps} steps as one plan per timed step (its "
            f"bubble and step are those of the whole plan; steady state: steps 1.."
            f"{steps - 2}). Peak in-flight: micro-batches whose forward ended and "
            f"input-backward did not, per rank; held: until the weight-backward (torch's first "
            f"stage runs its B inside W). The rank processes run at nice "
            f"{', '.join(sorted({str(d['nice']) for d in docs}))} so that other work on the "
            f"machine delays their wake-ups less. Load: {busy:.0%} of all cores busy before "
            f"the run; during it, other work took {load['other_load_share']:.0%} of all cores."
            + (f" Refused: {refused}." if refused else ""))


def _parts_b_c(cfg: PipelineBench, checks: dict) -> list[tuple]:
    """Parts (b) and (c) as ``cfg.parts`` asks, their checks added to ``checks``; the
    sections :func:`append_section` writes."""
    import tempfile

    sections = []
    with tempfile.TemporaryDirectory(prefix="bitps-bench-pipeline-") as tmp:
        if "b" in cfg.parts:
            deep, deep_checks = run_deep(p=cfg.p, steps=cfg.deep_steps, run_root=Path(tmp),
                                         timeout_s=cfg.timeout_s)
            checks.update(deep_checks)
            sections.append(("deep_rows", _DEEP_TITLE, deep, _DEEP_COLUMNS,
                             _deep_notes(cfg.deep_steps)))
        if "c" in cfg.parts:
            dppp, dppp_checks = run_dp_pp(steps=cfg.dp_pp_steps, run_root=Path(tmp),
                                          timeout_s=cfg.timeout_s)
            checks.update(dppp_checks)
            sections.append(("dp_pp_rows", _DPPP_TITLE, dppp, _DPPP_COLUMNS,
                             _dp_pp_notes(cfg.dp_pp_steps)))
    return sections


# -- parts (b) and (c): real pipelines through bitps-launch ---------------------------------

DEEP_CASES = (
    # (case, schedule, balance, micro-batch size, dynamic micro-batching, look-ahead)
    ("baseline: 1F1B, uniform split", "1f1b", "uniform", 8, False, False),
    ("1F1B, balanced", "1f1b", "profile", 8, False, False),
    ("1F1B, balanced, fixed micro-batch 4", "1f1b", "profile", 4, False, False),
    ("1F1B, balanced, fixed micro-batch 16", "1f1b", "profile", 16, False, False),
    ("+ dynamic micro-batching", "1f1b", "profile", 8, True, False),
    ("+ look-ahead and ZB-H1", "zb-h1", "profile", 8, True, True),
    ("flush-free 2BW + look-ahead", "2bw", "profile", 8, False, True),
)
"""Part (b)'s runs, in order: each a ``bitps-launch --dp 1 --pp 4`` of the deep model."""

PROBLEM_ROWS = (
    # (row, bubble, throughput vs baseline): the problem statement's claims, copied
    ("problem statement: baseline", 0.28, 1.0),
    ("problem statement: + dynamic scheduling", 0.19, 1.15),
    ("problem statement: all combined", 0.12, 1.31),
)

_DEEP_COLUMNS = [("case", "case"), ("schedule", "schedule"), ("balance", "split"),
                 ("micro_batch_sizes", "micro-batch sizes"), ("bubble_max", "bubble max"),
                 ("bubble_mean", "bubble mean"), ("samples_per_s", "samples/s"),
                 ("samples_per_s_rounds", "samples/s by round"),
                 ("vs_baseline", "x baseline"), ("stage_busy_ms", "stage busy ms/step"),
                 ("imbalance", "slowest/mean"), ("stage_alone_ms", "stage alone ms/mb"),
                 ("imbalance_alone", "slowest/mean alone"), ("partition", "layers per stage")]
_DPPP_COLUMNS = [("case", "case"), ("schedule", "schedule"), ("samples", "samples"),
                 ("first_loss", "first loss"), ("final_loss", "final loss"),
                 ("final_loss_by_seed", "final loss by seed"),
                 ("loss_drop", "drop"), ("samples_per_s", "samples/s"),
                 ("bubble_mean", "bubble mean"), ("stages_reporting", "stages reporting"),
                 ("best_lr", "best lr"), ("loss_curve", "loss, 6 points (replica 0)")]


_DEEP_TITLE = "(b) The deep demo model on p = 4"
_DPPP_TITLE = "(c) dp = 2 x pp = 2 through the PS: async, 1-bit (sign1) pushes"


def _deep_notes(steps: int) -> str:
    return (f"Each row: bitps-launch --dp 1 --pp 4, the deep model (12 layers: embedding, ten "
            f"blocks, a wide head), one sync shard, {steps} steps of 64 samples (m = 64 / "
            f"micro-batch size), measured after the first {max(2, steps // 4)}; the cases "
            f"alternate round by round, each figure the median of its rounds (samples/s by "
            f"round beside it). bubble = 1 - "
            f"busy / wall per stage per step (the runtime's timers); samples/s = samples over "
            f"the summed step walls (a step's wall: its slowest stage's). Stage busy: median "
            f"per step; slowest/mean of it is the measured balance (uniform: equal layer "
            f"counts; profile: min-max partition of the profiled per-layer times); stage alone: "
            f"each stage's forward + backward per micro-batch of 8 timed in one process after "
            f"the runs, with nothing else running (slowest/mean alone is the balance check). "
            f"The 2BW row "
            f"is one run_step over every step (its figures: the whole run's). The machine has "
            f"{os.cpu_count()} cores for 4 stage processes, a shard and the other load, so "
            f"stages contend for CPU: busy times and bubbles carry that. The problem "
            f"statement's rows are its claims, copied (28 % -> 19 % -> 12 %, +15 %, +31 %), "
            f"not measured here.")


def _dp_pp_notes(steps: int) -> str:
    return (f"bitps-launch --shards 2 --mode async --dp 2 --pp 2, the deep model, micro-batch "
            f"8, m = 4, {steps} steps per replica, --push-codec sign1 (1-bit signs with error "
            f"feedback), 1F1B, the flush-free 2BW (one run_step over all steps) and 2BW on "
            f"predicted weights (--weight-prediction 2; and --weight-prediction 3 with the "
            f"shards' Adam beta1 at 0.97, --server-arg=--beta1=0.97) at equal samples, at each "
            f"server lr of {', '.join(f'{x:g}' for x in DP_PP_LRS)} and seed of "
            f"{', '.join(map(str, DP_PP_SEEDS))} (--seed; each schedule judged at its best lr "
            f"on the mean over the seeds: best lr = yes). Losses: the last stages' (first "
            f"step; final = mean of the last 10 steps), averaged over the two replicas, then "
            f"over the seeds; samples/s over both replicas.")


def launch_pipeline(run_dir: Path, launcher: list[str], stage: list[str],
                    timeout_s: float) -> tuple[dict, list[dict]]:
    """Run ``bitps-launch <launcher> -- <stage>`` with ``--run-dir run_dir``; its
    ``summary.json`` and the step events of ``steps.jsonl``. A failed run raises naming the
    launcher's last output."""
    argv = [sys.executable, "-m", "bitps.worker.launch", "--run-dir", str(run_dir), *launcher,
            "--", *stage]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})
    summary_path = run_dir / "summary.json"
    if proc.returncode or not summary_path.exists():
        raise RuntimeError(f"bitps-launch {' '.join(launcher)} -- {' '.join(stage)} exited "
                           f"{proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return json.loads(summary_path.read_text()), steps


def _by_step(events: list[dict], replica: int = 0) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for e in events:
        if e["replica"] == replica:
            out.setdefault(e["step"], {})[e["stage"]] = e
    return out


def _median_of_rounds(rounds: list[dict]) -> dict:
    """One case's rows of every round as one: the medians of its figures, every round's
    samples/s, the sizes any round used; the rest (split, layers) from the last round."""
    row = dict(rounds[-1])
    for key in ("samples_per_s", "bubble_max", "bubble_mean", "imbalance"):
        row[key] = statistics.median(r[key] for r in rounds)
    row["samples_per_s_rounds"] = [round(r["samples_per_s"], 1) for r in rounds]
    row["micro_batch_sizes"] = sorted({b for r in rounds for b in r["micro_batch_sizes"]})
    row["rounds"] = len(rounds)
    return row


def deep_row(case: tuple, summary: dict, events: list[dict], p: int, skip: int) -> dict:
    """One part (b) row: over the steps after the first ``skip``, the median of the largest
    and the mean stage bubble, samples/s (samples over the summed step walls, a step's wall
    being its slowest stage's), each stage's median busy time per step and slowest/mean."""
    name, schedule, balance, size, dynamic, lookahead = case
    steps = _by_step(events)
    kept = [s for k, s in sorted(steps.items()) if k >= skip and len(s) == p]
    if not kept:
        raise ValueError(f"{name}: no step after {skip} reported by all {p} stages")
    walls = [max(e["wall_s"] for e in s.values()) for s in kept]
    samples = sum(s[0]["samples_per_s"] * s[0]["wall_s"] for s in kept)
    busy = [statistics.median(s[st]["busy_s"] for s in kept) for st in range(p)]
    start = next(e for e in summary["starts"] if e is not None)
    sizes = sorted({e["micro_batch_size"] for e in events})
    return {"part": "b", "case": name, "schedule": schedule, "balance": balance,
            "dynamic": dynamic, "lookahead": lookahead, "start_micro_batch": size,
            "micro_batch_sizes": sizes, "steps_measured": len(kept),
            "bubble_max": statistics.median(max(e["bubble"] for e in s.values())
                                            for s in kept),
            "bubble_mean": statistics.median(statistics.fmean(e["bubble"] for e in s.values())
                                             for s in kept),
            "samples_per_s": samples / sum(walls),
            "stage_busy_ms": [round(b * 1e3, 1) for b in busy],
            "imbalance": max(busy) / statistics.fmean(busy),
            "partition": [f"{a}-{b - 1}" for a, b in start["partition"]],
            "profiled_costs_ms": (None if start.get("costs") is None
                                  else [round(c * 1e3, 3) for c in start["costs"]])}


def run_deep(*, p: int = 4, steps: int = 24, replica_batch: int = 64, run_root: Path,
             timeout_s: float = 600.0, cases: tuple = DEEP_CASES,
             rounds: int = 2) -> tuple[list[dict], dict]:
    """Part (b): every case of ``cases`` on the deep model (sync mode, one shard), the cases
    alternated round by round (``rounds``), each row the median of its rounds; its rows (ours,
    then the problem statement's) and checks."""
    skip = max(2, steps // 4)  # warm-up, and the tuner's first moves
    per_case: dict[str, list[dict]] = {case[0]: [] for case in cases}
    for round_no in range(rounds):
        for i, case in enumerate(cases):
            name, schedule, balance, size, dynamic, lookahead = case
            summary, events = launch_pipeline(
                run_root / f"deep-{round_no}-{i}",
                ["--shards", "1", "--mode", "sync", "--dp", "1", "--pp", str(p),
                 "--micro-batch-size", str(size),
                 "--gradient-accumulation-steps", str(replica_batch // size),
                 "--schedule", schedule],
                ["--model", "deep", "--steps", str(steps), "--balance", balance,
                 "--log-every", "1", "--dynamic-micro-batch", str(dynamic).lower(),
                 "--lookahead", str(lookahead).lower()],
                timeout_s)
            row = deep_row(case, summary, events, p, skip)
            per_case[name].append(row)
            print(f"(b) round {round_no} {name}: bubble {row['bubble_max']:.3f}, "
                  f"{row['samples_per_s']:.1f} samples/s", file=sys.stderr)
    rows = [_median_of_rounds(per_case[case[0]]) for case in cases]
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["vs_baseline"] = r["samples_per_s"] / base
    # Each split's stages timed alone, after the runs (nothing else running): the balance
    # without 4 stage processes contending for 2 cores.
    splits = {r["balance"]: [range(int(a), int(b) + 1) for a, b in
                             (x.split("-") for x in r["partition"])] for r in rows}
    alone = stage_times_alone(splits)
    for r in rows:
        t = alone[r["balance"]]
        r["stage_alone_ms"] = [round(v * 1e3, 2) for v in t]
        r["imbalance_alone"] = max(t) / statistics.fmean(t)
    rows += [{"part": "b", "case": name, "bubble_max": bubble, "vs_baseline": speed,
              "schedule": "(claim)"} for name, bubble, speed in PROBLEM_ROWS]
    return rows, _deep_checks(rows)


def _deep_checks(rows: list[dict]) -> dict:
    by = {r["case"]: r for r in rows}
    checks = {}
    uniform, balanced = by.get(DEEP_CASES[0][0]), by.get(DEEP_CASES[1][0])
    if uniform and balanced:
        checks["deep_balanced_slowest_over_mean"] = check(
            f"{balanced['imbalance_alone']:.3f} (uniform split: "
            f"{uniform['imbalance_alone']:.3f})",
            "<= 1.05 (each stage's forward + backward timed alone)",
            balanced["imbalance_alone"] <= 1.05)
        checks["deep_balanced_slowest_over_mean_in_pipeline"] = check(
            f"{balanced['imbalance']:.3f} (uniform split: {uniform['imbalance']:.3f})",
            "reported (stage busy time in the pipeline run: 4 stages contend for 2 cores)",
            True)
    fixed = [r for r in rows if r.get("balance") == "profile" and not r.get("dynamic")
             and r.get("schedule") == "1f1b"]
    dynamic = by.get("+ dynamic micro-batching")
    if fixed and dynamic:
        best = max(fixed, key=lambda r: r["samples_per_s"])
        ratio = dynamic["samples_per_s"] / best["samples_per_s"]
        checks["deep_dynamic_vs_best_fixed_micro_batch"] = check(
            f"{ratio:.3f} ({dynamic['samples_per_s']:.1f} vs {best['samples_per_s']:.1f} "
            f"samples/s at {best['start_micro_batch']}; dynamic used "
            f"{dynamic['micro_batch_sizes']})", ">= 0.97", ratio >= 0.97)
    ours = [r for r in rows if "samples_per_s" in r]
    if ours:
        best = min(ours, key=lambda r: r["bubble_max"])
        checks["deep_best_bubble_vs_problem_statement"] = check(
            f"{best['bubble_max']:.3f} ({best['case']}; baseline "
            f"{ours[0]['bubble_max']:.3f})", "<= 0.12 (the problem statement's all-combined "
            "claim)", best["bubble_max"] <= 0.12)
    return checks


def stage_times_alone(partitions: dict[str, list[range]], *, micro_batch: int = 8,
                      repeats: int = 21, seed: int = 0) -> dict[str, list[float]]:
    """Seconds of forward + backward per micro-batch of each stage of each partition of the deep
    model, measured in this process with nothing else running: each stage's layers run as one
    module on the activations the layers before it produce (the last with the loss), round
    robin over every stage of every partition (a burst of other load lands on all alike), the
    median of ``repeats`` after a warm-up. The balance of a partition is then its slowest stage
    over the mean, free of the contention of 4 stage processes sharing 2 cores."""
    import torch

    from bitps.worker.pipeline.models import MODELS, stage_module

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each stage process runs (RunConfig.threads)
    try:
        return _stage_times(MODELS["deep"], stage_module, partitions, micro_batch, repeats, seed)
    finally:
        torch.set_num_threads(threads)


def _stage_times(spec, stage_module, partitions, micro_batch, repeats, seed):
    import torch

    model = spec.build(seed=seed)
    x, y = next(spec.batches(micro_batch, replica=0, replicas=1, seed=seed + 1))
    with torch.no_grad():
        acts, h = [], x
        for layer in model:
            acts.append(h)
            h = layer(h)
    units = [(name, stage_module(model, r), r) for name, ranges in partitions.items()
             for r in ranges]

    def run(unit, r: range) -> None:
        h = acts[r.start]
        if h.is_floating_point():
            h = h.detach().requires_grad_(True)
        out = unit(h)
        if r.stop == len(model):
            spec.loss(out, y).backward()
        else:
            out.backward(torch.ones_like(out))

    for _ in range(2):
        for _, unit, r in units:
            run(unit, r)
    times: list[list[float]] = [[] for _ in units]
    for _ in range(repeats):
        for i, (_, unit, r) in enumerate(units):
            t0 = time.perf_counter()
            run(unit, r)
            times[i].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    out: dict[str, list[float]] = {name: [] for name in partitions}
    for (name, _, _), t in zip(units, times):
        out[name].append(statistics.median(t))
    return out


DP_PP_LRS = (7.5e-4, 1.5e-3, 3e-3)
"""Part (c)'s server learning rates: each schedule is reported at its best (lowest final loss),
as ``bitps-bench convergence`` reports each mode at its best; a flush-free schedule's one-step
staleness wants a smaller step than 1F1B."""


DP_PP_CASES = (
    # (name, schedule, extra stage flags, extra launcher flags)
    ("1f1b", "1f1b", (), ()),
    ("2bw", "2bw", ("--weight-prediction", "0"), ()),
    ("2bw + prediction", "2bw", ("--weight-prediction", "2"), ()),
    ("2bw + prediction, beta1 0.97, h 3", "2bw", ("--weight-prediction", "3"),
     ("--server-arg=--beta1=0.97",)),
)
"""Part (c)'s cases: 1F1B, 2BW on its stale version, 2BW on the predicted weights
(``worker.pipeline.prediction``, two pull intervals ahead: the best of 1, 1.5, 2, 2.5 and 3
measured at the shards' default beta1, docs/pipeline.md), and with the shards' Adam beta1 at
0.97 instead of 0.9 (the best of 0.8, 0.95, 0.97 and 0.98 for it, where 1F1B's best stays 0.9)
three intervals ahead (with the smoother velocity of the longer momentum the best of 2, 2.5, 3
and 4: docs/pipeline.md)."""

DP_PP_SEEDS = (0, 1)
"""Part (c)'s seeds (the stages' ``--seed``: model init and data order): each case and lr runs
once per seed and is judged on the mean final loss. Runs of the same settings and seed end up
to 2 % apart (async shards interleave pushes differently from run to run), as much as the
difference part (c) judges."""

PREDICTED = tuple(c[0] for c in DP_PP_CASES if c[0].startswith("2bw + prediction"))
"""The cases checked against 1F1B's best (each at its own best lr): 2BW with weight
prediction."""


def run_dp_pp(*, steps: int = 150, micro_batch: int = 8, m: int = 4, run_root: Path,
              lrs: tuple[float, ...] = DP_PP_LRS, cases: tuple[tuple, ...] = DP_PP_CASES,
              seeds: tuple[int, ...] = DP_PP_SEEDS,
              timeout_s: float = 600.0) -> tuple[list[dict], dict]:
    """Part (c): dp = 2 x pp = 2 of the deep model through two async shards, sign1 (1-bit)
    pushes with error feedback, every case of ``cases`` (1F1B, the flush-free 2BW, 2BW with
    weight prediction) at equal samples, at every learning rate of ``lrs`` and seed of
    ``seeds`` (alternated: each lr and seed runs every case in turn); one row per case and lr,
    its losses the means over the seeds, each case judged at its best lr."""
    runs: dict[tuple[str, float], list[dict]] = {}
    for lr in lrs:
        for seed in seeds:
            for case in cases:
                runs.setdefault((case[0], lr), []).append(
                    _dp_pp_run(case, lr, seed, steps, micro_batch, m, run_root, timeout_s))
    rows = [_dp_pp_mean(r) for r in runs.values()]
    best = {c[0]: min((r for r in rows if r["schedule"] == c[0]), key=lambda r: r["final_loss"])
            for c in cases}
    for r in rows:
        r["best_lr"] = r is best[r["schedule"]]
    return rows, _dp_pp_checks(rows, best)


def _dp_pp_mean(runs: list[dict]) -> dict:
    """One case and lr over its seeds: the losses, speed and bubble averaged, each seed's final
    loss kept, the curve averaged point by point; stages reporting: the first short one."""
    row = dict(runs[0])
    for k in ("first_loss", "final_loss", "loss_drop", "samples_per_s", "bubble_mean"):
        row[k] = statistics.fmean(r[k] for r in runs)
    row["final_loss_by_seed"] = [round(r["final_loss"], 4) for r in runs]
    row["stages_reporting"] = next((r["stages_reporting"] for r in runs
                                    if r["stages_reporting"] != "4/4"), "4/4")
    row["loss_curve"] = [round(statistics.fmean(p), 3)
                         for p in zip(*(r["loss_curve"] for r in runs))]
    return row


def _dp_pp_checks(rows: list[dict], best: dict[str, dict]) -> dict:
    def vs_1f1b(case: str) -> tuple[float, str]:
        one, two = best["1f1b"], best[case]
        ratio = two["final_loss"] / one["final_loss"]
        return ratio, (f"{ratio:.4f} ({case} at lr {two['lr']:g}: {two['final_loss']:.4f}; "
                       f"1f1b at lr {one['lr']:g}: {one['final_loss']:.4f})")

    one, two = best["1f1b"], best["2bw"]
    ratio, text = vs_1f1b("2bw")
    checks = {
        "dp2_pp2_loss_falls_30pct": check(
            f"{one['loss_drop']:.3f} (1f1b), {two['loss_drop']:.3f} (2bw)", ">= 0.30 both",
            one["loss_drop"] >= 0.3 and two["loss_drop"] >= 0.3),
        "dp2_pp2_metrics_from_every_stage": check(
            ", ".join(r["stages_reporting"] for r in rows), "4/4 every run",
            all(r["stages_reporting"] == "4/4" for r in rows)),
        "dp2_pp2_flush_free_final_loss_vs_1f1b": check(
            text, "within 2 % of 1 (equal samples, each at its best lr)", abs(ratio - 1) <= 0.02)}
    for case in PREDICTED:
        if case in best:
            ratio, text = vs_1f1b(case)
            suffix = case.removeprefix("2bw + prediction").replace(",", "").replace(" ", "_")
            checks[f"twobw_prediction{suffix}_final_loss_vs_1f1b"] = check(
                text, "<= 1.02 (equal samples, each at its best lr)", ratio <= 1.02)
    return checks


def _dp_pp_run(case: tuple, lr: float, seed: int, steps: int, micro_batch: int, m: int,
               run_root: Path, timeout_s: float) -> dict:
    name, schedule, extra, server = case
    run_dir = run_root / (f"dppp-{name.replace(' ', '').replace('+', '-').replace(',', '')}"
                          f"-{lr:g}-seed{seed}")
    summary, events = launch_pipeline(
        run_dir, ["--shards", "2", "--mode", "async", "--dp", "2", "--pp", "2",
                  "--micro-batch-size", str(micro_batch), "--lr", f"{lr:g}",
                  "--gradient-accumulation-steps", str(m), "--schedule", schedule, *server],
        ["--model", "deep", "--steps", str(steps), "--push-codec", "sign1",
         "--log-every", "1", "--seed", str(seed), *extra], timeout_s)
    done = [d for d in summary["stages"] if d is not None]
    last = [d for d in done if d["stage"] == 1]
    curve = [e["loss"] for e in sorted(events, key=lambda e: e["step"])
             if e["replica"] == 0 and e["stage"] == 1 and e["loss"] is not None]
    first = statistics.fmean(d["first_loss"] for d in last)
    final = statistics.fmean(d["final_loss"] for d in last)
    wall = max(d["seconds"] for d in done)
    print(f"(c) {name} lr {lr:g} seed {seed}: loss {first:.3f} -> {final:.3f}", file=sys.stderr)
    return {"part": "c", "case": f"dp 2 x pp 2, async, sign1, {name}, lr {lr:g}",
            "schedule": name, "lr": lr, "samples": 2 * steps * micro_batch * m,
            "first_loss": first, "final_loss": final, "loss_drop": 1 - final / first,
            "samples_per_s": 2 * steps * micro_batch * m / wall,
            "bubble_mean": statistics.fmean(d["bubble"] for d in done),
            "stages_reporting": f"{len(done)}/4",
            "loss_curve": [round(x, 3) for x in curve[::max(steps // 6, 1)]]}


def append_section(out: Path, key: str, title: str, rows: list[dict],
                   columns: list[tuple[str, str]], notes: str) -> None:
    """Add ``rows`` to ``pipeline.json`` under ``key`` and a Markdown table of them, titled,
    to ``pipeline.md`` (both written by part (a) first)."""
    from bitps.bench.report import _fmt

    json_path, md_path = out / "pipeline.json", out / "pipeline.md"
    doc = json.loads(json_path.read_text())
    doc[key] = rows
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    lines = ["", f"## {title}", "", notes, "", "| " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    md_path.write_text(md_path.read_text() + "\n".join(lines) + "\n")
