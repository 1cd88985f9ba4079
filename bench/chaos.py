"""``bitps-bench chaos``: a soak that keeps a 2 shards x 2 workers job training while a seeded
schedule injects faults, then reports what held (issue 29).

**The job.** Two ``bitps-server`` shards (Adam) run in a network namespace of their own, behind
one veth link (``bench.link.shaped_link``); the two workers run here, each a small numpy
process (:func:`worker_main`: a float32 vector of ``n`` elements, a gradient computed from the
pulled values, a real ``PSClient`` recovering lost shards with ``complete``). Every worker talks
to each shard through a seeded ZeroMQ/gRPC proxy in this process (``bench.faults.ShardProxy``),
so the path is worker -> proxy -> veth -> shard. The soak runs each of ``--modes`` for
``--duration-s / len(modes)``; sync checkpoints every step (its replies wait for the step's
checkpoint), async/ssp every ``--checkpoint-steps`` steps' worth of updates. At the end of a
mode the bench names a final clock (the shards' newest + 10), the workers stop there, and the
shards are stopped with SIGTERM (a final checkpoint).

**The schedule** (:func:`schedule`) is a list of faults drawn from ``--seed`` before the run:
rounds in which every kind of ``--kinds`` comes once, in a shuffled order, each with a target,
the pause before it and how long it is held. One fault at a time: the bench injects it, heals
it, and waits until every rank's clock has advanced twice on both shards: its recovery, timed
from the heal. A fault is *survived* when that happens within ``--recover-timeout-s`` and, at
the end of the mode, every rank's last process exited 0 with every shard at the final clock
for it (less the steps a shard that came back from an older checkpoint lost: the worker's
``PSClient.shift``, which it prints last). The kinds:

- ``shard_term``: SIGTERM to a shard (it answers held pulls SHUTTING_DOWN, writes its final
  checkpoint, exits 0), restarted on its ports from its checkpoint;
- ``shard_kill``: ``kill -9`` to a shard, restarted on its ports from its newest checkpoint;
- ``worker_kill``: ``kill -9`` to a worker, and a replacement under its rank;
- ``stop``: SIGSTOP to a shard or a worker, SIGCONT after the hold;
- ``link_cut``: ``ip link set DEV down`` on the veth, up after the hold;
- ``netem``: the link's qdisc replaced on both ends by ``netem loss 10% delay 20ms``; where the
  kernel has no netem, by a ``tbf`` of 4 Mbit/s with 10 ms of queue (queueing delay and tail
  drops), and the report says which;
- ``duplicate``: the proxy of a shard duplicates every 6th push at once and, of the others,
  every 6th 200 ms late on a side connection (a late resend), for the hold;
- ``delay``: the proxy of a shard holds every 2nd data request 150 ms for the hold.

**What is measured.** Updates lost per shard: in sync, ``n_keys x final clock`` less the
shard's applied updates (0 expected); in async/ssp, the updates of the steps the workers saw
answered (each worker process prints every step) less those applied: at most one checkpoint
interval per ``kill -9`` of that shard, and no more applied than answered plus the pushes in
flight of killed workers. RSS, threads and file descriptors of every shard and worker are
sampled throughout; a role's last half may not exceed its first half. In sync the final
parameters (the checkpoints SIGTERM wrote) are compared bit for bit with a fault-free run of
the same number of steps on loopback.

Needs root and ``ip``/``tc`` for the namespace (without them it reports why and fails its
coverage check).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bitps.bench.config import _Checked
from bitps.bench.report import check, write_results
from bitps.proto.settings import CHOICES

__all__ = ["KINDS", "ChaosBench", "Fault", "run", "schedule", "worker_main"]

KINDS = ("shard_term", "shard_kill", "worker_kill", "stop", "link_cut", "netem", "duplicate",
         "delay")
"""Every fault kind, as ``--kinds`` names them."""
_HELD = ("stop", "link_cut", "netem", "duplicate", "delay")  # held, then healed
_ROOT = Path(__file__).resolve().parents[1]
_SLACK = {"rss_kib": 4096, "threads": 2, "fds": 8}  # + 10 % of RSS


@dataclass(frozen=True, kw_only=True)
class ChaosBench(_Checked):
    """``bitps-bench chaos``: a 2 x 2 job soaked under a seeded schedule of faults."""

    duration_s: float = 600.0
    """soak length in seconds, shared evenly by the modes"""
    modes: tuple[str, ...] = field(default=("sync", "ssp"),
                                   metadata={CHOICES: ("sync", "async", "ssp")})
    """consistency modes soaked one after the other (sync's final parameters are compared
    with a fault-free run's)"""
    kinds: tuple[str, ...] = field(default=KINDS, metadata={CHOICES: KINDS})
    """fault kinds injected: each once per round of the schedule, in a seeded order"""
    seed: int = 0
    """seed of the schedule and of the proxies' choices"""
    gap_s: float = 4.0
    """mean pause between one fault's recovery and the next fault (seconds)"""
    hold_s: float = 1.5
    """mean length of a held fault (stop, link cut, netem, duplicate, delay; seconds)"""
    heartbeat_timeout_s: float = 8.0
    """the shards' --heartbeat-timeout (longer than any held fault: no rank is dropped)"""
    checkpoint_steps: int = 10
    """async/ssp: a checkpoint every this many steps' worth of updates (sync: every step)"""
    recover_timeout_s: float = 60.0
    """a fault not recovered from within this long is not survived"""
    pace_s: float = 0.05
    """each worker's pause before every step (seconds)"""
    n: int = 8192
    """float32 parameters of the job (4 KiB keys)"""
    quick: bool = False
    """one minute, 1.5 s mean gaps, 1 s holds (the test's size)"""

    def sized(self) -> ChaosBench:
        return dataclasses.replace(self, duration_s=60.0, gap_s=1.5, hold_s=1.0) \
            if self.quick else self


@dataclass(frozen=True)
class Fault:
    """One entry of the schedule."""

    kind: str
    target: str
    """``shard I``, ``worker R``, ``link`` or ``proxy I``."""
    gap_s: float
    """pause before it"""
    hold_s: float
    """how long it is held (0: a kill, healed by the restart)"""


def schedule(cfg: ChaosBench, count: int) -> list[Fault]:
    """``count`` faults drawn from ``cfg.seed``: rounds of every kind of ``cfg.kinds`` once."""
    rng = random.Random(cfg.seed)
    faults: list[Fault] = []
    while len(faults) < count:
        kinds = list(cfg.kinds)
        rng.shuffle(kinds)
        for kind in kinds:
            i = rng.randrange(2)
            target = {"shard_term": f"shard {i}", "shard_kill": f"shard {i}",
                      "worker_kill": f"worker {i}", "link_cut": "link", "netem": "link",
                      "duplicate": f"proxy {i}", "delay": f"proxy {i}"}.get(
                kind, f"{rng.choice(('shard', 'worker'))} {i}")
            hold = round(cfg.hold_s * rng.uniform(0.5, 1.5), 2) if kind in _HELD else 0.0
            faults.append(Fault(kind, target, round(cfg.gap_s * rng.uniform(0.5, 1.5), 2),
                                hold))
    return faults[:count]


# -- the job ----------------------------------------------------------------------------------
class _Job:
    """The processes of one mode: 2 shards in the namespace, their proxies, 2 workers."""

    def __init__(self, mode: str, cfg: ChaosBench, link, root: Path, keys: list[int]) -> None:
        from bitps.bench import faults

        self.f, self.mode, self.cfg, self.link, self.root = faults, mode, cfg, link, root
        self.keys = keys  # keys per shard
        root.mkdir(parents=True, exist_ok=True)
        self.stop_file = root / "final-clock"
        every = keys if mode == "sync" else [cfg.checkpoint_steps * 2 * k for k in keys]
        self.interval = every
        self.flags = [["--shard-id", str(i), "--num-shards", "2", "--host", link.server_ip,
                       "--mode", mode, "--staleness", "2", "--optimizer", "adam",
                       "--lr", "0.001", "--metrics-port", "-1", "--log-level", "INFO",
                       "--heartbeat-timeout", str(cfg.heartbeat_timeout_s),
                       "--checkpoint-dir", str(root / f"shard{i}"),
                       "--checkpoint-every-updates", str(every[i])] for i in range(2)]
        self.shards = [self._shard(i, ()) for i in range(2)]
        self.proxies = [faults.ShardProxy(s.grpc_address, s.data_port, seed=cfg.seed + i,
                                          idle_close_s=30.0)
                        for i, s in enumerate(self.shards)]
        self.workers: list = [None, None]
        self.started: list = []  # every worker process: (rank, Proc, stdout path)
        for r in range(2):
            self.start_worker(r)

    def _shard(self, i: int, ports) -> object:
        log = open(self.root / f"shard{i}.log", "a")  # noqa: SIM115
        popen = subprocess.Popen(
            [*self.link.prefix, sys.executable, "-m", "bitps.ps", *self.flags[i], *ports],
            cwd=_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        shard = self.f.ServerProcess(popen)
        shard.grpc_address = f"{self.link.server_ip}:{shard.ready['grpc_port']}"
        return shard

    def restart_shard(self, i: int, sig: int) -> None:
        """Signal shard ``i`` (SIGTERM: it must exit 0) and start it on its ports again."""
        old = self.shards[i]
        if sig == signal.SIGKILL:
            old.kill()
        else:
            old.popen.send_signal(sig)
            rc = old.popen.wait(60)
            if rc != 0:
                raise RuntimeError(f"shard {i} exited {rc} after SIGTERM")
        ports = ("--grpc-port", str(old.ready["grpc_port"]),
                 "--data-port", str(old.ready["data_port"]))
        for attempt in range(20):
            try:
                self.shards[i] = self._shard(i, ports)
                return
            except AssertionError:  # exited before its ready line: the old ports not free yet
                if attempt == 19:
                    raise
                time.sleep(0.25)

    def start_worker(self, rank: int) -> None:
        k = len(self.started)
        out = self.root / f"worker{rank}-{k}.out"
        spec = dict(servers=[p.address for p in self.proxies], rank=rank, n=self.cfg.n,
                    pace_s=self.cfg.pace_s, stop_file=str(self.stop_file))
        with open(out, "w") as stdout, open(self.root / f"worker{rank}-{k}.log", "w") as err:
            popen = subprocess.Popen([sys.executable, "-m", "bitps.bench.chaos",
                                      json.dumps(spec)], cwd=_ROOT, stdout=stdout, stderr=err)
        self.workers[rank] = proc = self.f.Proc(popen)
        self.started.append((rank, proc, out))

    def clocks(self) -> list[dict[int, int]]:
        """Each shard's clock of every rank (its Status)."""
        return [{w.rank: w.clock for w in s.status().workers} for s in self.shards]

    def processes(self) -> dict[str, object]:
        return {"shard 0": self.shards[0], "shard 1": self.shards[1],
                "worker 0": self.workers[0], "worker 1": self.workers[1]}

    def tails(self, lines: int = 3) -> dict[str, list[str]]:
        """The last lines of every log of this mode: what a stuck job was doing."""
        return {log.name: log.read_text(errors="replace").splitlines()[-lines:]
                for log in sorted(self.root.glob("*.log"))}

    def close(self) -> None:
        for p in [*self.shards, *(w for _, w, _ in self.started)]:
            if p.alive():
                p.cont()
            p.kill()
        for p in self.proxies:
            p.close()


def _sampler(job: _Job, rows: list[dict], stop: threading.Event, every_s: float) -> None:
    t0 = time.monotonic()
    while not stop.wait(every_s):
        for role, p in job.processes().items():
            try:
                rows.append({"t": round(time.monotonic() - t0, 2), "role": role, "pid": p.pid,
                             "rss_kib": p.rss_kib(), "threads": p.threads(), "fds": p.fds()})
            except (OSError, AssertionError):
                continue  # killed meanwhile


def _bounded(samples: list[dict]) -> dict[str, dict]:
    """Per role and measure: the first and the last half's maxima, and whether the last half
    stayed within the first's plus :data:`_SLACK` (transient connections: Status probes, a
    reconnected worker's old proxy connection until it idles out; allocator noise)."""
    out = {}
    if not samples:
        return out
    mid = (samples[0]["t"] + samples[-1]["t"]) / 2
    for role in sorted({s["role"] for s in samples}):
        mine = [s for s in samples if s["role"] == role]
        for what in ("rss_kib", "threads", "fds"):
            first = max((s[what] for s in mine if s["t"] <= mid), default=0)
            last = max((s[what] for s in mine if s["t"] > mid), default=0)
            allowed = first * 1.1 + _SLACK[what] if what == "rss_kib" else first + _SLACK[what]
            out[f"{role} {what}"] = {"first": first, "last": last, "ok": last <= allowed}
    return out


# -- faults -----------------------------------------------------------------------------------
def _tc(link, dev_end: int, *args: str) -> None:
    prefix = link.prefix if dev_end else ()
    subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", link.devices[dev_end], "root",
                    *args], check=True, capture_output=True, timeout=30)


