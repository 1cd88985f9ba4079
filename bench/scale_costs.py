"""The per-byte costs of ``bitps-bench scale``'s model, measured in this process with the
``bitps-bench kernels`` harness, and the wire sizes of each scheme from its codecs.

- **Shard**: ``ShardCore.handle`` of a sync step (``bench.kernels._Pusher``: every worker's
  PUSH of every key, one message per key as keys of a full partition travel), one thread, CPU
  time per step at several worker counts; a line ``a + b W`` through them (least squares) gives
  the part that does not grow with the workers (the rule's update, the published code) and
  the part each push adds (validation, decode, the sum).
- **Worker**: a real ``PSClient`` and ``Encoder`` against an in-process shard
  (``bench.worker_kernels.Worker``), CPU time of the worker's thread split at the moment
  ``push_pull`` returns: before, the encode (the push is then on its way); after, ``wait()``
  (receiving the pulls into the worker's copy, decoding codes).
- **Per message, in process**: the same two harnesses on one 1 KiB key, so the cluster's
  small-message costs (``bench.scale_cluster.measure_wire``) can be counted beyond what these
  per-key measurements already hold.

Rounds alternate the schemes (medians of the rounds' means of 3 steps), as ``bitps-bench
kernels`` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bitps.bench.kernels import CASES, Case, _Pusher
from bitps.bench.report import median
from bitps.bench.scale_cluster import Scheme
from bitps.bench.scale_model import SchemeCosts, WireCosts
from bitps.bench.worker_kernels import WORKER_CASES, Worker, WorkerCase

__all__ = ["SCHEMES", "Measures", "beyond", "measure_contention", "measure_costs", "per_message",
           "wire_sizes"]

TINY = 256
"""Elements of the one key the per-message measurements push (1 KiB)."""
_REPEATS = 3
"""Steps per round of each in-process measurement; a round's figure is their mean."""


@dataclass(frozen=True)
class Measures:
    """How one scheme is measured: on the cluster, by the shard harness and by the worker
    harness."""

    scheme: Scheme
    shard: Case
    worker: WorkerCase


def _case(cases, name):
    return next(c for c in cases if c.name == name)


SCHEMES = {
    "fp32": Measures(Scheme(name="fp32", optimizer="adam", push_codec="raw"),
                     _case(CASES, "adam, sync, raw -> raw"),
                     _case(WORKER_CASES, "worker: sync fp32 (adam, raw -> raw)")),
    "sign1": Measures(Scheme(name="sign1", optimizer="adam", push_codec="sign1"),
                      Case(name="adam, sync, sign1 -> sign1", optimizer="adam", mode="sync",
                           push="sign1", pull="sign1", reads=4, writes=4),
                      WorkerCase(name="worker: adam, sync, sign1 -> sign1", mode="sync",
                                 push="sign1", pull="sign1", reads=3, writes=2)),
    "onebit": Measures(Scheme(name="1-bit Adam", optimizer="onebit_adam", push_codec="sign1"),
                       _case(CASES, "1-bit Adam, sync"),
                       _case(WORKER_CASES, "worker: 1-bit Adam, sync")),
}
"""The schemes the bench measures and models: fp32 Adam; Adam with sign1 pushes and pulls
(error feedback on both sides); sync 1-bit Adam (compressed phase)."""


def _codecs(name: str):
    """``(push codec, pull codec)`` of scheme ``name``, as the workers and shards make them."""
    from bitps.proto.codecs import RAW, Codec, CodecConfig
    from bitps.ps.config import OptimizerConfig, ServerConfig
    from bitps.ps.onebit import OneBitConfig, published_codec

    if name == "fp32":
        return RAW, RAW
    if name == "onebit":  # the shard's codec, which its workers push and it publishes
        codec = published_codec(ServerConfig(mode="sync", optimizer=OptimizerConfig(
            name="onebit_adam", rule_config=OneBitConfig())))
        return codec, codec
    codec = Codec.from_config(CodecConfig(name=SCHEMES[name].scheme.push_codec))
    return codec, codec  # the pull codec defaults to the push codec's


