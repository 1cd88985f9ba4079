"""What ``bitps-bench scale`` measures on the emulated cluster (``bench.cluster``): the wire's
costs at a link rate, and measured points (a sync step of real ``bitps-server`` shards and
real ``PSClient`` workers, each process on a node of its own).

A point runs ``steps`` steps of every worker (``bench.scale_rank``) and keeps the ones after
``warmup``: its step time is the median over them of the slowest worker's; over the same
window it reads every process's CPU and the machine's (``/proc/stat``: all cores, the
kernel's network path included), so the CPU the model predicts can be set beside what was
used.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from bitps.bench.cluster import Cluster
from bitps.bench.proc import ReadyProcess, process_cpu
from bitps.bench.report import median
from bitps.bench.scale_model import WireCosts

__all__ = ["Measured", "Scheme", "measure_point", "measure_wire", "measure_wire_cpu"]


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """A codec scheme as the shards and workers run it."""

    name: str
    optimizer: str
    """The shards' rule (``bitps-server --optimizer``)."""
    push_codec: str
    """The workers' push codec (1-bit Adam's shards choose their own)."""


@dataclass(frozen=True)
class Measured:
    """One point: step time, CPU per step (seconds) of each worker, each shard and the
    machine (every core), over the timed steps."""

    step_s: float
    """The median timed step (its slowest worker's): a TCP retransmission timeout or a
    garbage collection now and then moves the mean, not the median."""
    mean_s: float
    encode_s: float
    """The slowest worker's mean wall time in ``push_pull`` (the encode and the sends)."""
    worker_cpu_s: list[float]
    shard_cpu_s: list[float]
    machine_cpu_s: float

    @property
    def other_cpu_s(self) -> float:
        """CPU per step of everything but this point's processes: other work on the machine
        (and what the kernel did outside them)."""
        return self.machine_cpu_s - sum(self.worker_cpu_s) - sum(self.shard_cpu_s)


def _busy_s() -> float:
    """CPU seconds all cores have been busy so far (``/proc/stat``: all but idle and iowait;
    0.0 where it cannot be read)."""
    import os

    try:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class _Window:
    """Marks the timed window from the worker processes' step lines: it opens when every
    worker has logged ``warmup`` steps and closes when every worker has logged ``steps``,
    reading the machine's and the shards' CPU at each end."""

    def __init__(self, workers: int, warmup: int, steps: int, shards: list[ReadyProcess]):
        self.counts, self.warmup, self.steps = [0] * workers, warmup, steps
        self.shards, self.lock = shards, threading.Lock()
        self.marks: dict[str, tuple[float, list[float]]] = {}

    def logged(self, rank: int) -> None:
        with self.lock:
            self.counts[rank] += 1
            for name, at in (("start", self.warmup), ("end", self.steps)):
                if min(self.counts) == at and name not in self.marks:
                    self.marks[name] = (_busy_s(), [process_cpu(p.proc.pid)
                                                     for p in self.shards])


def _shard(node, scheme: Scheme, shard_id: int, shards: int) -> ReadyProcess:
    return ReadyProcess([
        *node.prefix, sys.executable, "-m", "bitps.ps", "--host", node.ip, "--grpc-port", "0",
        "--data-port", "0", "--metrics-port", "-1", "--shard-id", str(shard_id),
        "--num-shards", str(shards),
        # every emulated node shares this machine's cores: one update thread per shard
        "--threads", "1", "--mode", "sync", "--optimizer", scheme.optimizer,
        # 1-bit Adam compresses from the second step on; the warm-up steps are not timed
        "--freeze-step", "1", "--log-level", "WARNING"])