def _impair(link) -> str:
    """Loss and delay on both ends of the link; which qdisc did it."""
    try:
        for end in (0, 1):
            _tc(link, end, "netem", "loss", "10%", "delay", "20ms")
        return "netem loss 10% delay 20ms"
    except subprocess.CalledProcessError:
        for end in (0, 1):
            _tc(link, end, "tbf", "rate", "4mbit", "burst", "8kb", "latency", "10ms")
        return "no netem in this kernel: tbf 4mbit latency 10ms (queueing delay, tail drops)"


def _heal_link(link) -> None:
    for end in (0, 1):
        _tc(link, end, "tbf", "rate", link.rate, "burst", "256kb", "latency", "50ms")


def _inject(job: _Job, fault: Fault) -> str:
    """Inject ``fault``, hold it, heal it; a note on what was done."""
    f, link = job.f, job.link
    role, _, index = fault.target.partition(" ")
    i = int(index) if index else 0
    if fault.kind in ("shard_term", "shard_kill"):
        job.restart_shard(i, signal.SIGTERM if fault.kind == "shard_term" else signal.SIGKILL)
        return "restarted on its ports"
    if fault.kind == "worker_kill":
        job.workers[i].kill()
        job.start_worker(i)
        return "replacement started"
    if fault.kind == "stop":
        proc = job.processes()[fault.target]
        proc.stop()
        time.sleep(fault.hold_s)
        proc.cont()
        return "SIGSTOP, SIGCONT"
    if fault.kind == "link_cut":
        subprocess.run(["ip", "link", "set", link.devices[0], "down"], check=True, timeout=30)
        time.sleep(fault.hold_s)
        subprocess.run(["ip", "link", "set", link.devices[0], "up"], check=True, timeout=30)
        return f"{link.devices[0]} down, up"
    if fault.kind == "netem":
        note = _impair(link)
        time.sleep(fault.hold_s)
        _heal_link(link)
        return note
    data = job.proxies[i].data
    before = data.counts[fault.kind]
    if fault.kind == "duplicate":
        rules = [f.Rule("duplicate", when=f.pushes, every=6),
                 f.Rule("duplicate", when=f.pushes, every=6, delay_s=0.2)]
    else:
        rules = [f.Rule("delay", every=2, delay_s=0.15)]
    data.rules = rules
    time.sleep(fault.hold_s)
    data.rules = []
    return f"{data.counts[fault.kind] - before} messages"


