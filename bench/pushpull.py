"""``bitps-bench pushpull``: push+pull throughput and small-message round trip against raw pyzmq.

One worker (this process, a real :class:`bitps.worker.PSClient`), one shard (a real ``bitps-server``
process, ``async`` mode, ``sgd`` rule), loopback TCP. Each iteration pushes a float32 gradient of
the payload size and pulls the updated parameters back (``push_pull``): 2 x payload bytes move.
In the same run, a raw pyzmq DEALER/ROUTER pair (``bench.rawzmq``, another process) moves the same
bytes both ways in frames of the same size, with no PS logic, and for one-key payloads the floor
(``bench.floor``) does only the work a push+pull cannot skip. Rounds alternate between them so
machine noise hits all alike; medians are reported, and ratios bitps / raw (and floor / raw).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import zmq

from bitps.bench.config import PushPullBench
from bitps.bench.floor import FloorClient
from bitps.bench.proc import ReadyProcess, process_run_s
from bitps.bench.report import check, median, write_results
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.worker.config import ClientConfig
from bitps.worker.transport.client import PSClient

__all__ = ["run"]

MIB = 1 << 20


class _Raw:
    """Raw pyzmq DEALER side: sends frames zero-copy, receives the reply frames."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def round_trip(self, frames: list[np.ndarray]) -> None:
        self.sock.send_multipart(frames, copy=False)
        self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class _Bitps:
    """A registered PSClient over a one-tensor model of ``nbytes``."""

    def __init__(self, grpc_port: int, nbytes: int, partition_bytes: int) -> None:
        n = nbytes // 4
        self.plan = make_plan([ParamSpec("w", (n,))], num_shards=1,
                              partition_bytes=partition_bytes)
        self.client = PSClient(ClientConfig(servers=(f"127.0.0.1:{grpc_port}",),
                                            partition_bytes=partition_bytes))
        flat = np.zeros(n, np.float32)
        views = [flat[k.offset:k.offset + k.length] for k in self.plan.keys]
        self.client.register(self.plan, {k.key: v for k, v in zip(self.plan.keys, views)})
        self.keys = [k.key for k in self.plan.keys]
        grads = np.full(n, 1e-6, np.float32)
        self.grads = [grads[k.offset:k.offset + k.length] for k in self.plan.keys]
        self.outs = [np.empty(k.length, np.float32) for k in self.plan.keys]
        self.clock = 0

    def round_trip(self) -> None:
        self.client.push_pull(self.keys, self.grads, self.outs, clock=self.clock).wait()
        self.clock += 1

    def frames(self) -> list[np.ndarray]:
        """The same bytes in the same frame sizes, for the raw peer."""
        return [g.copy() for g in self.grads]

    def close(self) -> None:
        self.client.close()


def _fresh(old: ReadyProcess | None, argv: list[str]) -> ReadyProcess:
    if old is not None:
        old.stop()
    return ReadyProcess(argv)


