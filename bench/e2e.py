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
1.5x slower (sync against ssp).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bitps.bench.cluster import Cluster, emulated_cluster
from bitps.bench.config import E2EBench
from bitps.bench.models import MODELS
from bitps.bench.proc import ReadyProcess, machine_busy, process_cpu
from bitps.bench.report import DEFAULT_OUT, check, moving_average, write_results

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


RECOMMENDED = "bitps ssp 1-bit Adam at DDP fp32's lr"
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
# a persistent straggler: what bounded staleness can and cannot buy (the straggler default)
STRAGGLER_CASES = (
    Case(name="bitps ssp sign1 S=8", kind="bitps", mode="ssp", push_codec="sign1",
         shard_args=("--staleness", "8")),
    # the staleness compensations (ps/compensation.py), each on a bounded run it could help
    Case(name="bitps async fp32, DC-ASGD", kind="bitps", mode="async",
         shard_args=("--compensation", "dc_asgd")),
    Case(name="bitps ssp 1-bit Adam, damping", kind="bitps", mode="ssp",
         optimizer="onebit_adam", shard_args=("--compensation", "damping")),
)
STRAGGLER_DEFAULT = ("ceiling (no traffic)", "DDP fp32", "bitps sync fp32",
                     "bitps sync 1-bit Adam", "bitps ssp sign1", "bitps ssp sign1 S=8",
                     "bitps ssp 1-bit Adam", "bitps async sign1", "bitps async 1-bit Adam",
                     "bitps async fp32, DC-ASGD", "bitps ssp 1-bit Adam, damping")
TARGET_RUN = "DDP fp32"
# the best bitps time to target against the best DDP variant's: at most 0.8x on the LM, under
# 1x on the MoE (the MoE's small dense share leaves less traffic to save) and elsewhere
TIME_GOALS = {"lm": 0.8}
SYNC_PAIRS = {"fp32": ("bitps async fp32", "bitps sync fp32")}


def _schedule(steps: int, s: E2EBench) -> dict:
    warm = round(steps * s.warmup_frac)
    return {"warmup_steps": warm, "decay_steps": steps, "min_ratio": 0.1}


class _Ranks:
    """Worker processes of one run, their JSON lines collected by reader threads."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lines: list[list[dict]] = []
        self.errors: list[str] = []

    def start(self, argv: list[str], log: Path) -> None:
        err = log.open("wb")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)
        err.close()
        lines: list[dict] = []
        self.procs.append(proc)
        self.lines.append(lines)

        def read() -> None:
            for raw in proc.stdout:
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    pass

        threading.Thread(target=read, daemon=True).start()

    def wait(self, timeout: float, logs: list[Path]) -> None:
        deadline = time.monotonic() + timeout
        for rank, (proc, log) in enumerate(zip(self.procs, logs)):
            try:
                proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"rank {rank} timed out {self._progress()}; log {log}:\n"
                                   f"{log.read_text()[-3000:]}") from err
            if proc.returncode:
                raise RuntimeError(f"rank {rank} exited {proc.returncode} {self._progress()}; "
                                   f"log {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # let the readers drain

    def _progress(self) -> str:
        steps = [sum(e.get("event") == "step" for e in ls) for ls in self.lines]
        return f"(steps logged per rank: {steps}, exit codes {[p.poll() for p in self.procs]})"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _shard_nodes(cluster: Cluster, case: Case, s: E2EBench) -> tuple:
    """A shard beside each worker (colocated), or on nodes of their own."""
    n = case.workers
    return cluster.nodes[:n] if s.placement == "colocated" else cluster.nodes[n:2 * n]


def _shards(cluster: Cluster, case: Case, s: E2EBench, lr: float, steps: int
            ) -> list[ReadyProcess]:
    sched = _schedule(steps, s)
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


def _train(cluster: Cluster, case: Case, s: E2EBench, lr: float, steps: int, tmp: Path,
           port: int) -> dict:
    """One run: start shards (bitps) and ranks, collect per-step lines and counters."""
    shards = _shards(cluster, case, s, lr, steps) if case.kind == "bitps" else []
    ranks, logs = _Ranks(), []
    wire0 = cluster.wire_bytes()
    try:
        servers = [f"{node.ip}:{p.ready['grpc_port']}"
                   for node, p in zip(_shard_nodes(cluster, case, s), shards)]
        for r in range(case.workers):
            node = cluster.nodes[r]
            settings = {
                "kind": case.kind, "model": s.model, "seed": s.seed, "rank": r,
                "world": case.workers, "steps": steps, "lr": lr, "clip_norm": s.clip_norm,
                "schedule": _schedule(steps, s), "device": s.device,
                "slow": 1.5 if s.straggler and r == 1 else 1.0,
                "ddp": {"master": cluster.nodes[0].ip, "port": port, "hook": case.hook,
                        "ifname": "eth0" if cluster.kind == "netns" else "lo",
                        "powersgd_start": s.powersgd_start},
                "bitps": {"servers": servers, "push_codec": case.push_codec,
                          "compress_min_bytes": case.compress_min_bytes, "overlap": "auto"}}
            log = tmp / f"rank{r}.log"
            logs.append(log)
            ranks.start([*node.prefix, sys.executable, "-m", "bitps.bench.e2e_rank",
                         json.dumps(settings)], log)
        ranks.wait(timeout=120 + steps * 20, logs=logs)
        shard_cpu = [process_cpu(p.proc.pid) for p in shards]
    finally:
        ranks.kill()
        for p in shards:
            p.stop()
    wire1 = cluster.wire_bytes()
    return _measure(case, s, ranks.lines, shard_cpu, steps, _freeze_step(case, s, steps),
                    {k: wire1[k] - wire0.get(k, 0) for k in wire1})


def _freeze_at(case: Case, s: E2EBench, steps: int) -> int:
    """1-bit Adam's ``--freeze-step`` for a run of ``steps``."""
    return max(1, round(steps * (case.freeze_frac or s.freeze_frac)))