def _recovered(job: _Job, timeout: float) -> float | None:
    """Seconds until every rank's clock advanced twice on both shards; ``None``: not within
    ``timeout`` (or a worker failed)."""
    t0 = time.monotonic()
    base = None
    while time.monotonic() - t0 < timeout:
        for w in job.workers:
            if not w.alive() and w.popen.returncode != 0:
                return None
        try:
            clocks = job.clocks()
        except Exception:  # grpc.RpcError: a shard not answering yet
            time.sleep(0.1)
            continue
        if base is None:
            base = clocks
        elif all(c.get(r, 0) >= base[s].get(r, 0) + 2 for s, c in enumerate(clocks)
                 for r in range(2)):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


# -- one mode ---------------------------------------------------------------------------------
def _soak(mode: str, cfg: ChaosBench, link, faults: list[Fault], root: Path,
          keys: list[int]) -> dict:
    """Run ``mode`` for its share of the soak, injecting from ``faults`` (consumed)."""
    job = _Job(mode, cfg, link, root, keys)
    samples: list[dict] = []
    stop = threading.Event()
    seconds = cfg.duration_s / len(cfg.modes)
    sampler = threading.Thread(target=_sampler, args=(job, samples, stop, max(0.5,
                               seconds / 120)), daemon=True)
    sampler.start()
    records, kills = [], {"shard 0": 0, "shard 1": 0, "worker": 0}
    t0 = time.monotonic()
    try:
        if _recovered(job, cfg.recover_timeout_s) is None:
            raise RuntimeError(f"{mode}: the job did not start training")
        while faults and time.monotonic() - t0 + faults[0].gap_s + faults[0].hold_s < seconds:
            fault = faults.pop(0)
            time.sleep(fault.gap_s)
            at = time.monotonic() - t0
            try:
                note = _inject(job, fault)
            except Exception as err:  # an injection that failed is reported, not raised
                note = f"injection failed: {err}"
            recovery = _recovered(job, cfg.recover_timeout_s)
            if fault.kind == "shard_kill":
                kills[fault.target] += 1
            elif fault.kind == "worker_kill":
                kills["worker"] += 1
            records.append({"mode": mode, "at_s": round(at, 2), "kind": fault.kind,
                            "target": fault.target, "hold_s": fault.hold_s, "note": note,
                            "recovery_s": None if recovery is None else round(recovery, 2),
                            "recovered": recovery is not None})
            if recovery is None:
                records[-1]["evidence"] = job.tails()
                break  # the job is stuck: the rest of this mode injects nothing
        final = _finish(job, cfg)
    finally:
        stop.set()
        sampler.join()
        job.close()
    return {"mode": mode, "faults": records, "samples": samples, "kills": kills,
            "seconds": round(time.monotonic() - t0, 1), "interval": job.interval,
            "root": root, **final}