def _ranks(cluster: Cluster, settings: list[dict], window: _Window, timeout_s: float
           ) -> list[list[dict]]:
    """Start one worker per settings on nodes 0, 1, ...; their JSON lines, once all exit."""
    procs, lines, readers = [], [], []
    for rank, s in enumerate(settings):
        node = cluster.nodes[rank]
        procs.append(subprocess.Popen(
            [*node.prefix, sys.executable, "-m", "bitps.bench.scale_rank", json.dumps(s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True))
        lines.append([])

        def read(rank=rank, proc=procs[-1]) -> None:
            for raw in proc.stdout:
                event = json.loads(raw)
                lines[rank].append(event)
                if event["event"] == "step":
                    window.logged(rank)

        readers.append(threading.Thread(target=read, daemon=True))
        readers[-1].start()
    try:
        for rank, proc in enumerate(procs):
            proc.wait(timeout_s)
            if proc.returncode:
                raise RuntimeError(f"worker {rank} exited {proc.returncode}: "
                                   f"{proc.stderr.read()[-3000:]}")
        for r in readers:
            r.join(10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return lines


def _measured(lines: list[list[dict]], window: _Window, warmup: int) -> Measured:
    steps = [[e for e in ls if e["event"] == "step"] for ls in lines]
    timed = len(steps[0]) - warmup
    if timed < 1 or "end" not in window.marks:
        raise RuntimeError(f"workers logged {[len(s) for s in steps]} steps; expected more "
                           f"than the {warmup} warm-up steps")
    first = warmup - 1  # the step before the window: its end is where the window starts
    mean_s = max((s[-1]["end"] - s[first]["end"]) / timed for s in steps)
    step_s = median(max(s[i]["end"] - s[i - 1]["end"] for s in steps)
                    for i in range(warmup, len(steps[0])))
    (busy0, shard0), (busy1, shard1) = window.marks["start"], window.marks["end"]
    encode_s = max(sum(e.get("sent_s", 0.0) for e in s[warmup:]) / timed for s in steps)
    return Measured(step_s=step_s, mean_s=mean_s, encode_s=encode_s,
                    worker_cpu_s=[(s[-1]["cpu"] - s[first]["cpu"]) / timed for s in steps],
                    shard_cpu_s=[(b - a) / timed for a, b in zip(shard0, shard1)],
                    machine_cpu_s=(busy1 - busy0) / timed)


def measure_point(cluster: Cluster, scheme: Scheme, *, workers: int, shards: int, keys: int,
                  n: int, steps: int, warmup: int, timeout_s: float = 600.0) -> Measured:
    """``workers`` workers (nodes 0 ..) over ``shards`` shards (the nodes after the last
    worker node the cluster has room for), each step a push_pull of ``keys`` keys of ``n``
    float32; ``warmup`` steps untimed, then ``steps - warmup`` timed."""
    if not 1 <= warmup < steps:
        raise ValueError(f"warmup {warmup}, steps {steps}: expected 1 <= warmup < steps")
    first_shard = len(cluster.nodes) - shards
    if first_shard < workers:
        raise ValueError(f"{workers} workers and {shards} shards need {workers + shards} "
                         f"nodes; the cluster has {len(cluster.nodes)}")
    procs: list[ReadyProcess] = []
    try:
        for i in range(shards):
            procs.append(_shard(cluster.nodes[first_shard + i], scheme, i, shards))
        servers = [f"{cluster.nodes[first_shard + i].ip}:{p.ready['grpc_port']}"
                   for i, p in enumerate(procs)]
        window = _Window(workers, warmup, steps, procs)
        settings = [{"servers": servers, "rank": r, "world": workers, "keys": keys, "n": n,
                     "codec": scheme.push_codec, "steps": steps} for r in range(workers)]
        lines = _ranks(cluster, settings, window, timeout_s)
    finally:
        for p in procs:
            p.stop()
    return _measured(lines, window, warmup)


def _echo(cluster: Cluster, *, clients: int, keys: int, size: int, rounds: int
          ) -> tuple[list[list[dict]], Measured]:
    """``clients`` sync echo clients (nodes ``0 ..``) against the peer on the last node, each
    ``rounds`` rounds (one untimed first) of ``keys`` messages of ``size`` bytes."""
    node = cluster.nodes[-1]
    peer = ReadyProcess([*node.prefix, sys.executable, "-m", "bitps.bench.scale_rank",
                         json.dumps({"serve": True, "host": node.ip, "peers": clients})])
    try:
        window = _Window(clients, 1, rounds + 1, [])
        lines = _ranks(cluster, [{"echo": True, "keys": keys, "n": max(1, size // 4),
                                  "servers": [f"{node.ip}:{peer.ready['port']}"],
                                  "steps": rounds + 1}] * clients, window, 600.0)
    finally:
        peer.stop()
    return lines, _measured(lines, window, 1)


def measure_wire(cluster: Cluster, *, key_bytes: int, echo_keys: int, flows: tuple[int, ...],
                 message_sizes: tuple[int, ...], rounds: int, tiny_steps: int) -> WireCosts:
    """The link's costs, from a sync echo (``bench.scale_rank``'s peer on the last node: the
    same messages and the same wait for every client as a sync shard, no PS work): for each
    count ``k`` of ``flows``, ``k`` clients each sending ``echo_keys`` messages of
    ``key_bytes`` per round as a worker pushes its keys (the payload rate of the ``k`` flows
    through the peer's port over the link's rate); then the CPU (:func:`measure_wire_cpu`),
    whose small push_pulls also give the round trip."""
    rate_bps = _rate_bps(cluster.rate) if cluster.kind == "netns" else float("inf")
    efficiency = {}
    for k in flows:
        lines, _ = _echo(cluster, clients=k, keys=echo_keys, size=key_bytes, rounds=rounds)
        # the messages after the first answer came back: both ways busy, without the first
        # message's way there and the last one's way back; every flow waits for the slowest
        streaming_s = max(median(e["end"] - e["first"] for e in ls if e["event"] == "step")
                          for ls in lines)
        efficiency[k] = (k * (echo_keys - 1) * key_bytes * 8 / streaming_s / rate_bps
                         if cluster.kind == "netns" and echo_keys > 1 else 1.0)
    cpu, round_trip = measure_wire_cpu(cluster, echo_keys=echo_keys, message_sizes=message_sizes,
                                       rounds=rounds, tiny_steps=tiny_steps)
    return WireCosts(rate_bps=rate_bps, efficiency=efficiency, round_trip=round_trip, **cpu)


def measure_wire_cpu(cluster: Cluster, *, echo_keys: int, message_sizes: tuple[int, ...],
                     rounds: int, tiny_steps: int) -> tuple[dict[str, object], float]:
    """The wire's CPU, the part of :class:`WireCosts` that moves with the machine's speed (so
    ``bitps-bench scale`` measures it again beside every point): for each of
    ``message_sizes``, one echo client (the machine's CPU per byte that crosses, beyond the
    CPU of as many 1 KiB messages: a slow link delivers a message's packets one by one, and
    its receivers wake for each); then ``tiny_steps`` push_pulls of one 1 KiB key through a
    real shard (the CPU of a message, the shard's and the worker's shares). Returns those
    fields of :class:`WireCosts` and the small push_pull's round trip."""
    def cpu_per_message(size: int) -> float:
        # enough rounds for the CPU counters' 10 ms ticks to resolve it
        many = max(rounds, min(400, (64 << 20) // (echo_keys * size)))
        return _echo(cluster, clients=1, keys=echo_keys, size=size, rounds=many)[1] \
            .machine_cpu_s / echo_keys

    small = cpu_per_message(1024)
    cpu_per_byte = {size: max(0.0, cpu_per_message(size) - small) / (2 * size)
                    for size in message_sizes}
    fp32 = Scheme(name="fp32", optimizer="adam", push_codec="raw")
    tiny = measure_point(cluster, fp32, workers=1, shards=1, keys=1, n=256, steps=tiny_steps,
                         warmup=max(2, tiny_steps // 10))
    return {"cpu_per_byte": cpu_per_byte, "message_cpu": tiny.machine_cpu_s,
            "shard_message_cpu": tiny.shard_cpu_s[0],
            "worker_message_cpu": tiny.worker_cpu_s[0]}, tiny.step_s


def _rate_bps(rate: str) -> float:
    """``1gbit`` -> 1e9: tc's rate units (bit/s, decimal prefixes)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                return float(rate[:-len(unit)]) * scale
            except ValueError:
                break
    raise ValueError(f"link rate {rate!r}; expected a number and gbit, mbit, kbit or bit")