def _freeze_step(case: Case, s: E2EBench, steps: int) -> int | None:
    """The step 1-bit Adam's compressed phase starts at (``None``: no phases)."""
    return _freeze_at(case, s, steps) if case.optimizer == "onebit_adam" else None


def _phases(per_rank: list[list[dict]], skip: int, freeze: int | None) -> dict | None:
    """Step time (the slowest rank's mean) and each rank's CPU per step in 1-bit Adam's
    warm-up (steps ``skip .. freeze - 1``) and compressed phase (``freeze + 1 ..``; the
    switch's own step fetches the moments): the averages over the whole run hide which
    phase costs what. ``None`` without phases or when a phase has under 2 steps."""
    steps = len(per_rank[0])
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
    return out


def _measure(case: Case, s: E2EBench, lines: list[list[dict]], shard_cpu: list[float],
             steps: int, freeze: int | None, wire: dict[int, int]) -> dict:
    spec = MODELS[s.model]
    per_rank = [[e for e in ls if e["event"] == "step"] for ls in lines]
    done = [next(e for e in ls if e["event"] == "done") for ls in lines]
    if any(len(p) != steps for p in per_rank):
        raise RuntimeError(f"{case.name}: ranks logged {[len(p) for p in per_rank]} steps, "
                           f"expected {steps}")
    epoch = min(p[0]["start"] for p in per_rank)
    loss = np.mean([[e["loss"] for e in p] for p in per_rank], axis=0)
    # a step is done when its slowest rank is
    t = np.max([[e["end"] - epoch for e in p] for p in per_rank], axis=0)
    skip = min(3, steps // 4)  # the first steps build buffers, traces and connections
    rates = [(steps - 1 - skip) / (p[-1]["end"] - p[skip]["end"]) for p in per_rank]
    samples_per_s = spec.batch * sum(rates)
    step_s = 1.0 / min(rates)
    worker_nodes = [wire[i] for i in range(case.workers) if i in wire]
    return {
        "loss": loss.tolist(), "time": t.tolist(), "step_s": step_s,
        "samples_per_s": samples_per_s,
        "exposed_s": float(np.mean([np.median([e["exposed"] for e in p[skip:]])
                                    for p in per_rank])),
        "wire_bytes_per_step": (float(np.mean(worker_nodes)) / steps if worker_nodes
                                else None),
        "push_wire_bytes_per_step": float(np.mean([d["push_wire_bytes"] for d in done])) / steps,
        "rank_cpu_s_per_step": [d["cpu_s"] / steps for d in done],
        "shard_cpu_s_per_step": [c / steps for c in shard_cpu],
        "overlap": [d.get("overlap") for d in done],
        "phases": _phases(per_rank, skip, freeze),
    }


def _final(loss: list[float]) -> float:
    tail = max(1, len(loss) // 10)
    v = float(np.mean(loss[-tail:]))
    return v if math.isfinite(v) else float("inf")


def run(cfg: E2EBench | None = None, *, out: Path | None = None) -> dict:
    """Run every case (``cfg.cases``: a subset by name), write ``<cfg.name>.json``/``.md``
    under ``out``; ``cfg.quick``: the demo model, few steps, one learning rate."""
    s = (cfg or E2EBench()).sized()
    chosen = _chosen(s)
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
            results[case.name] = _case_result(cluster, case, s, run_dir, ports, lr=lr)
        link_note, link_kind = cluster.note, cluster.kind
        raw_link = _raw_link(cluster) if cluster.kind == "netns" else None
    return _report(results, s, busy=busy, link_note=link_note, link_kind=link_kind,
                   raw_link=raw_link, out=out)


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
                 lr: float | None = None) -> dict:
    """One case: a learning case at the best learning rate of its sweep (each point recorded)
    or at ``lr`` (no sweep), a speed-only one (compute-only, the ceiling) once."""
    if not case.learns:
        return {**_train(cluster, case, s, s.lrs[0], s.steps, run_dir, next(ports)),
                "lr": None, "sweep": {}}
    if lr is not None:
        full = _train(cluster, case, s, lr, s.steps, run_dir, next(ports))
        print(f"{case.name}: lr {lr:g} (not swept), final {_final(full['loss']):.4f}",
              file=sys.stderr)
        return {**full, "lr": lr, "sweep": {}}
    sweep, best = {}, None
    for lr in s.lrs:
        r = _train(cluster, case, s, lr, s.sweep_steps, run_dir, next(ports))
        sweep[lr] = _final(r["loss"])
        print(f"{case.name} lr {lr:g}: loss {sweep[lr]:.4f}", file=sys.stderr)
        if best is None or sweep[lr] < sweep[best[0]]:
            best = (lr, r)
    lr = best[0]
    full = best[1] if s.sweep_steps == s.steps else _train(cluster, case, s, lr, s.steps,
                                                           run_dir, next(ports))
    print(f"{case.name}: lr {lr:g}, final {_final(full['loss']):.4f}, "
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


def _memcpy_gbps() -> float:
    a = np.ones(64 << 18, np.float32)  # 64 MiB
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


_COLUMNS = [("run", "run"), ("lr", "lr"), ("samples_per_s", "samples/s"),
            ("vs_ceiling", "vs ceiling"), ("step_ms", "step ms"),
            ("exposed_ms", "exposed ms"), ("wire_mb_per_step", "wire MB/step"),
            ("wire_vs_fp32", "wire vs DDP fp32"),
            ("final_loss", "final loss"),
            ("loss_at_equal_time", "loss at equal time"),
            ("steps_to_target", "steps to target"),
            ("time_to_target_s", "s to target"),
            ("rank_cpu_ms", "rank CPU ms/step"),
            ("shard_cpu_ms", "shard CPU ms/step"),
            ("phase_step_ms", "1-bit Adam step ms, warm-up / compressed"),
            ("phase_rank_cpu_ms", "1-bit Adam rank CPU ms/step, warm-up / compressed")]


@dataclass(frozen=True)
class _Marks:
    """What every row is measured against: the smoothing window, the target loss (the
    target run's, ``None`` without it), the equal wall time (the shortest learning run's),
    and the peers' results and fp32 wire bytes (``None`` without them)."""

    window: int
    target: float | None
    equal_time: float | None
    ceiling: dict | None
    compute: dict | None
    fp32_wire: float | None

    @classmethod
    def of(cls, results: dict[str, dict], s: E2EBench) -> _Marks:
        window = max(5, s.steps // 15)
        target = None
        if TARGET_RUN in results:
            target = float(moving_average(results[TARGET_RUN]["loss"], window)[-1])
        learners = [n for n, r in results.items() if r["lr"] is not None]
        return cls(window=window, target=target,
                   equal_time=min((results[n]["time"][-1] for n in learners), default=None),
                   ceiling=results.get("ceiling (no traffic)"),
                   compute=results.get("compute-only"),
                   fp32_wire=(results.get(TARGET_RUN) or {}).get("wire_bytes_per_step"))


def _report(results: dict[str, dict], s: E2EBench, *, busy: float, link_note: str,
            link_kind: str, raw_link: dict | None, out: Path | None) -> dict:
    spec = MODELS[s.model]
    marks = _Marks.of(results, s)
    rows = [_row(case_name, r, marks, spec.batch) for case_name, r in results.items()]
    checks = _checks({row["run"]: row for row in rows}, s)
    settings = {k: v for k, v in asdict(s).items() if k not in ("name", "quick")}
    config = {**settings, "target_loss": marks.target, "smoothing_window": marks.window,
              "equal_time_s": marks.equal_time, "link": link_kind, "link_note": link_note,
              "raw_link": raw_link, "memcpy_gbps": _memcpy_gbps(), "machine_busy_before": busy,
              "model_description": spec.description, "batch_per_worker": spec.batch,
              "seq_len": spec.seq_len}
    write_results(s.name, config=config, rows=rows, checks=checks, out=out,
                  notes=_notes(s, marks, link_note, raw_link, busy), columns=_COLUMNS)
    curves = {n: {"loss": r["loss"], "time": r["time"]} for n, r in results.items()
              if r["lr"] is not None}
    out_dir = Path(out or DEFAULT_OUT)
    (out_dir / f"{s.name}_curves.json").write_text(json.dumps(curves))
    return {"rows": rows, "checks": checks}


def _row(case_name: str, r: dict, marks: _Marks, batch: int) -> dict:
    row = {"run": case_name, "lr": r["lr"], "samples_per_s": r["samples_per_s"],
           "step_ms": r["step_s"] * 1e3, "exposed_ms": r["exposed_s"] * 1e3,
           "wire_mb_per_step": (r["wire_bytes_per_step"] / 1e6
                                if r["wire_bytes_per_step"] is not None else None),
           "rank_cpu_ms": [round(c * 1e3) for c in r["rank_cpu_s_per_step"]],
           "shard_cpu_ms": [round(c * 1e3) for c in r["shard_cpu_s_per_step"]],
           "sweep": r["sweep"]}
    phases = r.get("phases")
    if phases:  # 1-bit Adam: each phase apart (warm-up on bf16 pushes, then 1-bit)
        row["phases"] = phases
        row["phase_step_ms"] = (f"{phases['warmup']['step_ms']:.0f} / "
                                f"{phases['compressed']['step_ms']:.0f}")
        row["phase_rank_cpu_ms"] = (f"{phases['warmup']['rank_cpu_ms']} / "
                                    f"{phases['compressed']['rank_cpu_ms']}")
    if marks.ceiling is not None:
        row["vs_ceiling"] = r["samples_per_s"] / marks.ceiling["samples_per_s"]
        if r["lr"] is not None and case_name.startswith("DDP"):
            row["exposed_ms"] = max(r["step_s"] - marks.ceiling["step_s"], 0.0) * 1e3
    if marks.compute is not None:
        row["vs_compute_only"] = r["samples_per_s"] / marks.compute["samples_per_s"]
    if marks.fp32_wire and r["wire_bytes_per_step"]:
        row["wire_vs_fp32"] = marks.fp32_wire / r["wire_bytes_per_step"]
    if r["lr"] is not None:
        row.update(_learning(r, marks, batch))
    return row


def _learning(r: dict, marks: _Marks, batch: int) -> dict:
    """A learning run's loss figures: final, diverged, to the target, at equal time."""
    window = marks.window
    smooth = moving_average(r["loss"], window)
    final = _final(r["loss"])
    row = {"final_loss": final,
           "diverged": bool(not math.isfinite(final) or final > math.log(256) + 0.5)}
    if marks.target is not None:
        hit = np.nonzero(smooth <= marks.target + 1e-12)[0]
        k = int(hit[0]) + window - 1 if hit.size else None
        row["steps_to_target"] = None if k is None else k + 1
        row["samples_to_target"] = None if k is None else (k + 1) * batch * 2
        row["time_to_target_s"] = None if k is None else r["time"][k]
    if marks.equal_time is not None:
        k = int(np.searchsorted(r["time"], marks.equal_time, side="right")) - 1
        lo = max(0, k + 1 - window)
        row["loss_at_equal_time"] = float(np.mean(r["loss"][lo:k + 1]))
    return row


def _notes(s: E2EBench, marks: _Marks, link_note: str, raw_link: dict | None,
           busy: float) -> str:
    spec = MODELS[s.model]
    warm = _schedule(s.steps, s)["warmup_steps"]
    target, equal_time = marks.target, marks.equal_time
    return (f"Model: {spec.description}, batch {spec.batch} x {spec.seq_len} per worker, 2 "
            f"workers, {s.steps} steps, Adam with linear warm-up ({warm} steps) then cosine "
            f"to 0.1x, clip {s.clip_norm}; learning rate "
            f"of each run = best of {list(s.lrs)} at {s.sweep_steps} steps (a run named "
            f"'at DDP fp32's lr': that run's, not swept). Cluster: "
            f"{link_note}; placement {s.placement}"
            + (f"; raw link {raw_link['mbit_per_s']:.0f} Mbit/s (one TCP stream)"
               if raw_link else "")
            + f". Target loss = {TARGET_RUN}'s final {marks.window}-step average"
            + (f" = {target:.4f}" if target is not None else "")
            + (f"; equal wall time = {equal_time:.1f} s" if equal_time else "")
            + f". Wire MB/step: bytes sent + received per worker node (bridge counters). "
            f"Machine busy before the run: {busy:.0%}."
            + (" Straggler: worker 1 computes 1.5x slower." if s.straggler else ""))


def best_run(rows) -> dict | None:
    """bitps's best run, one run held to every goal at once: of the bitps learning runs, the
    first to reach the target loss, or the fastest in samples/s when none does."""
    bitps = [r for r in rows if r["run"].startswith("bitps") and r.get("lr") is not None]
    reached = [r for r in bitps if r.get("time_to_target_s") is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_target_s"])
    return max(bitps, key=lambda r: r["samples_per_s"], default=None)


def _checks(by: dict[str, dict], s: E2EBench) -> dict:
    checks = {}
    bitps = [r for n, r in by.items() if n.startswith("bitps") and r.get("lr") is not None]
    ddp = [r for n, r in by.items() if n.startswith("DDP")]
    for r in bitps + ddp:
        if r.get("diverged"):
            checks[f"{r['run']} does not diverge"] = check(r["final_loss"], "<= ln 256 + 0.5",
                                                           False)
    if s.straggler:
        sync = by.get("bitps sync fp32")
        ssps = [r for n, r in by.items() if n.startswith("bitps ssp")]
        ceiling = by.get("ceiling (no traffic)")
        if sync and ssps:
            ssp = max(ssps, key=lambda r: r["samples_per_s"])
            ratio = ssp["samples_per_s"] / sync["samples_per_s"]
            checks["straggler_ssp_vs_sync_samples_per_s"] = check(
                f"{ssp['run']}: {ratio:.3f}", ">= 1.3", ratio >= 1.3)
            if ceiling is not None:
                # A staleness bound holds the fast worker to the slow one's pace in the long
                # run, so no ssp run can beat every worker stepping at the slow worker's
                # compute-only step (the ceiling run's slowest rank): that bound, measured.
                ranks = len(ceiling["rank_cpu_ms"])
                bound = ranks * MODELS[s.model].batch / (ceiling["step_ms"] / 1e3)
                limit = bound / sync["samples_per_s"]
                checks["straggler_ssp_limit_vs_sync_samples_per_s"] = check(
                    round(limit, 3), ">= 1.3 (is the goal reachable)", limit >= 1.3)
            reached = [r for r in ssps if r.get("time_to_target_s") is not None]
            t_sync = sync.get("time_to_target_s")
            first = min(reached, key=lambda r: r["time_to_target_s"]) if reached else None
            ok = first is not None and (t_sync is None or first["time_to_target_s"] < t_sync)
            checks["straggler_ssp_reaches_target_first"] = check(
                None if first is None else f"{first['run']}: {first['time_to_target_s']:.1f} s",
                f"< sync fp32's {'never' if t_sync is None else f'{t_sync:.1f} s'}", ok)
        sync1 = by.get("bitps sync 1-bit Adam")
        bounded = [r for n, r in by.items() if n.startswith(("bitps ssp", "bitps async"))
                   and r.get("time_to_target_s") is not None]
        if sync1 is not None and sync1.get("time_to_target_s") is not None:
            first = min(bounded, key=lambda r: r["time_to_target_s"], default=None)
            ratio = None if first is None else \
                first["time_to_target_s"] / sync1["time_to_target_s"]
            checks["straggler_bounded_time_to_target_vs_sync_1bit_adam"] = check(
                None if first is None else f"{first['run']}: {ratio:.3f}", "<= 0.85",
                ratio is not None and ratio <= 0.85)
        asyncs = [r for n, r in by.items() if n.startswith("bitps async")]
        if sync and asyncs:
            fast = max(asyncs, key=lambda r: r["samples_per_s"])
            ratio = fast["samples_per_s"] / sync["samples_per_s"]
            checks["straggler_async_vs_sync_samples_per_s"] = check(
                f"{fast['run']}: {ratio:.3f}", ">= 1.3", ratio >= 1.3)
        return checks
    if not bitps:
        return checks
    best = best_run(bitps)
    reached = best.get("time_to_target_s") is not None
    if not reached:
        checks["some_bitps_run_reaches_target"] = check(None, "a bitps run reaches it", False)
    name = best["run"]
    if "vs_ceiling" in best:
        checks["best_bitps_vs_ceiling_samples_per_s"] = check(
            f"{name}: {best['vs_ceiling']:.3f}", ">= 0.9", best["vs_ceiling"] >= 0.9)
    for peer in ddp:
        ratio = best["samples_per_s"] / peer["samples_per_s"]
        checks[f"best_bitps_beats_{peer['run']}_samples_per_s"] = check(
            f"{name}: {ratio:.3f}", "> 1", ratio > 1)
    for peer in ddp if reached else ():
        t_peer = peer.get("time_to_target_s")
        ok = t_peer is None or best["time_to_target_s"] < t_peer
        checks[f"best_bitps_beats_{peer['run']}_time_to_target"] = check(
            f"{name}: {best['time_to_target_s']:.1f} s vs "
            f"{'never' if t_peer is None else f'{t_peer:.1f} s'}", "sooner", ok)
    if best.get("wire_vs_fp32") is not None:
        checks["best_bitps_wire_reduction_vs_fp32"] = check(
            f"{name}: {best['wire_vs_fp32']:.1f}", ">= 20", best["wire_vs_fp32"] >= 20)
    bounded = [r for r in bitps if r["run"].startswith(("bitps ssp", "bitps async"))
               and "1-bit" in r["run"] and r.get("time_to_target_s") is not None]
    if any(r["run"].startswith(("bitps ssp", "bitps async")) for r in bitps):
        first = min(bounded, key=lambda r: r["time_to_target_s"], default=None)
        checks["async_or_ssp_1bit_reaches_target"] = check(
            None if first is None else f"{first['run']}: {first['time_to_target_s']:.1f} s",
            "an async or ssp 1-bit run reaches it", first is not None)
    ddp_times = [r["time_to_target_s"] for r in ddp if r.get("time_to_target_s") is not None]
    if reached and ddp_times:
        ratio = best["time_to_target_s"] / min(ddp_times)
        goal = TIME_GOALS.get(s.model, 1.0)
        checks["best_bitps_time_to_target_vs_best_ddp"] = check(
            f"{name}: {ratio:.3f}", f"<= {goal}" if goal < 1 else "< 1.0",
            ratio <= goal if goal < 1 else ratio < 1.0)
    if RECOMMENDED in by and TARGET_RUN in by:
        ratio = by[RECOMMENDED]["final_loss"] / by[TARGET_RUN]["final_loss"]
        checks["recommended_at_ddp_lr_final_loss_vs_ddp_fp32"] = check(
            round(ratio, 4), "<= 1.03", ratio <= 1.03)
    for key, (a, b) in SYNC_PAIRS.items():
        if a in by and b in by:
            ratio = by[a]["samples_per_s"] / by[b]["samples_per_s"]
            checks[f"async_vs_sync_efficiency_{key}"] = check(round(ratio, 3), ">= 1.0",
                                                             ratio >= 1.0)
    return checks