def _finish(job: _Job, cfg: ChaosBench) -> dict:
    """Name the final clock, wait for the workers, SIGTERM the shards; the counts."""
    final = max(c for clocks in job.clocks() for c in clocks.values()) + 10
    tmp = job.stop_file.with_suffix(".tmp")
    tmp.write_text(str(final))
    tmp.replace(job.stop_file)
    rcs = {}
    for r, w in enumerate(job.workers):
        try:
            rcs[r] = w.popen.wait(cfg.recover_timeout_s + 60)
        except subprocess.TimeoutExpired:
            rcs[r] = None
    clocks = job.clocks()
    applied = [s.status().updates_applied for s in job.shards]
    term = []
    for s in job.shards:
        s.popen.send_signal(signal.SIGTERM)
        term.append(s.popen.wait(60))
    answered = sum(_steps(out) for _, _, out in job.started)
    last = {rank: out for rank, _, out in job.started}  # each rank's last process
    return {"final_clock": final, "worker_rc": rcs, "clocks": clocks, "applied": applied,
            "shard_rc": term, "answered_steps": answered,
            "shifts": {r: _shift(out) for r, out in last.items()}}


def _shift(out: Path) -> list[int] | None:
    """The shifts a worker process printed when it finished (``None``: it did not finish)."""
    for line in reversed(out.read_text().splitlines()):
        if '"shift"' in line:
            return json.loads(line)["shift"]
    return None


