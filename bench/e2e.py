"""``bitps-bench e2e``: does a team's job finish sooner? bitps against DDP on an emulated cluster,
time to a target loss.

The cluster (``bench.cluster``): one network namespace per node on a bridge, every link shaped
with ``tc tbf`` (``--rate``, 1 Gbit/s by default; unshaped loopback, reported, where namespaces
cannot be made). Two worker nodes; with ``--placement colocated`` (default) a shard runs beside
each worker, so half of each worker's traffic crosses its link, as a ring all-reduce's would;
with ``own`` the shards run on nodes of their own.

Every run trains the same model from the same seed on the same batches (the demo corpus, each
rank its own stream) with the same global batch, learning-rate schedule (linear warm-up, then
cosine) and gradient clipping:

- peers: compute-only (one process, no exchange), the no-traffic ceiling (both workers
  computing, no exchange), DDP over gloo in fp32, with a bf16 hook (``bench.e2e_rank.
  bf16_hook``: DDP's own refuses CPU tensors) and with PowerSGD rank 1 (one bucket: with
  several its hook desynchronizes gloo);
- bitps: sync fp32 Adam, async fp32 Adam, async and ssp with sign1 pushes, 1-bit Adam (sync
  and async), sparse pushes.

Each learning run's learning rate is the best of a sweep (``--lrs``, at ``--sweep-steps``),
recorded with every point. Per run: samples/s, step time, exposed communication per step, bytes
on the wire per step (bridge-port counters: sent + received per worker node), CPU seconds per
step of every process, the loss curve, time and samples to the target loss (the DDP fp32 run's
final loss), final loss at equal samples and at equal wall time. ``--straggler`` makes worker 1
1.5x slower (sync against ssp, async and DiLoCo); an async run then splits the samples by the
ranks' speeds (:func:`rank_steps`), a run of batches by speed (``Case.balance``) splits each
step's global batch, the same samples every other run takes at that step, by the speeds the
ranks measure (``BatchBalance``), and curves merge the ranks' steps (``_curve``). The report
and its checks are ``bench.e2e_report``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bitps.bench.cluster import Cluster, emulated_cluster
from bitps.bench.config import E2EBench
from bitps.bench.e2e_floor import busiest_direction
from bitps.bench.e2e_report import CEILING, RECOMMENDED, final_loss, report
from bitps.bench.models import MODELS
from bitps.bench.proc import ReadyProcess, machine_busy, process_cpu
from bitps.bench.ranks import Ranks
from bitps.bench.spy import Spy, executable, top_consumers

__all__ = ["CASES", "Case", "run"]


@dataclass(frozen=True, kw_only=True)
class Case:
    """One configuration of the bench."""

    name: str
    kind: str
    """``local`` (no exchange), ``ddp`` or ``bitps``."""
    workers: int = 2
    hook: str = "none"
    """DDP: ``none`` (fp32), ``bf16`` or ``powersgd``."""
    mode: str = "sync"
    optimizer: str = "adam"
    push_codec: str = "raw"
    compress_min_bytes: int = 1 << 20
    """The default 1 MiB rule: tensors under it go uncompressed."""
    shard_args: tuple[str, ...] = ()
    learns: bool = True
    """False for compute-only and the ceiling: speed only, no sweep, no target."""
    freeze_frac: float | None = None
    """1-bit Adam: this run's warm-up share of the steps (``None``: ``--freeze-frac``)."""
    lr_of: str | None = None
    """Run at the learning rate that case's sweep chose, with no sweep of its own (a user's
    lr kept unchanged); that case runs first."""
    inner_steps: int = 0
    """DiLoCo (``LocalSGD``) with this many inner steps per round; 0: not local SGD. The
    swept lr is then the inner AdamW's, and the shards run ``optimizer`` as the outer rule
    at ``OUTER_LR`` (momentum 0.9, no schedule)."""
    adaptive: bool = False
    """DiLoCo: each round's inner steps from measured speed (DyLU)."""
    balance: bool = False
    """Batch balancing (``worker.algorithms.balance``): each step the global batch (workers x
    batch) split over the ranks by their measured speed, each rank's loss weighted by its
    share."""
    hold_when_clipping: str = "sync"
    """``OverlapConfig.hold_when_clipping``: where a step after a clipped one goes whole, with
    its exact clip factor (``sync``: sync jobs; ``on``; ``off``: from backward's hooks with a
    predicted factor)."""


