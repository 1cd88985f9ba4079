"""``bitps-bench kernels``: a shard's CPU per update, and a worker's per step
(``bench.worker_kernels``), against the floor memory bandwidth sets.

A shard update is memory-bound arithmetic: its floor is the bytes it must read and write, divided
by the bandwidth this machine moves bytes at, measured in the same run as ``np.copyto`` of the
same key set (a copy of ``X`` bytes reads ``X`` and writes ``X``: bandwidth = ``2X / t``).

**What an update must touch** (the accounting, per element of the key set; ``n`` float32
elements, 4 bytes each; payload bytes counted as their measured sizes):

==========================================  ==========================  ==================
rule, mode, push codec -> pull codec         reads                        writes
==========================================  ==========================  ==================
sgd, async, raw -> raw                       g, p                         p, last delta
momentum, async, raw -> raw                  g, p, buf                    p, buf, last delta
adam, async, raw -> raw                      g, p, m, v                   p, m, v, last delta
adam, sync, raw -> raw                       g, p, m, v                   p, m, v
adam, async, sign1 -> raw                    push code, p, m, v           p, m, v, last delta
adam, async, raw -> sign1                    g, p, m, v, residual         p, m, v, residual, code
adam, async, sign1 -> sign1                  push code, p, m, v, resid.   p, m, v, residual, code
1-bit Adam sync (compressed phase)           push code, p, v, residual    p, residual, code
1-bit Adam sync, 2 workers                   2 push codes, p, v, resid.   p, residual, code
1-bit Adam async, worker moments             push code, p, residual       p, residual, code
1-bit Adam async, shard moments              push code, p, m, v, resid.   p, m, residual, code
==========================================  ==========================  ==================

("last delta": in async/ssp with raw pulls the shard keeps each key's last update for the
lookahead it hands out, ``ServerConfig.lookahead``; with compressed pulls the workers predict
and the shard keeps none. sync 1-bit Adam's m is the decoded published momentum, which the
shard keeps as that code, ``ps.onebit.OneBitState``: neither read nor written; it was written
every update until 2026-12-06.) One push of one worker is one update (one worker: a sync step
is one push too); with two workers in sync, one step (both pushes, summed in the update's
kernel, ``ps.pushcode``).

**What is measured**: the shard's real request path, :meth:`ShardCore.handle` on a PUSH
carrying every key (validation, the finiteness check, decode, the rule, publishing), in this
process, on one thread (numba set to 1), CPU time (``time.thread_time``). Each case's core is
built once; rounds alternate the cases and memcpy, and each figure is the median over rounds of
the mean of ``repeats`` pushes. The machine's load in the two seconds before the first round
(``/proc/stat``) is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bitps.bench.config import KernelsBench
from bitps.bench.proc import machine_busy
from bitps.bench.report import check, median, write_results
from bitps.bench.worker_kernels import ENCODER_SCALING_CASES, WORKER_CASES, Worker, measure

__all__ = ["CASES", "Case", "SCALING_CASES", "run"]

MIB = 1 << 20
_INCARNATION = 0x6B3F  # the pushes' life id: a shard refuses a push without one (ps.dedup)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One combination: the shard's settings and the arrays the floor counts (``reads``,
    ``writes``: float32 arrays of the key set's length, payloads apart)."""

    name: str
    optimizer: str
    mode: str = "async"
    push: str = "raw"
    pull: str = "raw"
    moments: str = "auto"
    """1-bit Adam's layout in async (``OneBitConfig.moments``)."""
    workers: int = 1
    """Workers pushing every key each step (sync sums their pushes)."""
    reads: int
    writes: int
    goal: float = 2.0
    """Acceptance: CPU per update at most this times the floor."""

    @property
    def onebit(self) -> bool:
        return self.optimizer == "onebit_adam"