def _steps(out: Path) -> int:
    return sum(1 for line in out.read_text().splitlines() if '"clock"' in line)


def _lost(leg: dict, keys: list[int]) -> list[dict]:
    """Per shard: updates expected, applied, lost, and the bound they are held to."""
    rows = []
    for i in range(2):
        if leg["mode"] == "sync":
            expected = keys[i] * leg["final_clock"]
            low, high = 0, 0
        else:
            expected = keys[i] * leg["answered_steps"]
            low = -keys[i] * leg["kills"]["worker"]  # pushes in flight of killed workers
            high = leg["interval"][i] * leg["kills"][f"shard {i}"]
        lost = expected - leg["applied"][i]
        rows.append({"shard": i, "expected": expected, "applied": leg["applied"][i],
                     "lost": lost, "bound": high, "ok": low <= lost <= high})
    return rows


# -- the fault-free reference ------------------------------------------------------------------
def _reference(cfg: ChaosBench, final_clock: int, root: Path) -> list[dict]:
    """The same sync job, no faults, no pause, on loopback, to ``final_clock``; its final
    parameters by shard."""
    from bitps.bench import faults
    from bitps.ps.checkpoint import load_latest

    root.mkdir(parents=True, exist_ok=True)
    stop_file = root / "final-clock"
    stop_file.write_text(str(final_clock))
    shards = [faults.start_server("--shard-id", str(i), "--num-shards", "2", "--mode", "sync",
                                  "--optimizer", "adam", "--lr", "0.001",
                                  "--checkpoint-dir", str(root / f"shard{i}"))
              for i in range(2)]
    workers = []
    try:
        for r in range(2):
            spec = dict(servers=[s.grpc_address for s in shards], rank=r, n=cfg.n, pace_s=0.0,
                        stop_file=str(stop_file))
            workers.append(faults.Proc(subprocess.Popen(
                [sys.executable, "-m", "bitps.bench.chaos", json.dumps(spec)], cwd=_ROOT,
                stdout=subprocess.DEVNULL)))
        for w in workers:
            if w.popen.wait(600) != 0:
                raise RuntimeError("the fault-free reference run failed")
        for s in shards:
            s.popen.send_signal(signal.SIGTERM)
            s.popen.wait(60)
    finally:
        for p in [*shards, *workers]:
            p.kill()
    return [load_latest(root / f"shard{i}").params for i in range(2)]