CASES = (
    Case(name="compute-only", kind="local", workers=1, learns=False),
    Case(name="ceiling (no traffic)", kind="local", learns=False),
    Case(name="DDP fp32", kind="ddp"),
    Case(name="DDP bf16", kind="ddp", hook="bf16"),
    Case(name="DDP PowerSGD r1", kind="ddp", hook="powersgd"),
    Case(name="bitps sync fp32", kind="bitps"),
    Case(name="bitps async fp32", kind="bitps", mode="async"),
    Case(name="bitps async sign1", kind="bitps", mode="async", push_codec="sign1"),
    Case(name="bitps ssp sign1", kind="bitps", mode="ssp", push_codec="sign1"),
    Case(name="bitps sync sparse", kind="bitps", push_codec="sparse"),
    Case(name="bitps sync 1-bit Adam", kind="bitps", optimizer="onebit_adam"),
    Case(name="bitps async 1-bit Adam", kind="bitps", mode="async", optimizer="onebit_adam"),
    Case(name="bitps ssp 1-bit Adam", kind="bitps", mode="ssp", optimizer="onebit_adam"),
    # the state each worker fetches at the switch as m's sign1 code and the shard's bf16
    # denominators (2.1 B per element, onebit_compact_state), not float32 m and v (8 B)
    Case(name="bitps sync 1-bit Adam, compact switch state", kind="bitps",
         optimizer="onebit_adam", shard_args=("--onebit-compact-state",)),
    # and the warmup's pulls as bf16 codes of the Adam updates (--onebit-warmup-codec bf16),
    # not float32 parameters: 2 bytes per element pulled in the warmup instead of 4
    Case(name="bitps sync 1-bit Adam, bf16 warm-up codes, compact switch state", kind="bitps",
         optimizer="onebit_adam", shard_args=("--onebit-warmup-codes", "--onebit-warmup-codec",
                                              "bf16", "--onebit-compact-state")),
    Case(name="bitps ssp 1-bit Adam, bf16 warm-up codes", kind="bitps", mode="ssp",
         optimizer="onebit_adam",
         shard_args=("--onebit-warmup-codes", "--onebit-warmup-codec", "bf16")),
    # the clip hold's default measured against its absence: sync without it (every step's
    # buckets pushed from the hooks with a predicted clip factor corrected one step late, as
    # before 2026-12-06), async with it (the default holds sync jobs only)
    Case(name="bitps sync 1-bit Adam, no clip hold", kind="bitps", optimizer="onebit_adam",
         hold_when_clipping="off"),
    Case(name="bitps async 1-bit Adam, clip hold", kind="bitps", mode="async",
         optimizer="onebit_adam", hold_when_clipping="on"),
    # float32 pushes clipped as DDP clips (since 2026-12-06), with the hold (the default holds
    # compressed sync pushes only: held, float32 runs lose the overlap that pays most for them)
    Case(name="bitps sync fp32, clip hold", kind="bitps", hold_when_clipping="on"),
    # the recommended compressed bounded configuration (docs/algorithms.md), tried as a user
    # would: DDP fp32's learning rate and schedule, not retuned
    Case(name=RECOMMENDED, kind="bitps", mode="ssp", optimizer="onebit_adam", lr_of="DDP fp32"),
    # both directions compressed from the first step (--onebit-warmup-codes), a short warm-up
    Case(name="bitps sync 1-bit Adam, coded 5% warm-up", kind="bitps", optimizer="onebit_adam",
         freeze_frac=0.05, shard_args=("--onebit-warmup-codes",)),
    # and every key compressed, 2048 elements per scale (1.016 bits per element)
    Case(name="bitps sync 1-bit Adam, lean 5% warm-up", kind="bitps", optimizer="onebit_adam",
         freeze_frac=0.05, compress_min_bytes=0,
         shard_args=("--onebit-warmup-codes", "--onebit-chunk", "2048")),
    Case(name="bitps sync 1-bit Adam, lean 3% warm-up", kind="bitps", optimizer="onebit_adam",
         freeze_frac=0.03, compress_min_bytes=0,
         shard_args=("--onebit-warmup-codes", "--onebit-chunk", "2048")),
)
OUTER_LR = 0.7  # DiLoCo's outer Nesterov lr (Douillard et al. 2023), as bitps-launch's preset
# a persistent straggler: what bounded staleness can and cannot buy (the straggler default)
STRAGGLER_CASES = (
    Case(name="bitps ssp sign1 S=8", kind="bitps", mode="ssp", push_codec="sign1",
         shard_args=("--staleness", "8")),
    # the staleness compensations (ps/compensation.py), each on a bounded run it could help
    Case(name="bitps async fp32, DC-ASGD", kind="bitps", mode="async",
         shard_args=("--compensation", "dc_asgd")),
    Case(name="bitps ssp 1-bit Adam, damping", kind="bitps", mode="ssp",
         optimizer="onebit_adam", shard_args=("--compensation", "damping")),
    # batch balancing (worker.algorithms.balance): the global batch split by the ranks'
    # measured speeds, so the slow rank's share takes its compute about as long as the fast
    # one's and the clocks advance together; sync too, to tell the split from the staleness
    Case(name="bitps ssp 1-bit Adam, batch by speed", kind="bitps", mode="ssp",
         optimizer="onebit_adam", balance=True),
    Case(name="bitps sync 1-bit Adam, batch by speed", kind="bitps", optimizer="onebit_adam",
         balance=True),
    # the schedule read at the job's progress, not each push's clock (--lr-by progress): under
    # the time budget the fast rank's pushes no longer reach the schedule's floor early while
    # the slow one's stop at 0.19x the peak
    Case(name="bitps async 1-bit Adam, lr by progress", kind="bitps", mode="async",
         optimizer="onebit_adam", shard_args=("--lr-by", "progress")),
    # DiLoCo: sync rounds wait for the straggler; async ones (delayed Nesterov, inner steps
    # sized by speed: Liu et al. 2024) do not. Raw pseudo-gradients, as both papers: with
    # sign1 ones async DiLoCo with DyLU ended at 3.48-3.56 where raw ended at 2.80-2.83
    # (docs/benchmarks.md), and one exchange per H steps leaves little traffic to save
    Case(name="bitps sync DiLoCo H=5", kind="bitps", optimizer="nesterov", inner_steps=5,
         shard_args=("--momentum", "0.9")),
    Case(name="bitps async DiLoCo H=5, DyLU", kind="bitps", mode="async",
         optimizer="delayed_nesterov", inner_steps=5, adaptive=True,
         shard_args=("--momentum", "0.9")),
)
STRAGGLER_DEFAULT = ("ceiling (no traffic)", "DDP fp32", "bitps sync fp32",
                     "bitps sync 1-bit Adam", "bitps ssp sign1", "bitps ssp sign1 S=8",
                     "bitps ssp 1-bit Adam", "bitps async sign1", "bitps async 1-bit Adam",
                     "bitps async fp32, DC-ASGD", "bitps ssp 1-bit Adam, damping",
                     "bitps async 1-bit Adam, lr by progress",
                     "bitps ssp 1-bit Adam, batch by speed",
                     "bitps sync 1-bit Adam, batch by speed",
                     "bitps sync DiLoCo H=5", "bitps async DiLoCo H=5, DyLU")