CASES = (
    Case(name="sgd, async, raw -> raw", optimizer="sgd", reads=2, writes=2),
    Case(name="momentum, async, raw -> raw", optimizer="momentum", reads=3, writes=3),
    Case(name="adam, async, raw -> raw", optimizer="adam", reads=4, writes=4, goal=1.5),
    Case(name="adam, sync, raw -> raw", optimizer="adam", mode="sync", reads=4, writes=3,
         goal=1.5),
    Case(name="adam, async, sign1 -> raw", optimizer="adam", push="sign1", reads=3, writes=4),
    Case(name="adam, async, raw -> sign1", optimizer="adam", pull="sign1", reads=5, writes=4),
    Case(name="adam, async, sign1 -> sign1", optimizer="adam", push="sign1", pull="sign1",
         reads=4, writes=4),
    Case(name="1-bit Adam, sync", optimizer="onebit_adam", mode="sync", push="sign1",
         pull="sign1", reads=3, writes=2, goal=1.5),
    Case(name="1-bit Adam, sync, 2 workers", optimizer="onebit_adam", mode="sync",
         push="sign1", pull="sign1", workers=2, reads=3, writes=2, goal=1.5),
    Case(name="1-bit Adam, async, worker moments", optimizer="onebit_adam", push="sign1",
         pull="sign1", moments="worker", reads=2, writes=2, goal=1.5),
    Case(name="1-bit Adam, async, shard moments", optimizer="onebit_adam", push="sign1",
         pull="sign1", moments="shard", reads=4, writes=3, goal=1.5),
)
"""Every combination the bench measures, in table order."""

SCALING_CASES = ("adam, async, raw -> raw", "1-bit Adam, sync")
"""The cases timed with several shard threads (``KernelsBench.thread_counts``)."""

class _Pusher:
    """A shard for ``case`` over ``keys`` keys of ``n`` elements with ``workers`` registered
    workers, and the pushes it takes: :meth:`push` sends the next step's (a PUSH of every key
    at the next clock from each worker in turn; in sync the last one completes the step).
    ``per_key``: one PUSH per key, each worker's in turn, as a shard receives keys that
    travel alone; ``chunk``: the elements per scale of sign1 pushes (default sign1's);
    ``decoded_first``: the shard decodes every push into the key's scratch array before the
    rule sees it, where it would hand the rule the code (the path before 2026-12-06);
    ``summed_first``: a sync step's pushed codes are summed into the key's array as they
    arrive, where the rule would sum them in its kernel (the path before 2026-12-07).
    ``workers`` defaults to the case's."""

    def __init__(self, case: Case, keys: int, n: int, *, threads: int = 1,
                 workers: int | None = None, per_key: bool = False, chunk: int = 0,
                 decoded_first: bool = False, summed_first: bool = False) -> None:
        from bitps.native import sign1
        from bitps.proto import bitps_pb2 as pb
        from bitps.proto.codecs import CODECS, Codec
        from bitps.proto.wire import PROTOCOL
        from bitps.ps.config import OptimizerConfig, ServerConfig
        from bitps.ps.onebit import OneBitConfig
        from bitps.ps.shard import ShardCore

        self.pb, self.protocol, self.case = pb, PROTOCOL, case
        workers = workers or case.workers
        rule_config = OneBitConfig(freeze_step=1, moments=case.moments) if case.onebit else None
        cfg = ServerConfig(mode=case.mode, threads=threads, optimizer=OptimizerConfig(
            name=case.optimizer, lr=1e-4, rule_config=rule_config))
        self.core = ShardCore(cfg, now=time.monotonic)
        self.reads_codes = case.push == "sign1" and self.core.keeps_code(
            Codec(pb.CODEC_SIGN1, chunk or sign1.DEFAULT_CHUNK))
        """Whether the rule reads this case's pushed codes in its kernel (``ps.pushcode``)."""
        if decoded_first:  # every push decoded into the key's scratch array first, as before
            self.core.keeps_code = lambda codec: False
        rng = np.random.default_rng(0)
        specs = [pb.KeySpec(key=k, name=f"p{k}", offset=0, length=n, dtype=pb.FLOAT32,
                            compressed_pull=case.pull == "sign1") for k in range(keys)]
        values = {k: (rng.standard_normal(n) * 0.02).astype(np.float32).tobytes()
                  for k in range(keys)}
        pull = CODECS["sign1"] if case.pull == "sign1" else pb.CODEC_RAW
        for rank in range(workers):
            self.core.register(pb.RegisterRequest(
                protocol=PROTOCOL, rank=rank, world_size=workers, signature="kernels",
                num_shards=1, shard_id=0, keys=specs, sends_values=rank == 0, pull_codec=pull,
                pull_codec_chunk=sign1.DEFAULT_CHUNK if case.pull == "sign1" else 0),
                values if rank == 0 else {})
        if summed_first:  # a step's codes summed into the key's array as they arrive
            for slot in self.core.slots.values():
                slot.sums_codes = False
        self.workers = workers
        self.keys = list(range(keys))
        grads = [rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
                 for _ in range(2)]
        self.raw = [[g.tobytes()] * keys for g in grads]
        self.chunk = chunk or sign1.DEFAULT_CHUNK
        codes = []
        for g in grads:
            out = np.empty(sign1.payload_bytes(n, self.chunk), np.uint8)
            sign1.encode(g, np.zeros(n, np.float32), out, chunk=self.chunk)
            codes.append([out.tobytes()] * keys)
        self.codes = codes
        self.sign1 = CODECS["sign1"]
        self.batches = [[k] for k in self.keys] if per_key else [self.keys]
        self.clock = 0
        self.push_bytes = 0
        if case.onebit:
            self.push()  # the warmup step (full Adam on a raw push); the next ones compress

    def push(self) -> None:
        pb = self.pb
        compressed = self.case.push == "sign1" and not (self.case.onebit and self.clock == 0)
        frames = (self.codes if compressed else self.raw)[self.clock % 2]
        fields = dict(codec=self.sign1, codec_chunk=self.chunk) if compressed else {}
        for i, batch in enumerate(self.batches):
            for worker in range(self.workers):
                header = pb.DataHeader(
                    op=pb.PUSH, protocol=self.protocol, worker=worker,
                    request_id=self.clock * len(self.batches) + i + 1, clock=self.clock,
                    keys=batch, dtype=pb.FLOAT32, incarnation=_INCARNATION + 2 * worker,
                    **fields)
                replies = self.core.handle(f"w{worker}".encode(), [
                    header.SerializeToString(), *(frames[k] for k in batch)])
                reply = replies[-1].header if replies else None
                if reply is None or reply.op != pb.REPLY:
                    raise RuntimeError(f"{self.case.name}: worker {worker}'s push at clock "
                                       f"{self.clock} was answered {reply}")
        self.push_bytes = sum(len(f) for f in frames) * self.workers
        self.clock += 1

    def published_bytes(self) -> int:
        """The code bytes the last update published (0 for raw pulls)."""
        total = 0
        for slot in self.core.slots.values():
            pub = slot.publisher
            if pub is not None and pub.history:
                total += len(pub.history[-1][1])
        return total