def _equal(root: Path, want: list[dict]) -> bool:
    from bitps.ps.checkpoint import load_latest

    got = [load_latest(root / f"shard{i}").params for i in range(2)]
    return all(g.keys() == w.keys() and all(g[k].tobytes() == w[k].tobytes() for k in w)
               for g, w in zip(got, want))


# -- the scenario -----------------------------------------------------------------------------
def run(cfg: ChaosBench | None = None, *, out: Path | None = None) -> dict:
    """Run the soak (``None``: the defaults), write ``chaos.json``/``.md`` under ``out``,
    return the document."""
    from bitps.bench.link import shaped_link
    from bitps.proto.keyplan import ParamSpec, make_plan

    cfg = (cfg or ChaosBench()).sized()
    plan = make_plan([ParamSpec("w", (cfg.n,))], num_shards=2, partition_bytes=4096)
    keys = [len(plan.for_shard(i)) for i in range(2)]
    faults = schedule(cfg, int(cfg.duration_s / (0.5 * cfg.gap_s)) + len(cfg.kinds))
    planned = list(faults)
    tmp = Path(tempfile.mkdtemp(prefix="bitps-chaos-"))
    legs, equal = [], None
    t0 = time.monotonic()
    with shaped_link("10gbit") as link:
        if link.kind != "netns":
            faults = [f for f in faults if f.kind not in ("link_cut", "netem")]
        for mode in cfg.modes:
            legs.append(_soak(mode, cfg, link, faults, tmp / mode, keys))
    for leg in legs:
        if leg["mode"] == "sync":
            want = _reference(cfg, leg["final_clock"], tmp / "reference")
            equal = _equal(leg["root"], want)
    doc = _report(cfg, link, legs, planned, equal, keys, time.monotonic() - t0, out)
    if all(c["ok"] for c in doc["checks"].values()):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"chaos: a check failed; the run's logs and checkpoints are in {tmp}",
              file=sys.stderr)
    return doc