def _schedule(steps: int, s: E2EBench) -> dict:
    warm = round(steps * s.warmup_frac)
    return {"warmup_steps": warm, "decay_steps": steps, "min_ratio": 0.1}


def _shard_nodes(cluster: Cluster, case: Case, s: E2EBench) -> tuple:
    """A shard beside each worker (colocated), or on nodes of their own."""
    n = case.workers
    return cluster.nodes[:n] if s.placement == "colocated" else cluster.nodes[n:2 * n]


def _shards(cluster: Cluster, case: Case, s: E2EBench, lr: float, steps: int
            ) -> list[ReadyProcess]:
    sched = _schedule(steps, s)
    if case.inner_steps:  # the shards run DiLoCo's outer rule; lr is the inner optimizer's
        lr, sched = OUTER_LR, {"warmup_steps": 0, "decay_steps": 0, "min_ratio": 0.0}
    n, out = case.workers, []
    for i, node in enumerate(_shard_nodes(cluster, case, s)):
        argv = [*node.prefix, sys.executable, "-m", "bitps.ps", "--host", node.ip,
                "--grpc-port", "0",
                "--data-port", "0", "--metrics-port", "-1", "--shard-id", str(i),
                # every emulated node shares this machine's cores: one thread per shard
                "--threads", "1",
                "--num-shards", str(n), "--mode", case.mode, "--optimizer", case.optimizer,
                "--lr", str(lr), "--lr-warmup", str(sched["warmup_steps"]),
                "--lr-decay", str(sched["decay_steps"]),
                "--lr-min-ratio", str(sched["min_ratio"]), "--log-level", "WARNING",
                "--freeze-step", str(_freeze_at(case, s, steps)),
                *case.shard_args]
        try:
            out.append(ReadyProcess(argv))
        except Exception:
            for p in out:
                p.stop()
            raise
    return out