def _compare(ps: _Bitps, raw_round_trip, iters: int, rounds: int, floor=None):
    """Alternate rounds of raw, bitps and (when given) floor round trips; returns all bitps
    times, all raw times, all floor times and each round's throughput ratios (raw median time /
    bitps median time, and the same for the floor), so slow drifts of the machine hit every
    side of a ratio alike."""
    frames = ps.frames()
    warm = max(2, iters // 4)
    _time(ps.round_trip, warm)
    _time(partial(raw_round_trip, frames), warm)
    if floor is not None:
        _time(floor.round_trip, warm)
    t_ps, t_raw, t_floor, ratios, floor_ratios = [], [], [], [], []
    for _ in range(rounds):
        r = _time(partial(raw_round_trip, frames), iters)
        b = _time(ps.round_trip, iters)
        t_raw += r
        t_ps += b
        ratios.append(median(r) / median(b))
        if floor is not None:
            f = _time(floor.round_trip, iters)
            t_floor += f
            floor_ratios.append(median(r) / median(f))
    return t_ps, t_raw, t_floor, ratios, floor_ratios


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


_SHARD = ["-m", "bitps.ps", "--mode", "async", "--optimizer", "sgd", "--lr", "1e-3",
          "--metrics-port", "-1"]
_NOTES = ("bitps: `PSClient.push_pull` of all keys to one `bitps-server` process (async, sgd, "
          "default key plan and message size); raw: pyzmq DEALER -> ROUTER echo of the same "
          "bytes in the same frames, zero-copy, preallocated replies. GB/s counts bytes both "
          "ways (2 x payload) per round trip. ratio = median over alternating rounds of "
          "bitps / raw throughput (round trip: bitps / raw time); ms = medians of all samples. "
          "floor: `bench.floor`, a shard and client of a few lines each doing only the work "
          "one key's push+pull cannot skip (protobuf header, zero-copy send, NaN check + SGD, "
          "copy of the reply into the caller's buffer), alternating with the same rounds; "
          "floor ratio = raw / floor time. Where the floor misses a goal, the work itself "
          "does on this machine. idle: the last case's shard process, its client gone, its "
          "CPU (/proc/PID/task/*/schedstat, all threads) over idle_s seconds.")
_COLUMNS = [("case", "case"), ("frames", "frames"), ("bitps_ms", "bitps ms"),
            ("raw_ms", "raw pyzmq ms"), ("bitps_GBps", "bitps GB/s"),
            ("raw_GBps", "raw GB/s"), ("ratio", "ratio"),
            ("floor_ms", "floor ms"), ("floor_ratio", "floor ratio"),
            ("samples", "samples"), ("idle_cpu_ms_per_s", "idle CPU ms/s")]


def run(cfg: PushPullBench | None = None, *, out: Path | None = None) -> dict:
    """Run the scenario (``None``: the defaults), write ``pushpull.json``/``.md`` under
    ``out``, return the document."""
    cfg = (cfg or PushPullBench()).sized()
    py = sys.executable
    raw_peer = ReadyProcess([py, "-m", "bitps.bench.rawzmq"])
    raw = _Raw(raw_peer.ready["port"])
    rows, checks, shard, floor_peer = [], {}, None, None
    cases = [(f"push+pull {mib:g} MiB", int(mib * MIB)) for mib in cfg.sizes_mib]
    cases.append((f"round trip {cfg.small_bytes} B", cfg.small_bytes))
    try:
        floor_peer = ReadyProcess([py, "-m", "bitps.bench.floor"])
        for case, nbytes in cases:
            shard = _fresh(shard, [py, *_SHARD])  # a shard holds one model: a new one per case
            row, name, goal = _case(cfg, case, nbytes, shard.ready["grpc_port"],
                                    floor_peer.ready["port"], raw)
            rows.append(row)
            checks[name] = goal
        if cfg.idle_s > 0:
            row, goal = _idle(shard, cfg.idle_s)
            rows.append(row)
            checks["idle_shard_cpu_ms_per_s"] = goal
    finally:
        raw.close()
        raw_peer.stop()
        if floor_peer is not None:
            floor_peer.stop()
        if shard is not None:
            shard.stop()
    config = {"sizes_mib": list(cfg.sizes_mib), "rounds": cfg.rounds,
              "small_bytes": cfg.small_bytes, "partition_bytes": cfg.partition_bytes,
              "mode": "async", "optimizer": "sgd", "transport": "tcp loopback",
              "quick": cfg.quick}
    write_results("pushpull", config=config, rows=rows, checks=checks, out=out, notes=_NOTES,
                  columns=_COLUMNS)
    return {"rows": rows, "checks": checks}


def _idle(shard: ReadyProcess, seconds: float) -> tuple[dict, dict]:
    """The CPU a shard process uses with nothing to do (its client gone), over ``seconds``:
    what a shard costs the machine between a job's steps, its timers' wake-ups
    (``ps.data._TICK_S``) and the gRPC server's."""
    time.sleep(0.5)  # the last case's client closes; its connection's teardown is not idle
    pid = shard.proc.pid
    t0, cpu0 = time.monotonic(), process_run_s(pid)
    time.sleep(seconds)
    ms_per_s = (process_run_s(pid) - cpu0) * 1e3 / (time.monotonic() - t0)
    row = {"case": f"idle shard, {seconds:g} s", "idle_cpu_ms_per_s": ms_per_s}
    return row, check(round(ms_per_s, 2), "<= 10 (ms of CPU a second: 1 % of a core)",
                      ms_per_s <= 10)


def _iters(nbytes: int, small: bool, quick: bool) -> int:
    if quick:
        return 20 if small else 3
    # About 0.1-0.3 s per side and round: short rounds let one burst of machine noise decide
    # a ratio.
    return 200 if small else max(4, min(100, int(256 * MIB / nbytes)))


def _case(cfg: PushPullBench, case: str, nbytes: int, grpc_port: int, floor_port: int,
          raw: _Raw) -> tuple[dict, str, dict]:
    """One payload: bitps, raw pyzmq and (one key) the floor in alternating rounds; its row,
    and its check's name and result."""
    small = nbytes == cfg.small_bytes
    ps = _Bitps(grpc_port, nbytes, cfg.partition_bytes)
    # The floor speaks for one key: it runs where bitps sends a single frame.
    floor = FloorClient(floor_port, ps.grads[0]) if len(ps.grads) == 1 and not small else None
    t_ps, t_raw, t_floor, ratios, floor_ratios = _compare(
        ps, raw.round_trip, _iters(nbytes, small, cfg.quick), cfg.rounds, floor)
    ps.close()
    row = {"case": case, "payload_bytes": nbytes, "frames": len(ps.grads),
           "bitps_ms": median(t_ps) * 1e3, "raw_ms": median(t_raw) * 1e3, "samples": len(t_ps)}
    if floor is not None:
        floor.close()
        row.update(floor_ms=median(t_floor) * 1e3, floor_ratio=median(floor_ratios))
    if small:
        # Time ratio bitps / raw, the median over rounds measured side by side.
        ratio = median(1 / r for r in ratios)
        row["ratio"] = ratio
        return row, "small_round_trip_vs_raw", check(round(ratio, 3), "<= 2.0 (time ratio)",
                                                      ratio <= 2.0)
    ratio = median(ratios)
    row.update(bitps_GBps=2 * nbytes / median(t_ps) / 1e9,
               raw_GBps=2 * nbytes / median(t_raw) / 1e9, ratio=ratio)
    return row, f"throughput_{nbytes / MIB:g}MiB_vs_raw", check(round(ratio, 3), ">= 0.8",
                                                                 ratio >= 0.8)
