"""``bitps-bench scale``: how long a sync step takes, and how many shards a job needs, as a
function of workers, shards, model size, codec and link speed.

The model is :func:`bitps.bench.scale_model.step_time` (its docstring is the formula). Its
inputs are measured in the same run:

- per-byte CPU of the shard's update and of each push, and of the worker's encode and pull,
  in process with the ``bitps-bench kernels`` harnesses (``bench.scale_costs``);
- per link rate, on the emulated cluster (``bench.scale_cluster``): a raw ZeroMQ echo between
  two nodes (payload rate over the link's, machine CPU per byte that crosses), and small
  push_pulls through a real shard (round trip, CPU per message);
- wire bytes per element from the codecs (``Codec.max_bytes``).

This machine's speed moves from one minute to the next (and by 2-5x between runs), so with
``side_rounds`` > 0 every CPU cost is measured again beside each point (``bench.scale_beside``):
the row then also says how far the costs moved from the run's start (``drift``), how much they
differ just before and just after the point (``spread``: how well any prediction from them can
hold), and the prediction from the costs beside it. The check uses the prediction from the
costs measured at the start, as does the extrapolation.

Then the measured points: real ``bitps-server`` shards and ``scale_rank`` workers, each on a
node of its own, a push_pull of the whole key set per step (no model compute), at every
workers x shards x rate x scheme; each point's step time beside the model's, checked within
``tolerance``. Last, the extrapolation: ``big_workers`` workers and 1 .. ``max_shards`` shards,
each on a machine of its own, for a ``params``-parameter model at each of ``link_gbps``, with
the fewest shards whose NICs and update keep up with ``compute_s`` of overlapped compute.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np

from bitps.bench.cluster import emulated_cluster
from bitps.bench.config import ScaleBench
from bitps.bench.proc import machine_busy
from bitps.bench.report import check, median, write_results
from bitps.bench.scale_beside import Beside, spread_summary
from bitps.bench.scale_cluster import Measured, measure_point, measure_wire
from bitps.bench.scale_costs import (
    SCHEMES,
    beyond,
    measure_contention,
    measure_costs,
    per_message,
)
from bitps.bench.scale_model import Machines, WireCosts, shards_needed, step_time

__all__ = ["run"]

SHOWN_SHARDS = (1, 2, 4, 8, 16)
"""Shard counts the Markdown extrapolation table shows (the JSON has every one)."""
_COLUMNS = [("rate", "link"), ("scheme", "scheme"), ("workers", "workers"),
            ("shards", "shards"), ("measured_ms", "measured ms"),
            ("predicted_ms", "predicted ms"), ("ratio", "measured / predicted"),
            ("bottleneck", "bottleneck"), ("machine_cpu_ms", "machine CPU ms"),
            ("predicted_cpu_ms", "predicted CPU ms"), ("other_cpu_ms", "other CPU ms"),
            ("tries", "tries"), ("beside_predicted_ms", "predicted from costs beside ms"),
            ("drift", "costs beside / run start"), ("spread", "costs after / before")]


def run(cfg: ScaleBench | None = None, *, out: Path | None = None) -> dict:
    """Run the scenario (``None``: the defaults), write ``scale.json``/``.md`` under ``out``,
    return the document."""
    cfg = (cfg or ScaleBench()).sized()
    n, keys = cfg.key_kib * 256, max(1, cfg.mib * 1024 // cfg.key_kib)
    busy = machine_busy(2.0)
    t0 = time.monotonic()
    costs, figures = measure_costs(cfg.schemes, keys=keys, n=n, workers=cfg.workers,
                                   rounds=cfg.rounds)
    handle_s, thread_s = per_message(cfg.rounds)
    cores = os.cpu_count() or 1
    bandwidth, contention = _memory(keys * n, cores, cfg.rounds)
    kappa = measure_contention(cfg.schemes, keys=keys, n=n, cores=cores, rounds=cfg.rounds)
    costs = {name: dataclasses.replace(c, contention=kappa[name]) for name, c in costs.items()}
    # the large job's other key size: its per-byte costs hold a different per-message share
    big_n = cfg.big_key_mib << 18
    big = {cfg.key_kib << 10: costs}
    if big_n != n:
        big[4 * big_n], figures[f"{cfg.big_key_mib} MiB keys"] = measure_costs(
            cfg.schemes, keys=max(1, cfg.mib // cfg.big_key_mib), n=big_n, workers=cfg.workers,
            rounds=cfg.rounds)
    wires, links, measured = {}, {}, []
    for rate in cfg.rates:
        with emulated_cluster(max(cfg.workers) + max(cfg.shards), rate=rate) as cluster:
            wires[rate] = beyond(measure_wire(
                cluster, key_bytes=4 * n, echo_keys=keys, rounds=cfg.rounds, tiny_steps=1000,
                flows=tuple(sorted(set(cfg.workers) | set(cfg.shards))),
                message_sizes=tuple(sorted({round(costs[name].push_bytes * 4 * n)
                                            for name in cfg.schemes}))), handle_s, thread_s)
            links[rate] = {"kind": cluster.kind, "note": cluster.note}
            for name in cfg.schemes:
                for shards in cfg.shards:
                    for workers in cfg.workers:
                        side = Beside(cluster, name, costs[name], keys=keys, n=n,
                                      workers=cfg.workers, rounds=cfg.side_rounds)
                        point = _quiet_point(cfg, cluster, SCHEMES[name].scheme,
                                             workers=workers, shards=shards, keys=keys, n=n)
                        side.after()
                        measured.append((rate, name, workers, shards, *point, side))
    # The link's framing is the same at every rate, and a CPU-bound echo reads it low.
    efficiency = {k: max(w.efficiency[k] for w in wires.values())
                  for k in next(iter(wires.values())).efficiency}
    wires = {r: dataclasses.replace(w, efficiency=efficiency) for r, w in wires.items()}
    here = Machines(shared_cores=cores)
    rows, checks = [], {}
    for rate, name, workers, shards, m, tries, side in measured:
        c, point = costs[name], dict(workers=workers, shards=shards, model_bytes=4 * keys * n,
                                     key_bytes=4 * n)
        p = step_time(c, wires[rate], here, **point)
        beside = step_time(side.costs(), side.wire(wires[rate]), here, **point)
        ratio = m.step_s / p.seconds
        row = {"rate": rate, "scheme": SCHEMES[name].scheme.name, "workers": workers,
               "shards": shards, "measured_ms": m.step_s * 1e3, "mean_ms": m.mean_s * 1e3,
               "predicted_ms": p.seconds * 1e3, "ratio": ratio, "bottleneck": p.bottleneck,
               "encode_ms": m.encode_s * 1e3, "machine_cpu_ms": m.machine_cpu_s * 1e3,
               "other_cpu_ms": m.other_cpu_s * 1e3, "tries": tries,
               "predicted_cpu_ms": 1e3 * (p.terms["machine CPU"] * here.shared_cores
                                          + workers * c.encode * 4 * keys * n),
               "beside_predicted_ms": beside.seconds * 1e3 if side.measured else None,
               "beside_ratio": m.step_s / beside.seconds if side.measured else None,
               "drift": side.drift(wires[rate]), "spread": side.spread(),
               "beside": side.figures,
               "worker_cpu_ms": [round(c * 1e3, 1) for c in m.worker_cpu_s],
               "shard_cpu_ms": [round(c * 1e3, 1) for c in m.shard_cpu_s],
               "terms_ms": {k: round(v * 1e3, 2) for k, v in p.terms.items()}}
        rows.append(row)
        checks[f"{rate} {row['scheme']} {workers}x{shards} within "
               f"{cfg.tolerance:.0%}"] = check(round(ratio, 3), f"{1 - cfg.tolerance:g} .. "
                                                f"{1 + cfg.tolerance:g}",
                                                abs(ratio - 1) <= cfg.tolerance)
    spread = spread_summary([r["spread"] for r in rows], cfg.tolerance)
    if spread is not None:
        spread["beside_within_tolerance"] = sum(abs(r["beside_ratio"] - 1) <= cfg.tolerance
                                                for r in rows if r["beside_ratio"] is not None)
    machines = Machines(shard_cores=cfg.shard_cores, core_bandwidth=bandwidth,
                        machine_bandwidth=cfg.shard_memory_gbps * 1e9)
    # one flow's efficiency: how 64 flows into a port fare is the switch's buffers' and the
    # congestion control's, not this emulation's tbf queue
    fastest = min(wires.values(), key=lambda w: w.round_trip)
    fastest = dataclasses.replace(fastest, efficiency={1: efficiency[min(efficiency)]})
    extrapolation = [row for key_bytes, c in big.items()
                     for row in _extrapolate(cfg, c, fastest, machines, key_bytes=key_bytes)]
    config = {**dataclasses.asdict(cfg), "keys": keys, "key_elements": n,
              "machine_busy_before": busy, "memcpy_gbps": bandwidth / 1e9,
              "memory_contention": contention,
              "links": links, "wires": {r: dataclasses.asdict(w) for r, w in wires.items()},
              "costs": {k: dataclasses.asdict(c) for k, c in costs.items()},
              "cost_figures_ms": figures,
              "beside": spread,
              "per_message_in_process_us": {"shard_handle": handle_s * 1e6,
                                            "worker_thread": thread_s * 1e6},
              "extrapolation": extrapolation, "seconds": round(time.monotonic() - t0, 1)}
    _, md = write_results("scale", config=config, rows=rows, checks=checks, out=out,
                          columns=_COLUMNS,
                          notes=_notes(cfg, busy, links, wires, bandwidth, contention, spread,
                                       len(rows)))
    with md.open("a") as f:
        f.write(_extrapolation_md(cfg, extrapolation))
    return {"rows": rows, "checks": checks}


def _quiet_point(cfg: ScaleBench, cluster, scheme, **point) -> tuple[Measured, int]:
    """A measured point (``measure_point``), measured again while other work used more than
    ``cfg.quiet`` of a core during it, up to ``cfg.tries`` times; the quietest, and how many
    times it was measured."""
    best = None
    for attempt in range(1, cfg.tries + 1):
        m = measure_point(cluster, scheme, steps=cfg.steps, warmup=cfg.warmup, **point)
        if best is None or m.other_cpu_s / m.step_s < best.other_cpu_s / best.step_s:
            best = m
        if m.other_cpu_s <= cfg.quiet * m.step_s:
            return m, attempt
    return best, cfg.tries


def _memory(elements: int, cores: int, rounds: int) -> tuple[float, float]:
    """This machine's memory bandwidth, read + written bytes per second (``np.copyto`` of the
    key set, as ``bitps-bench kernels`` measures it), and how much longer ``cores`` such
    copies take at once, on threads started together (numpy copies without the GIL), than
    one alone: the medians of ``rounds``."""
    srcs = [np.ones(elements, np.float32) for _ in range(max(1, cores))]
    dsts = [np.empty_like(x) for x in srcs]
    times: dict[int, float] = {}

    def copy(i: int, start: threading.Barrier | None = None) -> None:
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        np.copyto(dsts[i], srcs[i])
        times[i] = time.perf_counter() - t0

    copy(0)
    solo, together = [], []
    for _ in range(max(3, rounds)):
        copy(0)
        solo.append(times[0])
        start = threading.Barrier(len(srcs))
        threads = [threading.Thread(target=copy, args=(i, start)) for i in range(len(srcs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together.append(max(times.values()))
    return 2 * srcs[0].nbytes / median(solo), max(1.0, median(together) / median(solo))


def _extrapolate(cfg: ScaleBench, costs, wire: WireCosts, big: Machines, *,
                 key_bytes: int) -> list[dict]:
    """Per scheme and link rate: the predicted step of ``big_workers`` workers at each shard
    count, and the fewest shards that keep up with ``compute_s``."""
    out, model_bytes = [], 4 * cfg.params
    for name, c in costs.items():
        for gbps in cfg.link_gbps:
            w = dataclasses.replace(wire, rate_bps=gbps * 1e9)
            steps = {}
            for s in range(1, cfg.max_shards + 1):
                p = step_time(c, w, big, workers=cfg.big_workers, shards=s,
                              model_bytes=model_bytes, key_bytes=key_bytes)
                steps[s] = {"step_s": p.seconds, "bottleneck": p.bottleneck,
                            "terms_s": {k: round(v, 4) for k, v in p.terms.items()}}
            need = shards_needed(c, w, big, workers=cfg.big_workers, model_bytes=model_bytes,
                                 key_bytes=key_bytes, compute_s=cfg.compute_s)
            at_need = None if need is None else step_time(
                c, w, big, workers=cfg.big_workers, shards=need, model_bytes=model_bytes,
                key_bytes=key_bytes)
            out.append({"scheme": SCHEMES[name].scheme.name, "key_mib": key_bytes / 2**20,
                        "link_gbps": gbps,
                        "shards_needed": need,
                        "step_s_at_needed": None if at_need is None else at_need.seconds,
                        "bottleneck_at_needed": None if at_need is None
                        else at_need.bottleneck, "by_shards": steps})
    return out


def _extrapolation_md(cfg: ScaleBench, rows: list[dict]) -> str:
    shown = [s for s in SHOWN_SHARDS if s <= cfg.max_shards]
    lines = ["", f"## Extrapolation: {cfg.big_workers} workers, {cfg.params / 1e9:g} B "
             f"parameters", "",
             f"Every worker and shard on a machine of its own; a shard machine's update on "
             f"{cfg.shard_cores} cores, sped up at most by {cfg.shard_memory_gbps:g} GB/s of "
             f"memory bandwidth over one core's (measured here). Step: the exchange alone "
             f"(no compute), seconds. Shards needed: the fewest whose NICs and update take at "
             f"most {cfg.compute_s:g} s, the compute per step an overlapped exchange hides "
             f"('-': a worker's own NIC or more than 4096 shards).", "",
             "| scheme | key MiB | link Gbit/s | shards needed | step s at needed | "
             "bottleneck there | " + " | ".join(f"step s, {s} shards" for s in shown) + " |",
             "|" + "---|" * (6 + len(shown))]
    for r in rows:
        need = "-" if r["shards_needed"] is None else str(r["shards_needed"])
        at = "" if r["step_s_at_needed"] is None else f"{r['step_s_at_needed']:.3g}"
        steps = [f"{r['by_shards'][s]['step_s']:.3g}" for s in shown]
        lines.append(f"| {r['scheme']} | {r['key_mib']:g} | {r['link_gbps']:g} | {need} | {at} | "
                     f"{r['bottleneck_at_needed'] or ''} | " + " | ".join(steps) + " |")
    return "\n".join(lines) + "\n"


def _notes(cfg: ScaleBench, busy: float, links: dict, wires: dict[str, WireCosts],
           bandwidth: float, contention: float, spread: dict | None, points: int) -> str:
    beside = "" if spread is None else (
        f" Costs beside each point ({cfg.side_rounds} rounds just before it and just after "
        f"it; bench/scale_beside.py): across one point they moved by a median factor of "
        f"{spread['median_factor']:.2f} (largest {spread['largest_factor']:.2f}), by more than "
        f"{cfg.tolerance:.0%} at {spread['beyond_tolerance']:.0%} of the points; predicted from "
        f"them, {spread['beside_within_tolerance']} of {points} points are within "
        f"{cfg.tolerance:.0%} (the checks use the costs measured at the start).")
    wire = "; ".join(
        f"{rate}: {links[rate]['kind']}, payload "
        + ", ".join(f"{e:.3f}" for e in w.efficiency.values())
        + f" of the rate with {', '.join(map(str, w.efficiency))} flows into a port, "
        + ", ".join(f"{c * 1e9:.2f}" for c in w.cpu_per_byte.values())
        + " ns CPU per byte crossing in messages of "
        f"{', '.join(str(size) for size in w.cpu_per_byte)} bytes, round trip "
        f"{w.round_trip * 1e6:.0f} us, {w.message_cpu * 1e6:.0f} us CPU per message "
        f"(shard {w.shard_message_cpu * 1e6:.0f}, worker {w.worker_message_cpu * 1e6:.0f})"
        for rate, w in wires.items())
    return (f"Measured points: sync, {cfg.mib} MiB of float32 keys of {cfg.key_kib} KiB per "
            f"worker per step (push_pull, no compute), shards and workers each on a node of "
            f"their own, {cfg.steps - cfg.warmup} timed steps after {cfg.warmup}; every "
            f"process shares this machine's {os.cpu_count()} cores. Predicted: "
            f"bench/scale_model.py step_time from the costs measured in this run (JSON "
            f"config: costs, wires, cost_figures_ms). Wire: {wire}. memcpy "
            f"{bandwidth / 1e9:.1f} GB/s; {os.cpu_count()} copies at once take "
            f"{contention:.2f}x one's time. machine CPU ms: every core's busy time per step "
            f"(/proc/stat), beside the model's; other CPU ms: the machine's less this point's "
            f"processes' (other work; a point with more than {cfg.quiet:.0%} of a core of it "
            f"was measured again, up to {cfg.tries} times, the quietest kept). Machine busy "
            f"before the run: {busy:.0%}.{beside}")