def rank_steps(case: Case, s: E2EBench, steps: int, speeds: list[float] | None) -> list[int]:
    """Each rank's steps in a run of ``steps``: ``steps`` each, except an async run under
    ``--straggler``, which splits the same samples (``workers x steps``) by the ranks'
    ``speeds`` (steps/s, the ceiling's in the same run), so that its ranks stop together
    instead of the fast one idling while the slow one finishes: the time budget a sync run
    spends on the same samples. ``ssp`` keeps equal steps (its bound holds the fast rank to
    the slow one's pace anyway)."""
    n = case.workers
    if not (s.straggler and case.kind == "bitps" and case.mode == "async"):
        return [steps] * n
    if speeds is None or len(speeds) != n or min(speeds) <= 0:
        raise ValueError(f"{case.name}: splitting {n} x {steps} steps by speed needs the "
                         f"ceiling's {n} rank speeds, got {speeds}; run the ceiling first")
    total = sum(speeds)
    return [max(1, round(n * steps * v / total)) for v in speeds]


def _train(cluster: Cluster, case: Case, s: E2EBench, lr: float, steps: int, tmp: Path,
           port: int, speeds: list[float] | None = None) -> dict:
    """One run: start shards (bitps) and ranks, collect per-step lines and counters."""
    counts = rank_steps(case, s, steps, speeds)
    freeze = _freeze_step(case, s, steps)
    shards = _shards(cluster, case, s, lr, steps) if case.kind == "bitps" else []
    ranks, logs = Ranks(), []
    # --profile: py-spy on each rank, and on each shard from rank 0's line, once the steady
    # phase begins (1-bit Adam: the step after the switch; else after the warm-up steps
    # _measure skips). Rank 0's step lines also mark each shard's CPU, split by phase later.
    spies: dict[int | str, Spy | BaseException] = {}
    spy_from = freeze if freeze is not None else 2
    shard_marks: dict[int, list[float]] = {}

    def start_spy(name: int | str, pid: int) -> None:
        try:
            spies[name] = Spy(pid, tmp / f"{name}.spy")
        except Exception as exc:
            spies[name] = exc

    def on_line(rank: int):
        # a rank with no step after spy_from has nothing to profile
        profiled = s.profile and case.learns and counts[rank] > spy_from + 1

        def seen(proc, line) -> None:  # on the rank's reader thread: errors kept, raised
            if line.get("event") != "step":
                return
            if rank == 0 and shards:
                shard_marks[line["step"]] = [process_cpu(p.proc.pid) for p in shards]
            if profiled and line["step"] == spy_from:
                start_spy(rank, proc.pid)
                for i, p in enumerate(shards if rank == 0 else ()):
                    start_spy(f"shard{i}", p.proc.pid)
        return seen if profiled or (rank == 0 and shards) else None

    wire0 = cluster.wire_bytes()
    try:
        servers = [f"{node.ip}:{p.ready['grpc_port']}"
                   for node, p in zip(_shard_nodes(cluster, case, s), shards)]
        for r in range(case.workers):
            node = cluster.nodes[r]
            settings = {
                "kind": case.kind, "model": s.model, "seed": s.seed, "rank": r,
                "world": case.workers, "steps": counts[r], "lr": lr,
                "clip_norm": s.clip_norm,
                # the rank's own schedule (DDP, DiLoCo's inner one) over its own steps
                "schedule": _schedule(counts[r], s), "device": s.device,
                "slow": 1.5 if s.straggler and r == 1 else 1.0,
                "ddp": {"master": cluster.nodes[0].ip, "port": port, "hook": case.hook,
                        "ifname": "eth0" if cluster.kind == "netns" else "lo",
                        "powersgd_start": s.powersgd_start},
                "bitps": {"servers": servers, "push_codec": case.push_codec,
                          "compress_min_bytes": case.compress_min_bytes, "overlap": "auto",
                          "hold_when_clipping": case.hold_when_clipping,
                          "balance": case.balance,
                          "local_sgd": ({"inner_steps": case.inner_steps,
                                         "adaptive": case.adaptive}
                                        if case.inner_steps else None)}}
            log = tmp / f"rank{r}.log"
            logs.append(log)
            ranks.start([*node.prefix, sys.executable, "-m", "bitps.bench.e2e_rank",
                         json.dumps(settings)], log, on_line(r))
        ranks.wait(timeout=120 + max(counts) * 20, logs=logs)
        shard_cpu = [process_cpu(p.proc.pid) for p in shards]
        profiles = [_profile(spies[r], counts[0 if isinstance(r, str) else r] - spy_from - 1,
                             ends=isinstance(r, int))
                    | ({"shard": int(r[5:])} if isinstance(r, str) else {"rank": r})
                    | {"from": spy_from} for r in sorted(spies, key=_spy_order)]
    finally:
        ranks.kill()
        for p in shards:
            p.stop()
    wire1 = cluster.wire_bytes()
    out = _measure(case, s, ranks.lines, shard_cpu, counts, freeze,
                   {k: wire1[k] - wire0.get(k, 0) for k in wire1}, shard_marks)
    return {**out, "profile": profiles} if profiles else out


