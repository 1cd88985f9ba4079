"""The scale model of ``bitps-bench scale``: a sync step's time as a function of workers, shards,
model size, codec and link speed, from per-byte and per-message costs measured on this machine
(``bench.scale_costs``). Pure arithmetic: no sockets, no processes.

    costs = SchemeCosts(shard_fixed=..., shard_per_push=..., encode=..., apply=...,
                        push_bytes=1.0, pull_bytes=1.0)
    wire = WireCosts(rate_bps=1e9, efficiency={1: 0.95}, cpu_per_byte={1 << 20: ...},
                     message_cpu=..., shard_message_cpu=..., worker_message_cpu=...,
                     round_trip=...)
    step_time(costs, wire, Machines(shared_cores=2), workers=4, shards=2,
              model_bytes=32 << 20, key_bytes=1 << 20).seconds

The formula is :func:`step_time`'s docstring; docs/benchmarks.md shows it with the measured
points it was checked against and the extrapolation to the 30 B-parameter model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["MESSAGE_BYTES", "Machines", "Prediction", "SchemeCosts", "WireCosts",
           "message_counts", "shards_needed", "step_time"]


@dataclass(frozen=True, kw_only=True)
class SchemeCosts:
    """What one codec scheme costs per float32 byte of the key set (seconds of one core per
    byte; wire sizes as bytes per float32 byte)."""

    shard_fixed: float
    """a: shard CPU per byte of its keys per step that does not grow with the workers (the
    rule's update and the published code)."""
    shard_per_push: float
    """b: shard CPU per byte of its keys per worker's push (validation, decode, aggregate)."""
    encode: float
    """e: a worker's CPU per byte before its push leaves (the codec's encode with error
    feedback; 0 for raw pushes, which go out of the gradient itself)."""
    apply: float
    """d: a worker's CPU per byte after (receiving the pull into its copy, decoding codes)."""
    push_bytes: float
    """Bytes on the wire per float32 byte pushed (1.0 raw; sign1 1/32 + its scales)."""
    pull_bytes: float
    """Bytes on the wire per float32 byte pulled."""
    contention: float = 1.0
    """How much longer the shard's work takes while every core of the machine runs it at
    once (memory bandwidth and caches are shared): the measured ratio of a step's time in
    as many concurrent processes as cores to one alone."""


@dataclass(frozen=True, kw_only=True)
class WireCosts:
    """One link rate's costs, measured on the emulated cluster."""

    rate_bps: float
    """The link's rate, each way (bits per second)."""
    efficiency: dict[int, float]
    """Payload throughput over the rate (framing, TCP/IP headers, acks both ways, and the
    losses of flows that share a port: a sync step waits for the slowest) by the number of
    flows through the busier port, as measured; a count between two measured ones takes the
    lower count's."""
    cpu_per_byte: dict[int, float]
    """Machine CPU (every core: both ends' processes and the kernel) per payload byte that
    crosses a link, beyond the messages' own (:attr:`message_cpu`), by message size as
    measured; another size takes the nearest measured one's (by ratio)."""
    message_cpu: float
    """Machine CPU per message round trip beyond its bytes (a small push_pull through a real
    shard: both processes, their ZeroMQ I/O threads and the kernel)."""
    shard_message_cpu: float
    """The shard process's share of :attr:`message_cpu`: its receive loop runs on one thread."""
    worker_message_cpu: float
    """The worker process's share of :attr:`message_cpu`."""
    round_trip: float
    """Wall time of a small push_pull: what the first key in and the last key out wait."""

    def cpu_per_byte_at(self, message_bytes: float) -> float:
        """:attr:`cpu_per_byte` for messages of ``message_bytes``."""
        near = min(self.cpu_per_byte, key=lambda s: abs(math.log(s / max(message_bytes, 1))))
        return self.cpu_per_byte[near]

    def efficiency_at(self, flows: int) -> float:
        """:attr:`efficiency` for ``flows`` flows through a port."""
        known = [k for k in self.efficiency if k <= flows] or [min(self.efficiency)]
        return self.efficiency[max(known)]


@dataclass(frozen=True, kw_only=True)
class Machines:
    """Where the processes run."""

    shared_cores: int = 0
    """Every worker and shard shares this many cores (the emulated cluster on one machine):
    all CPU work of a step, the kernel's included, is one more term over them. 0: one machine
    per worker and per shard."""
    shard_cores: int = 1
    """Cores a shard's update may use (``bitps-server --threads``)."""
    core_bandwidth: float = 0.0
    """Memory bandwidth one core reaches (bytes/s, memcpy read + written), and ..."""
    machine_bandwidth: float = 0.0
    """... the shard machine's (bytes/s): the update is memory-bound, so its threads speed it
    up by at most ``machine_bandwidth / core_bandwidth``, whatever the cores (0: no cap)."""

    def slowdown(self, busy: float, contention: float) -> float:
        """The factor work takes longer by while ``busy`` of the shared cores work at once:
        1 with one, ``contention`` with all, in between in proportion."""
        if self.shared_cores <= 1:
            return 1.0
        n = min(max(busy, 1.0), self.shared_cores)
        return 1 + (contention - 1) * (n - 1) / (self.shared_cores - 1)

    @property
    def shard_speedup(self) -> float:
        """How much faster a shard's update runs on its cores than on one."""
        if self.core_bandwidth > 0 and self.machine_bandwidth > 0:
            return max(1.0, min(self.shard_cores, self.machine_bandwidth / self.core_bandwidth))
        return float(self.shard_cores)


@dataclass(frozen=True)
class Prediction:
    """A predicted step and the terms it is made of (seconds)."""

    seconds: float
    bottleneck: str
    """The largest pipelined term: what a faster resource of that kind would shorten."""
    terms: dict[str, float] = field(default_factory=dict)


MESSAGE_BYTES = 256 << 10
"""``ClientConfig.message_bytes``'s default: the wire bytes a worker batches keys up to."""


def message_counts(c: SchemeCosts, *, keys: float, shards: int, key_bytes: float,
             message_bytes: float = MESSAGE_BYTES) -> tuple[int, int]:
    """The messages a worker sends per step for ``keys`` keys of ``key_bytes`` spread evenly
    over ``shards`` shards: ``(to the busiest shard, to all)``. The client batches a shard's
    keys up to ``message_bytes`` on the wire, each key counting the larger of its push and its
    reply (``worker.transport.messages``), at least one key a message: a 1 MiB key travels
    alone raw and seven to a message as a sign1 code."""
    per = max(1, math.floor(message_bytes / (max(c.push_bytes, c.pull_bytes) * key_bytes)))
    q, r = divmod(max(1, math.ceil(keys)), shards)  # r shards hold q + 1 keys, the rest q
    busiest = math.ceil((q + (r > 0)) / per)
    return busiest, r * math.ceil((q + 1) / per) + (shards - r) * math.ceil(q / per)


def step_time(c: SchemeCosts, w: WireCosts, m: Machines, *, workers: int, shards: int,
              model_bytes: float, key_bytes: float,
              message_bytes: float = MESSAGE_BYTES) -> Prediction:
    """One sync step of ``workers`` workers over ``shards`` shards: every worker pushes every
    key of a ``model_bytes`` float32 key set (keys of ``key_bytes``) and pulls it back. With
    ``B`` the key set's bytes, ``W`` workers, ``S`` shards, ``K = B / key_bytes`` keys,
    ``M`` and ``N`` the messages a worker sends the busiest shard and all of them
    (:func:`message_counts`: the keys batched up to ``message_bytes`` on the wire), ``L_k``
    the link's payload rate with ``k`` flows through the busier port (``efficiency(k) x rate /
    8``)::

        T = encode + max(pipeline, machine CPU)

        encode     = e B                         (each worker, before its first key leaves)
        pipeline   = max(push link, pull link, shard, worker) + fill
          push link = p B max(1 / L_S, W / (S L_W))  (the busier end: a worker's NIC out,
                                                      S flows, or a shard's NIC in, W flows)
          pull link = q B max(1 / L_S, W / (S L_W))
          shard     = (a + b W) B / S / speedup + m_s W M   (a shard's update thread)
          worker    = d B + m_w N                (a worker's receive and decode)
          fill      = round trip + (sum of the four - the largest) / M

    and where the processes share ``C`` cores (the emulated cluster; with a machine of its own
    per process these terms drop out)::

        Y          = (a + b W) B + W d B          (the kernels' CPU, measured in process)
        Z          = W (p c_p + q c_q) B + m W N    (the wire's and the messages' CPU, measured
                                                   on the cluster, both ends at once)
        machine CPU = (k(C) Y + Z) / C
        encode     = e B max(1, W / C) k(min(W, C))
        shard, worker: their kernels' part x k(u), u = (Y + Z) / max(the slowest of the
                   four, (Y + Z) / C)
        shard     += worker x max(0, (W + S) / C - 1)
        k(n)       = 1 + (kappa - 1) (n - 1) / (C - 1)

    (``a``, ``b``, ``e``, ``d``, ``p``, ``q``, ``kappa``: :class:`SchemeCosts`; ``c_p``,
    ``c_q`` (the CPU per byte of messages of ``p`` and ``q`` key bytes), ``m``, ``m_s``,
    ``m_w``: :class:`WireCosts`; ``speedup``: :class:`Machines`.) Why this shape: a
    sync worker encodes every key before it sends the first, and waits for the last pull
    before it encodes again, so the encode is serial; the messages then stream through the
    links, the shard and the worker's receive as a pipeline (a shard updates a message's keys
    and answers every worker as soon as all pushed them, while the next message arrives),
    whose time is its slowest stage's plus one message's way through the others (the first in,
    the last out); every message costs CPU of its own on both ends beyond its bytes (wake-ups,
    the receive loops, ZeroMQ), which is why ``M`` and not ``K`` counts it. ``W / S``: each
    shard takes every worker's share of its keys (the plan spreads them evenly); with fewer
    workers than shards a worker's own NIC is the busier end. On one
    machine every process and the kernel's network path share the cores, so the pipeline's
    CPU over the cores bounds it too; the kernels are memory-bound, so they run slower while
    other cores work: ``k(n)`` with ``n`` cores busy (``u``: on average over the pipeline;
    the wire's CPU was measured with both its ends at work, so it is not scaled);
    and every worker decodes key ``k`` at once, as soon as the shards answer it, so while it
    does ``W + S`` threads share ``C`` cores and the shards' threads lose their share of it
    (processor sharing: the shards' stage grows by a worker's decode times ``(W + S) / C -
    1``).
    """
    if workers < 1 or shards < 1 or model_bytes <= 0 or key_bytes <= 0:
        raise ValueError(f"workers {workers}, shards {shards}, model_bytes {model_bytes}, "
                         f"key_bytes {key_bytes}: expected workers, shards >= 1 and sizes > 0")
    big_w, s, b, cores = workers, shards, float(model_bytes), m.shared_cores
    keys = max(1.0, b / key_bytes)
    per_shard, per_worker = message_counts(c, keys=keys, shards=s, key_bytes=key_bytes,
                                           message_bytes=message_bytes)
    # a shard's port carries a flow from every worker, a worker's one to every shard
    shard_port = big_w * b / s / (w.efficiency_at(big_w) * w.rate_bps / 8)
    worker_port = b / (w.efficiency_at(s) * w.rate_bps / 8)
    update = (c.shard_fixed + c.shard_per_push * big_w) * b  # every shard's, together
    # the in-process kernels' CPU (what contention slows), and the messages' on the cluster
    kernels = {"shard CPU": update / s / m.shard_speedup, "worker CPU": c.apply * b}
    messages = {"shard CPU": w.shard_message_cpu * big_w * per_shard,
                "worker CPU": w.worker_message_cpu * per_worker}
    stages = {
        "push link": c.push_bytes * max(worker_port, shard_port),
        "pull link": c.pull_bytes * max(worker_port, shard_port),
        **{name: kernels[name] + messages[name] for name in kernels},
    }
    encode = c.encode * b
    machine = None
    if cores:
        encode *= max(1.0, big_w / cores) * m.slowdown(big_w, c.contention)
        per_byte = (c.push_bytes * w.cpu_per_byte_at(c.push_bytes * key_bytes)
                    + c.pull_bytes * w.cpu_per_byte_at(c.pull_bytes * key_bytes))
        work = update + big_w * c.apply * b
        wire = w.message_cpu * big_w * per_worker + per_byte * big_w * b
        busy = (work + wire) / max(max(stages.values()), (work + wire) / cores)
        for name in kernels:
            stages[name] = kernels[name] * m.slowdown(busy, c.contention) + messages[name]
        stages["shard CPU"] += stages["worker CPU"] * max(0.0, (big_w + s) / cores - 1)
        machine = (m.slowdown(cores, c.contention) * work + wire) / cores
    slowest = max(stages, key=stages.get)
    fill = w.round_trip + (sum(stages.values()) - stages[slowest]) / per_shard
    terms = {"encode": encode, **stages, "fill": fill}
    pipeline, bottleneck = stages[slowest] + fill, slowest
    if machine is not None:
        terms["machine CPU"] = machine
        if machine > pipeline:
            pipeline, bottleneck = machine, "machine CPU"
    return Prediction(encode + pipeline, bottleneck, terms)


SHARD_SIDE = ("push link", "pull link", "shard CPU")
"""The terms more shards shorten; the others are each worker's own."""


def shards_needed(c: SchemeCosts, w: WireCosts, m: Machines, *, workers: int,
                  model_bytes: float, key_bytes: float, compute_s: float,
                  limit: int = 4096) -> int | None:
    """The fewest shards whose every shard-side term (:data:`SHARD_SIDE`: a shard's NIC, its
    update) takes at most ``compute_s``: the PS tier then keeps up with a step of that much
    compute that the exchange overlaps. ``None`` when a worker's own NIC alone takes longer
    (no shard count helps) or more than ``limit`` shards would be needed."""
    def shard_side(s: int) -> float:
        p = step_time(c, w, m, workers=workers, shards=s, model_bytes=model_bytes,
                      key_bytes=key_bytes)
        return max(p.terms[t] for t in SHARD_SIDE)

    if shard_side(limit) > compute_s:
        return None
    lo, hi = 1, limit  # shard_side falls as s grows: the first s that fits, by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        if shard_side(mid) <= compute_s:
            hi = mid
        else:
            lo = mid + 1
    return lo