def wire_sizes(name: str, n: int) -> tuple[float, float]:
    """Bytes on the wire per float32 byte, pushed and pulled, for keys of ``n`` elements
    (``Codec.max_bytes``: exact for raw and sign1)."""
    push, pull = _codecs(name)
    return push.max_bytes(n) / (4 * n), pull.max_bytes(n) / (4 * n)


def _shard_pushers(m: Measures, name: str, keys: int, n: int, workers: tuple[int, ...]):
    chunk = _codecs(name)[0].chunk if m.shard.push != "raw" else 0
    return {w: _Pusher(m.shard, keys, n, workers=w, per_key=True, chunk=chunk)
            for w in workers}


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``a + b x`` with ``b >= 0``: a push cannot cost
    less than nothing, so a falling line (noise between close points) is the flat one
    through their mean. One point: split evenly between the two."""
    if len(set(xs)) < 2:
        return ys[0] / (1 + xs[0]), ys[0] / (1 + xs[0])
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    if b < 0:
        return float(np.mean(ys)), 0.0
    return float(a), float(b)


def measure_costs(names: tuple[str, ...], *, keys: int, n: int, workers: tuple[int, ...],
                  rounds: int) -> tuple[dict[str, SchemeCosts], dict[str, dict]]:
    """Each scheme's :class:`SchemeCosts` over ``keys`` keys of ``n`` float32, the shard
    measured at each of ``workers``; and the raw figures (ms per step) for the results."""
    import numba

    numba.set_num_threads(1)
    nbytes = 4 * keys * n
    shard = {name: _shard_pushers(SCHEMES[name], name, keys, n, workers) for name in names}
    shard_cpu = {(name, w): [] for name in names for w in workers}
    for pushers in shard.values():
        for p in pushers.values():
            p.push()  # compile, touch every buffer once
    for _ in range(rounds):
        for name, pushers in shard.items():
            for w, p in pushers.items():
                t0 = time.thread_time()
                for _ in range(_REPEATS):
                    p.push()
                shard_cpu[name, w].append((time.thread_time() - t0) / _REPEATS)
    del shard
    enc, app = _worker_cpu(names, keys, n, rounds)
    costs, raw = {}, {}
    for name in names:
        per_step = [median(shard_cpu[name, w]) for w in workers]
        a, b = _line(list(workers), per_step)
        push, pull = wire_sizes(name, n)
        costs[name] = SchemeCosts(shard_fixed=a / nbytes, shard_per_push=b / nbytes,
                                  encode=median(enc[name]) / nbytes,
                                  apply=median(app[name]) / nbytes, push_bytes=push,
                                  pull_bytes=pull)
        raw[name] = {"shard_ms": {str(w): round(t * 1e3, 2) for w, t in zip(workers, per_step)},
                     "shard_fit_ms": [round(a * 1e3, 2), round(b * 1e3, 2)],
                     "encode_ms": round(median(enc[name]) * 1e3, 2),
                     "apply_ms": round(median(app[name]) * 1e3, 2)}
    return costs, raw


def _contended(name: str, keys: int, n: int, pushes: int, start, out) -> None:
    """A child of :func:`measure_contention`: one shard's pushes of scheme ``name``, timed
    once every child is ready (``start``); the median CPU time of a push goes to ``out`` (CPU
    time: it grows with the stalls on memory the others cause, not with waits for a core)."""
    import numba

    numba.set_num_threads(1)
    p = _shard_pushers(SCHEMES[name], name, keys, n, (1,))[1]
    p.push()
    start.wait()
    times = []
    for _ in range(pushes):
        t0 = time.thread_time()
        p.push()
        times.append(time.thread_time() - t0)
    out.send(median(times))


def measure_contention(names, *, keys: int, n: int, cores: int,
                       rounds: int) -> dict[str, float]:
    """Per scheme, how much longer a shard's step takes while ``cores`` processes run it at
    once than in one alone (:attr:`SchemeCosts.contention`): memory bandwidth and the last
    level cache are the cores' to share. 1.0 with one core."""
    import multiprocessing

    if cores < 2:
        return {name: 1.0 for name in names}
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads running

    def run(name: str, procs: int) -> float:
        start, pipes = ctx.Barrier(procs), [ctx.Pipe(duplex=False) for _ in range(procs)]
        children = [ctx.Process(target=_contended, args=(name, keys, n, max(5, rounds), start,
                                                         tx)) for _, tx in pipes]
        for c in children:
            c.start()
        for _, tx in pipes:
            tx.close()  # a child's end only: its death then reads as EOF here, not a hang
        try:
            return max(rx.recv() for rx, _ in pipes)
        except EOFError:
            for c in children:
                c.join(10)
            raise RuntimeError(f"contention of {name!r}: a child exited without its figure "
                               f"(exit codes {[c.exitcode for c in children]}; expected "
                               f"every one to report)") from None
        finally:
            for c in children:
                c.join(60)
                if c.is_alive():
                    c.kill()

    return {name: max(1.0, run(name, cores) / run(name, 1)) for name in names}