def _report(cfg, link, legs, planned, equal, keys, wall_s, out) -> dict:
    records = [r for leg in legs for r in leg["faults"]]
    by_kind = {k: {"injected": sum(r["kind"] == k for r in records),
                   "survived": sum(r["kind"] == k and r["recovered"] for r in records)}
               for k in cfg.kinds}
    finished = all(rc == 0 for leg in legs for rc in leg["worker_rc"].values()) and \
        all(rc == 0 for leg in legs for rc in leg["shard_rc"]) and \
        all(leg["shifts"][r] is not None and c[r] == leg["final_clock"] + leg["shifts"][r][i]
            for leg in legs for i, c in enumerate(leg["clocks"]) for r in c)
    lost = {leg["mode"]: _lost(leg, keys) for leg in legs}
    bounded = {f"{leg['mode']} {k}": v for leg in legs
               for k, v in _bounded(leg["samples"]).items()}
    slowest = max(records, key=lambda r: r["recovery_s"] or 0, default=None)
    survived = sum(r["recovered"] for r in records)
    rows = [{**r, "recovery_s": r["recovery_s"]} for r in records]
    checks = {
        "faults injected": check(len(records), f">= {50 if cfg.duration_s >= 600 else 8}",
                                 len(records) >= (50 if cfg.duration_s >= 600 else 8)),
        "every kind injected": check(sorted(k for k, v in by_kind.items() if v["injected"]),
                                     f"all of {', '.join(cfg.kinds)}",
                                     all(v["injected"] for v in by_kind.values())),
        "faults survived": check(survived, f"all {len(records)}, then every rank's last "
                                 f"process rc 0 at the final clock",
                                 finished and survived == len(records)),
        "slowest recovery (s)": check(slowest and slowest["recovery_s"],
                                      f"<= {cfg.recover_timeout_s}",
                                      all(r["recovered"] for r in records)),
        "updates lost": check({m: [r["lost"] for r in rs] for m, rs in lost.items()},
                              "sync 0; async/ssp <= one checkpoint interval per kill -9",
                              all(r["ok"] for rs in lost.values() for r in rs)),
        "RSS, threads, fds bounded": check(
            sorted(k for k, v in bounded.items() if not v["ok"]) or "all",
            "no role's last-half maximum above its first half's + 10 % + 4 MiB RSS, + 2 "
            "threads, + 8 fds",
            all(v["ok"] for v in bounded.values())),
    }
    if equal is not None:
        checks["sync final parameters equal a fault-free run's"] = check(
            equal, "bit for bit", equal)
    doc_config = {**dataclasses.asdict(cfg), "link": link.note,
                  "keys_per_shard": keys, "wall_s": round(wall_s, 1)}
    extra = {"by_kind": by_kind, "lost": lost, "resources": bounded,
             "legs": [{k: v for k, v in leg.items() if k not in ("samples", "faults", "root")}
                      for leg in legs],
             "samples": [s | {"mode": leg["mode"]} for leg in legs for s in leg["samples"]],
             "schedule": [dataclasses.asdict(f) for f in planned[:len(records) + 4]]}
    notes = _notes(cfg, link, legs, by_kind, lost, slowest)
    write_results("chaos", config=doc_config, rows=rows, checks=checks, out=out, notes=notes,
                  columns=[("mode", "mode"), ("at_s", "at (s)"), ("kind", "kind"),
                           ("target", "target"), ("hold_s", "held (s)"), ("note", "what"),
                           ("recovery_s", "recovery (s)")])
    path = (Path(out) if out else _ROOT / "bench" / "results") / "chaos.json"
    doc = json.loads(path.read_text())
    doc.update(extra)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _notes(cfg, link, legs, by_kind, lost, slowest) -> str:
    lines = [f"Soak of {cfg.duration_s:.0f} s ({', '.join(cfg.modes)}), seed {cfg.seed}; "
             f"{link.note}.", "",
             "| kind | injected | survived |", "|---|---|---|"]
    lines += [f"| {k} | {v['injected']} | {v['survived']} |" for k, v in by_kind.items()]
    lines += ["", "| mode | shard | updates expected | applied | lost | allowed |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {m} | {r['shard']} | {r['expected']} | {r['applied']} | {r['lost']} | "
              f"{r['bound']} |" for m, rs in lost.items() for r in rs]
    lines += [""] + [f"{leg['mode']}: {leg['seconds']} s, final clock {leg['final_clock']}, "
                     f"workers rc {leg['worker_rc']}, shards rc {leg['shard_rc']}, kills "
                     f"{leg['kills']}, checkpoint interval {leg['interval']} updates."
                     for leg in legs]
    if slowest:
        lines.append(f"Slowest recovery: {slowest['recovery_s']} s ({slowest['kind']} of "
                     f"{slowest['target']} in {slowest['mode']}).")
    return "\n".join(lines)