def _spy_order(name: int | str) -> tuple[bool, int]:
    """Ranks (ints) first, then shards (``"shard<i>"``), each by number."""
    return (True, int(name[5:])) if isinstance(name, str) else (False, name)


def _profile(spy: Spy | BaseException, steps: int, *, ends: bool) -> dict:
    """A rank's or shard's top CPU consumers per step (``bench.spy``) over its ``steps``
    recorded; ``ends``: the process has ended (a rank), else its recording is stopped."""
    if isinstance(spy, BaseException):
        raise RuntimeError(f"--profile: py-spy did not start: {spy}") from spy
    return top_consumers(spy.wait() if ends else spy.stop(), rate=spy.rate, steps=steps)


def _freeze_at(case: Case, s: E2EBench, steps: int) -> int:
    """1-bit Adam's ``--freeze-step`` for a run of ``steps``."""
    return max(1, round(steps * (case.freeze_frac or s.freeze_frac)))


def _freeze_step(case: Case, s: E2EBench, steps: int) -> int | None:
    """The step 1-bit Adam's compressed phase starts at (``None``: no phases)."""
    return _freeze_at(case, s, steps) if case.optimizer == "onebit_adam" else None


def _phases(per_rank: list[list[dict]], skip: int, freeze: int | None,
            shard_marks: dict[int, list[float]] | None = None) -> dict | None:
    """Step time (the slowest rank's mean), each rank's CPU per step and each shard's (from
    ``shard_marks``: step -> each shard's CPU seconds when rank 0 logged that step) in 1-bit
    Adam's warm-up (steps ``skip .. freeze - 1``) and compressed phase (``freeze + 1 ..``;
    the switch's own step fetches the moments): the averages over the whole run hide which
    phase costs what. ``None`` without phases or when a phase has under 2 steps."""
    steps = min(len(p) for p in per_rank)
    if freeze is None or freeze - skip < 2 or steps - freeze - 1 < 2:
        return None
    out = {}
    for name, lo, hi in (("warmup", skip, freeze - 1), ("compressed", freeze + 1, steps - 1)):
        n = hi - lo
        out[name] = {
            "steps": n,
            "step_ms": 1e3 * max((p[hi]["end"] - p[lo]["end"]) / n for p in per_rank),
            "rank_cpu_ms": [round(1e3 * (p[hi]["cpu"] - p[lo]["cpu"]) / n, 1)
                            for p in per_rank]}
        if shard_marks and lo in shard_marks and hi in shard_marks:
            out[name]["shard_cpu_ms"] = [round(1e3 * (b - a) / n, 1) for a, b in
                                         zip(shard_marks[lo], shard_marks[hi])]
    return out