def run(cfg: KernelsBench | None = None, *, out: Path | None = None) -> dict:
    """Run the scenario (``None``: the defaults), write ``kernels.json``/``.md`` under ``out``,
    return the document."""
    import numba

    cfg = (cfg or KernelsBench()).sized()
    numba.set_num_threads(1)
    n = cfg.key_mib * MIB // 4
    keys = max(1, cfg.mib // cfg.key_mib)
    cases = [c for c in CASES if not cfg.cases or c.name in cfg.cases]
    pushers = {c.name: _Pusher(c, keys, n) for c in cases}
    # the cases whose rule reads the pushed codes, also with every push decoded first: the
    # path before, in the same rounds
    before = {f"{name} (decoded first)": _Pusher(p.case, keys, n, decoded_first=True)
              for name, p in pushers.items() if p.reads_codes}
    # and those of several workers in sync, with the step's codes summed as they arrive (the
    # path before 2026-12-07)
    before.update({f"{name} (summed first)": _Pusher(p.case, keys, n, summed_first=True)
                   for name, p in pushers.items()
                   if p.reads_codes and p.case.mode == "sync" and p.workers > 1})
    src = np.random.default_rng(1).standard_normal(keys * n).astype(np.float32)
    dst = np.empty_like(src)
    busy = machine_busy(2.0)
    timed = [(c.name, pushers[c.name]) for c in cases] + list(before.items())
    cpu: dict[str, list[float]] = {name: [] for name, _ in timed}
    copy: list[float] = []
    for _, p in timed:
        p.push()  # compile, touch every buffer once
    np.copyto(dst, src)
    for _ in range(cfg.rounds):
        t0 = time.thread_time()
        np.copyto(dst, src)
        copy.append(time.thread_time() - t0)
        for name, p in timed:
            t0 = time.thread_time()
            for _ in range(cfg.repeats):
                p.push()
            cpu[name].append((time.thread_time() - t0) / cfg.repeats)
    bandwidth = 2 * src.nbytes / median(copy)
    rows = []
    for c in cases:
        p = pushers[c.name]
        floor_bytes = 4 * keys * n * (c.reads + c.writes) \
            + (p.push_bytes if c.push == "sign1" else 0) + p.published_bytes()
        floor = floor_bytes / bandwidth
        t = median(cpu[c.name])
        first = cpu.get(f"{c.name} (decoded first)")
        summed = cpu.get(f"{c.name} (summed first)")
        rows.append({"case": c.name, "cpu_ms": t * 1e3, "floor_ms": floor * 1e3,
                     "vs_floor": t / floor, "goal": c.goal, "reads": c.reads,
                     "writes": c.writes, "floor_mb": floor_bytes / 1e6,
                     "decoded_first_ms": None if first is None else median(first) * 1e3,
                     "decoded_first_vs_floor": None if first is None else median(first) / floor,
                     "summed_first_ms": None if summed is None else median(summed) * 1e3,
                     "summed_first_vs_floor": None if summed is None else median(summed) / floor,
                     "rounds_ms": [round(x * 1e3, 2) for x in cpu[c.name]]})
    total = src.nbytes
    del pushers, before
    worker_rows, worker_bandwidth, raw_receive = _workers(cfg, keys, n, src, dst)
    del src, dst  # the scaling runs need the memory
    scaling = _scaling(cfg)
    checks = {f"shard_cpu_vs_floor[{r['case']}]": check(
        round(r["vs_floor"], 3), f"<= {r['goal']:g}", r["vs_floor"] <= r["goal"]) for r in rows}
    checks.update({f"worker_cpu_vs_floor[{r['case']}]": check(
        round(r["vs_floor"], 3), f"<= {r['goal']:g}", r["vs_floor"] <= r["goal"])
        for r in worker_rows})
    # whether libzmq's own receive leaves a raw pull's row room for its goal in this window
    checks.update({f"worker_raw_receive_bound_vs_floor[{r['case']}]": check(
        round(r["raw_receive_bound_vs_floor"], 3), f"<= {r['goal']:g} (is the goal reachable)",
        r["raw_receive_bound_vs_floor"] <= r["goal"])
        for r in worker_rows if r["raw_receive_bound_vs_floor"] is not None})
    rows += worker_rows
    for r in scaling:
        checks[f"threads_{r['threads']}_vs_1[{r['case']}]"] = check(
            round(r["speedup"], 3), ">= 1.7", r["speedup"] >= 1.7)
    notes = (f"{keys} keys x {cfg.key_mib} MiB = {keys * cfg.key_mib} MiB of float32 "
             f"parameters on one shard, one worker (where the case names no more); CPU per "
             f"update (a PUSH of every key from each worker "
             f"through ShardCore.handle), median over {cfg.rounds} rounds of {cfg.repeats} "
             f"pushes, the cases alternated with memcpy; one thread. Floor = (arrays read + "
             f"written) x {keys * n * 4 / 1e6:.1f} MB + push and published code bytes, over the "
             f"memcpy bandwidth measured here ({bandwidth / 1e9:.2f} GB/s read + written, "
             f"np.copyto of {total / MIB:.0f} MiB: {median(copy) * 1e3:.2f} ms). Machine "
             f"busy before the run: {busy:.0%}. The accounting of what each update must touch "
             f"is in bench/kernels.py and docs/benchmarks.md. \"pushes decoded first\": the "
             f"cases whose rule reads the pushed sign1 codes in its update kernel "
             f"(ps.pushcode), timed in the same rounds on a shard that decodes every push "
             f"into the key's scratch array first (the path before 2026-12-06); \"codes "
             f"summed first\": sync with several workers, the step's pushed codes summed into "
             f"the key's array as they arrive instead of in the update's kernel (the path "
             f"before 2026-12-07), the same rounds. Worker rows "
             f"(\"worker: ...\"): CPU per step of a worker's thread (push_pull of every key "
             f"through a real PSClient and Encoder to an in-process shard, wait included; no "
             f"clipping, no weight prediction), floor from the memcpy measured in their own "
             f"rounds ({worker_bandwidth / 1e9:.2f} GB/s); accounting in bench/worker_kernels.py. "
             f"Their rounds also time raw pyzmq receiving the same {keys} messages of "
             f"{cfg.key_mib} MiB into arrays (recv_into over TCP on loopback, the receiving "
             f"thread's CPU): {raw_receive * 1e3:.2f} ms; \"raw receive bound\" is a raw-pull "
             f"row's floor with that receive in place of the pull's memcpy, over the floor "
             f"(the least the row can reach against its floor in this window). "
             f"Thread scaling (the threads_* "
             f"checks): {cfg.scaling_mib} MiB of {cfg.key_mib} MiB keys, wall time per update "
             f"with ServerConfig.threads = 1 and each of {list(cfg.thread_counts)}, and for "
             f"the rows marked (encode) a worker's Encoder.encode of every key with "
             f"EncoderConfig.threads = 1 and each, each case alternated over its rounds with "
             f"np.copyto of the same bytes split the same way (the bound memory bandwidth "
             f"sets on any memory-bound kernel's scaling in that window): "
             + "; ".join(
                 f"{r['case']}, {r['threads']} threads: {r['ms']:.1f} ms against "
                 f"{r['ms_1']:.1f} ms ({r['speedup']:.2f}x; memcpy in the same rounds "
                 f"{r['memcpy_ms']:.1f} against {r['memcpy_ms_1']:.1f} ms, "
                 f"{r['memcpy_speedup']:.2f}x)" for r in scaling) + ".")
    config = {**dataclasses.asdict(cfg), "keys": keys, "memcpy_ms": median(copy) * 1e3,
              "bandwidth_gbps": bandwidth / 1e9, "machine_busy_before": busy,
              "worker_bandwidth_gbps": worker_bandwidth / 1e9,
              "raw_receive_ms": raw_receive * 1e3,
              "scaling": scaling}
    write_results("kernels", config=config, rows=rows, checks=checks, out=out, notes=notes,
                  columns=[("case", "rule, mode, push -> pull"), ("cpu_ms", "CPU ms/update"),
                           ("floor_ms", "floor ms"), ("vs_floor", "vs floor"),
                           ("goal", "goal"), ("reads", "arrays read"),
                           ("writes", "arrays written"), ("floor_mb", "floor MB"),
                           ("decoded_first_ms", "pushes decoded first: CPU ms/update"),
                           ("decoded_first_vs_floor", "pushes decoded first: vs floor"),
                           ("summed_first_ms", "codes summed first: CPU ms/update"),
                           ("summed_first_vs_floor", "codes summed first: vs floor"),
                           ("raw_receive_bound_vs_floor", "raw receive bound: vs floor")])
    return {"rows": rows, "checks": checks}


def _workers(cfg: KernelsBench, keys: int, n: int, src: np.ndarray,
             dst: np.ndarray) -> tuple[list[dict], float]:
    """The worker rows (``bench.worker_kernels``), the memcpy bandwidth of their rounds and
    the median CPU seconds of raw pyzmq's receive of the same bytes in them."""
    cases = [c for c in WORKER_CASES if not cfg.cases or c.name in cfg.cases]
    if not cases:
        return [], 0.0, 0.0

    def copy_round() -> float:
        t0 = time.thread_time()
        np.copyto(dst, src)
        return time.thread_time() - t0

    cpu, floor_bytes, copies, receives = measure(cases, keys, n, cfg.rounds, cfg.repeats,
                                                 copy_round)
    bandwidth = 2 * src.nbytes / median(copies)
    receive, pull_floor = median(receives), 2 * src.nbytes / bandwidth
    rows = []
    for c in cases:
        t, floor = median(cpu[c.name]), floor_bytes[c.name] / bandwidth
        # a raw pull is a receive into the parameters: the floor counts it as a memcpy, libzmq
        # takes what the raw receive took in the same rounds; every other byte at memcpy speed
        bound = (floor - pull_floor + receive) / floor if c.pull == "raw" and not c.onebit \
            else None
        rows.append({"case": c.name, "cpu_ms": t * 1e3, "floor_ms": floor * 1e3,
                     "vs_floor": t / floor, "goal": c.goal, "reads": c.reads,
                     "writes": c.writes, "floor_mb": floor_bytes[c.name] / 1e6,
                     "raw_receive_bound_vs_floor": bound,
                     "rounds_ms": [round(x * 1e3, 2) for x in cpu[c.name]]})
    return rows, bandwidth, receive


def _speedups(name: str, runs: dict, cfg: KernelsBench, bound: dict) -> list[dict]:
    """``runs``: thread count -> a callable doing one update (or encode) with that many
    threads; ``bound``: the same for np.copyto of the same bytes split the same way. All are
    timed ``repeats`` times a round over ``rounds`` rounds, alternated (wall time, medians),
    so the bound is the memory bandwidth of the same window; one row per count above 1: its
    time, one thread's, the speedup (one thread's time over its) and memcpy's in the same
    rounds."""
    timed = {**{("case", t): fn for t, fn in runs.items()},
             **{("memcpy", t): fn for t, fn in bound.items()}}
    for fn in timed.values():
        fn()  # compile, touch every buffer once
    wall: dict[tuple, list[float]] = {k: [] for k in timed}
    for _ in range(cfg.rounds):
        for k, fn in timed.items():
            t0 = time.perf_counter()
            for _ in range(cfg.repeats):
                fn()
            wall[k].append((time.perf_counter() - t0) / cfg.repeats)
    one, copy_one = median(wall["case", 1]), median(wall["memcpy", 1])
    return [{"case": name, "threads": t, "ms": median(wall["case", t]) * 1e3,
             "ms_1": one * 1e3, "speedup": one / median(wall["case", t]),
             "memcpy_ms": median(wall["memcpy", t]) * 1e3, "memcpy_ms_1": copy_one * 1e3,
             "memcpy_speedup": copy_one / median(wall["memcpy", t])}
            for t in runs if t > 1]


def _scaling(cfg: KernelsBench) -> list[dict]:
    """Wall time per update of :data:`SCALING_CASES` at ``scaling_mib`` with one shard thread
    and with each of ``thread_counts``, and per encode of ``worker_kernels``'
    :data:`ENCODER_SCALING_CASES` with as many encoder threads, each beside np.copyto of the
    same keys spread the same way in the same rounds (``native.keypool``: how far memory
    bandwidth lets a memory-bound kernel scale in that window); speedup = one thread's time
    over N threads'."""
    from bitps.native.keypool import KeyPool

    counts = [t for t in cfg.thread_counts if t > 1]
    if not counts:
        return []
    n = cfg.key_mib * MIB // 4
    keys = max(1, cfg.scaling_mib // cfg.key_mib)
    src = np.random.default_rng(2).standard_normal(keys * n).astype(np.float32)
    dst = np.empty_like(src)

    def copy(i: int) -> None:
        np.copyto(dst[i * n:(i + 1) * n], src[i * n:(i + 1) * n])

    pools = {t: KeyPool(t) for t in [1, *counts]}
    bound = {t: functools.partial(p.map, copy, range(keys), src.nbytes)
             for t, p in pools.items()}
    out: list[dict] = []
    try:
        for case in (c for c in CASES if c.name in SCALING_CASES):
            pushers = {t: _Pusher(case, keys, n, threads=t) for t in [1, *counts]}
            out += _speedups(case.name, {t: p.push for t, p in pushers.items()}, cfg, bound)
            del pushers
        for case in (c for c in WORKER_CASES if c.name in ENCODER_SCALING_CASES):
            workers = {t: Worker(case, keys, n, threads=t) for t in [1, *counts]}
            try:
                out += _speedups(f"{case.name} (encode)",
                                 {t: w.encode for t, w in workers.items()}, cfg, bound)
            finally:
                for w in workers.values():
                    w.close()
    finally:
        for p in pools.values():
            p.close()
    return out