# -- the worker process -----------------------------------------------------------------------
def worker_main(spec: dict) -> None:
    """One rank: register a float32 vector (rank 0 initializes it with ``arange(n) / n``),
    then push_pull a gradient computed from the pulled values (``0.1 x + 0.01 (rank + 1)``)
    every ``pace_s`` until the clock ``stop_file`` names, recovering lost shards
    (``PSClient.complete``). Prints ``{"clock": c}`` after every step answered."""
    import numpy as np

    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker import ClientConfig, PSClient

    n, rank = spec["n"], spec["rank"]
    plan = make_plan([ParamSpec("w", (n,))], num_shards=len(spec["servers"]),
                     partition_bytes=4096)
    keys = [k.key for k in plan.keys]
    client = PSClient(ClientConfig(servers=tuple(spec["servers"]), rank=rank, world_size=2,
                                   deadline_s=2.0, heartbeat_s=0.5, reconnect_timeout_s=60.0,
                                   reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.5))
    start = np.arange(n, dtype=np.float32) / n
    outs = [start[k.offset:k.offset + k.length].copy() for k in plan.keys]
    copies = dict(zip(keys, outs))
    client.register(plan, dict(copies) if rank == 0 else None, copies=copies)
    client.pull(keys, outs, clock=client.start_clock).wait()
    stop_file, final, clock = Path(spec["stop_file"]), None, client.start_clock
    while final is None or clock < final:
        if final is None and stop_file.exists():
            final = int(stop_file.read_text())
            continue
        time.sleep(spec["pace_s"])
        grads = [np.float32(0.1) * o + np.float32(0.01 * (rank + 1)) for o in outs]
        client.complete(client.push_pull(keys, grads, outs, clock=clock), copies)
        clock += 1
        client.clock = clock
        print(json.dumps({"clock": clock}), flush=True)
    # where each shard has this rank: the final clock plus the shift of a shard that lost steps
    print(json.dumps({"final": clock, "shift": client.shift}), flush=True)
    client.close()


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