def _curve(per_rank: list[list[dict]], merged: bool, batch: int
           ) -> tuple[np.ndarray, np.ndarray, int]:
    """The run's loss curve, the wall time of each point (from the first step's start) and
    the points one step makes: the mean over ranks of each step, done when its slowest rank
    is; or (``merged``) every rank's steps in the order they ended, W points a step, which
    ranks of different step counts need (``bench.e2e_report`` scales its windows by it).

    Ranks whose steps take shares of a global batch (batch by speed) count by their samples:
    a step's mean is over its samples, and a merged point is its rank's loss times its share
    over ``batch``, so that a window of whole steps averages to the samples' mean."""
    epoch = min(p[0]["start"] for p in per_rank)
    if not merged:
        n = np.array([[e.get("samples", batch) for e in p] for p in per_rank], dtype=float)
        loss = (np.array([[e["loss"] for e in p] for p in per_rank]) * n).sum(0) / n.sum(0)
        t = np.max([[e["end"] - epoch for e in p] for p in per_rank], axis=0)
        return loss, t, 1
    points = sorted((e["end"] - epoch, e["loss"] * e.get("samples", batch) / batch)
                    for p in per_rank for e in p)
    return (np.array([v for _, v in points]), np.array([t for t, _ in points]),
            len(per_rank))