def _worker_cpu(names, keys: int, n: int, rounds: int):
    """Per scheme, the worker thread's CPU per step before ``push_pull`` returns and in
    ``wait()``, each round's."""
    workers = {name: Worker(SCHEMES[name].worker, keys, n) for name in names}
    enc: dict[str, list[float]] = {name: [] for name in names}
    app: dict[str, list[float]] = {name: [] for name in names}
    try:
        for w in workers.values():
            _step(w)  # compile, touch every buffer once
        for _ in range(rounds):
            for name, w in workers.items():
                steps = [_step(w) for _ in range(_REPEATS)]
                enc[name].append(sum(e for e, _ in steps) / _REPEATS)
                app[name].append(sum(a for _, a in steps) / _REPEATS)
    finally:
        for w in workers.values():
            w.close()
    return enc, app


def _step(w: Worker) -> tuple[float, float]:
    """One step of ``w``: its thread's CPU in ``push_pull`` (the encode and the sends) and in
    ``wait()``."""
    t0 = time.thread_time()
    handle = w.encoder.push_pull(w.keys, w.grads, w.outs, clock=w.clock)
    t1 = time.thread_time()
    handle.wait()
    t2 = time.thread_time()
    w.clock += 1
    w.client.clock = w.clock
    return t1 - t0, t2 - t1


def per_message(rounds: int) -> tuple[float, float]:
    """CPU of one small (1 KiB) fp32 message in the two harnesses: the shard's ``handle`` and
    the worker thread's step. What the cluster's small-message costs hold beyond these is the
    rest of the processes' per-message work (receive loops, ZeroMQ's I/O threads)."""
    m = SCHEMES["fp32"]
    p = _Pusher(m.shard, 1, TINY)
    w = Worker(m.worker, 1, TINY)
    try:
        repeats = 200
        shard, worker = [], []
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(repeats):
                p.push()
            shard.append((time.thread_time() - t0) / repeats)
            t0 = time.thread_time()
            for _ in range(repeats):
                w.step()
            worker.append((time.thread_time() - t0) / repeats)
    finally:
        w.close()
    return median(shard), median(worker)


def beyond(wire: WireCosts, shard_handle: float, worker_thread: float) -> WireCosts:
    """``wire`` with its processes' per-message CPU less what the per-key harnesses already
    count (never below 0): the model adds these per message on top of the per-byte costs."""
    from dataclasses import replace

    return replace(wire, shard_message_cpu=max(0.0, wire.shard_message_cpu - shard_handle),
                   worker_message_cpu=max(0.0, wire.worker_message_cpu - worker_thread),
                   message_cpu=max(0.0, wire.message_cpu - shard_handle - worker_thread))