def _measure(case: Case, s: E2EBench, lines: list[list[dict]], shard_cpu: list[float],
             counts: list[int], freeze: int | None, wire: dict[int, int],
             shard_marks: dict[int, list[float]] | None = None) -> dict:
    spec = MODELS[s.model]
    per_rank = [[e for e in ls if e["event"] == "step"] for ls in lines]
    done = [next(e for e in ls if e["event"] == "done") for ls in lines]
    if [len(p) for p in per_rank] != counts:
        raise RuntimeError(f"{case.name}: ranks logged {[len(p) for p in per_rank]} steps, "
                           f"expected {counts}")
    loss, t, per_step = _curve(per_rank, merged=s.straggler, batch=spec.batch)
    steps = sum(counts) / len(counts)  # per rank, on average: what "per step" divides by
    # the first steps build buffers, traces and connections; a local-SGD run's first
    # exchange (step H - 1) is the first the shards see, which compile their kernels then
    skip = min(max(3, case.inner_steps), min(counts) // 4)
    rates = [(len(p) - 1 - skip) / (p[-1]["end"] - p[skip]["end"]) for p in per_rank]
    # a rank's samples a step: the batch, or its share of the global batch (batch by speed)
    samples_per_s = sum(sum(e.get("samples", spec.batch) for e in p[skip + 1:])
                        / (p[-1]["end"] - p[skip]["end"]) for p in per_rank)
    step_s = 1.0 / min(rates)
    # each step's time (its slowest rank's: the curve's wall times), the lower quartile: the
    # compute a step can take without traffic, less this machine's step-to-step noise
    # (bench.e2e_floor's floors); merged curves (straggler) have no such time a step
    step_s_low = float(np.percentile(np.diff(t[skip:]), 25)) if per_step == 1 else step_s
    worker_nodes = [wire[i] for i in range(case.workers) if i in wire]
    return {
        "loss": loss.tolist(), "time": t.tolist(), "points_per_step": per_step,
        "rank_steps": counts, "rank_rates": rates, "step_s": step_s, "step_s_low": step_s_low,
        "rank_samples": [sum(e.get("samples", spec.batch) for e in p) for p in per_rank],
        "samples_per_s": samples_per_s,
        "exposed_s": exposed_per_step(per_rank, skip, local=case.inner_steps > 1),
        "wire_bytes_per_step": (float(np.mean(worker_nodes)) / steps if worker_nodes
                                else None),
        "push_wire_bytes_per_step": float(np.mean([d["push_wire_bytes"] for d in done])) / steps,
        "rank_cpu_s_per_step": [d["cpu_s"] / n for d, n in zip(done, counts)],
        "rank_faults_per_step": [d["minor_faults"] / n for d, n in zip(done, counts)],
        "rank_max_rss_mib": [d["max_rss_mib"] for d in done],
        "shard_cpu_s_per_step": [c / steps for c in shard_cpu],
        "overlap": [d.get("overlap") for d in done],
        "held_steps": [d.get("held_steps") for d in done],
        "phases": _phases(per_rank, skip, freeze, shard_marks),
        "link_steps": _link_steps(per_rank, skip, colocated=s.placement == "colocated"),
    }


def _link_steps(per_rank: list[list[dict]], skip: int, *, colocated: bool
                ) -> list[tuple[bool, float]] | None:
    """Each step after ``skip`` (the steps samples/s counts): whether any rank pushed it
    serially, and its busiest link direction's payload bytes (``bench.e2e_floor``); ``None``
    where the ranks logged no traffic (DDP, local SGD) or different step counts."""
    if len({len(p) for p in per_rank}) != 1 or \
            any("push_bytes" not in e for p in per_rank for e in p):
        return None
    return [(any(p[i]["serial"] for p in per_rank),
             busiest_direction([p[i]["push_bytes"] for p in per_rank],
                               [p[i]["pull_bytes"] for p in per_rank], colocated=colocated))
            for i in range(skip + 1, len(per_rank[0]))]


def exposed_per_step(per_rank: list[list[dict]], skip: int, *, local: bool) -> float:
    """Exposed communication per step, the ranks' mean, each rank's steps after ``skip``: the
    median step's, or with ``local`` SGD the mean over steps (its exchange blocks one step in
    H, so the median step exposes none)."""
    of = np.mean if local else np.median
    return float(np.mean([of([e["exposed"] for e in p[skip:]]) for p in per_rank]))


def run(cfg: E2EBench | None = None, *, out: Path | None = None) -> dict:
    """Run every case (``cfg.cases``: a subset by name), write ``<cfg.name>.json``/``.md``
    under ``out``; ``cfg.quick``: the demo model, few steps, one learning rate."""
    s = (cfg or E2EBench()).sized()
    chosen = _chosen(s)
    if s.profile and executable() is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy (the bench extra)")
    busy = machine_busy()
    nodes = 2 if s.placement == "colocated" else 4
    results: dict[str, dict] = {}
    # a fresh rendezvous port for every DDP run (a closed one may linger in TIME_WAIT)
    ports = itertools.count(29500 + os.getpid() % 1000 * 20)
    with emulated_cluster(nodes, rate=s.rate) as cluster, \
            tempfile.TemporaryDirectory(prefix="bitps-e2e-") as tmp:
        for i, case in enumerate(chosen):
            run_dir = Path(tmp) / str(i)
            run_dir.mkdir()
            lr = results[case.lr_of]["lr"] if case.lr_of else None
            speeds = results.get(CEILING, {}).get("rank_rates")
            results[case.name] = _case_result(cluster, case, s, run_dir, ports, lr=lr,
                                              speeds=speeds)
        again = None
        if CEILING in results and chosen[-1].name != CEILING:
            # this machine's speed drifts over a long run, and every run's CPU beyond compute
            # is read against the ceiling's: the ceiling once more, last, says how far
            run_dir = Path(tmp) / "again"
            run_dir.mkdir()
            again = _case_result(cluster, next(c for c in chosen if c.name == CEILING), s,
                                 run_dir, ports)
        link_note, link_kind = cluster.note, cluster.kind
        raw_link = _raw_link(cluster) if cluster.kind == "netns" else None
    return report(results, s, busy=busy, link_note=link_note, link_kind=link_kind,
                  raw_link=raw_link, out=out, ceiling_again=again)


def _chosen(s: E2EBench) -> list[Case]:
    """The cases ``s.cases`` names, else every case (with ``s.straggler``, its own set)."""
    every = CASES + STRAGGLER_CASES
    known = {c.name for c in every}
    if unknown := set(s.cases) - known:
        raise ValueError(f"unknown cases {sorted(unknown)}; expected some of {sorted(known)}")
    if s.cases:
        chosen = [c for c in every if c.name in s.cases]
        if lost := [c.name for c in chosen if c.lr_of and c.lr_of not in s.cases]:
            raise ValueError(f"cases {lost} run at another case's lr: choose that case too")
        return chosen
    if s.straggler:
        return [c for c in every if c.name in STRAGGLER_DEFAULT]
    return list(CASES)


def _case_result(cluster: Cluster, case: Case, s: E2EBench, run_dir: Path, ports, *,
                 lr: float | None = None, speeds: list[float] | None = None) -> dict:
    """One case: a learning case at the best learning rate of its sweep (each point recorded)
    or at ``lr`` (no sweep), a speed-only one (compute-only, the ceiling) once. ``speeds``:
    the ranks' steps/s without traffic (``rank_steps``)."""
    if not case.learns:
        return {**_train(cluster, case, s, s.lrs[0], s.steps, run_dir, next(ports)),
                "lr": None, "sweep": {}}
    if lr is not None:
        full = _train(cluster, case, s, lr, s.steps, run_dir, next(ports), speeds)
        print(f"{case.name}: lr {lr:g} (not swept), final {final_loss(full['loss']):.4f}",
              file=sys.stderr)
        return {**full, "lr": lr, "sweep": {}}
    sweep, best = {}, None
    for lr in s.lrs:
        r = _train(cluster, case, s, lr, s.sweep_steps, run_dir, next(ports), speeds)
        sweep[lr] = final_loss(r["loss"])
        print(f"{case.name} lr {lr:g}: loss {sweep[lr]:.4f}", file=sys.stderr)
        if best is None or sweep[lr] < sweep[best[0]]:
            best = (lr, r)
    lr = best[0]
    full = best[1] if s.sweep_steps == s.steps else _train(cluster, case, s, lr, s.steps,
                                                           run_dir, next(ports), speeds)
    print(f"{case.name}: lr {lr:g}, final {final_loss(full['loss']):.4f}, "
          f"{full['samples_per_s']:.2f} samples/s", file=sys.stderr)
    return {**full, "lr": lr, "sweep": {str(k): v for k, v in sweep.items()}}


def _raw_link(cluster: Cluster) -> dict:
    """The limit measured in the same run: one TCP stream node 0 -> node 1, 64 MiB."""
    n0, n1 = cluster.nodes[0], cluster.nodes[1]
    size = 64 << 20
    code = ("import socket,sys,time;s=socket.socket();s.bind((sys.argv[1],5999));s.listen();"
            "c,_=s.accept();n=0;t=None\nwhile True:\n d=c.recv(1<<20)\n if t is None: "
            "t=time.perf_counter()\n if not d: break\n n+=len(d)\n"
            "print(n, time.perf_counter()-t)")
    srv = subprocess.Popen([*n1.prefix, sys.executable, "-c", code, n1.ip],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    subprocess.run([*n0.prefix, sys.executable, "-c",
                    "import socket,sys;s=socket.create_connection((sys.argv[1],5999));"
                    f"s.sendall(b'x'*{size});s.close()", n1.ip], check=True, timeout=120)
    got, seconds = srv.communicate(timeout=120)[0].split()
    return {"bytes": int(got), "seconds": float(seconds),
            "mbit_per_s": int(got) * 8 / float(seconds) / 1e6}
