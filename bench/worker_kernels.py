"""The worker's side of ``bitps-bench kernels``: a worker thread's CPU per step beyond compute
against the floor memory bandwidth sets.

**What a step must touch on the worker** (per element of the key set; ``n`` float32 elements,
4 bytes each; codes counted as their measured sizes): the push side makes the payload from the
gradient and the state the codec or the rule keeps, the pull side puts what the shard answered
into the worker's copy.

===========================================  =====================  ==========================
case (mode, push codec -> pull codec)         push: reads / writes   pull: reads / writes
===========================================  =====================  ==========================
sync fp32 (adam, raw -> raw)                  (zero-copy send)       frame / param
adam, async, bf16 -> raw (or fp16, sparse)    g, residual / resid.   frame / param
adam, async, sign1 -> raw                     g, residual / resid.   frame / param
adam, async, sign1 -> sign1                   g, residual / resid.   param / param
1-bit Adam, sync (compressed phase)           g, resid. / resid.     v, param / param
1-bit Adam, async, worker moments             g, m, v, resid. /      param / param
                                              m, v, resid.
===========================================  =====================  ==========================

(A raw push goes out of the gradient itself; libzmq's I/O thread sends it, so the worker's
thread touches none of it. A raw pull is received straight into the parameters: one read of the
frame, one write. Compressed pulls add each published code to the copy in place. sync 1-bit
Adam's published codes are momenta: the pull applies Adam with the frozen v to the momentum the
code decodes to, and its push is the momentum ``lerp(m, g, 1 - beta1)`` through error feedback,
m read from the last published code, which the worker keeps instead of m.)

**What is measured**: a real ``PSClient`` and ``Encoder`` registered with an in-process
``bitps-server`` shard (``ps.create_server``: real gRPC and ZeroMQ on loopback), one worker,
``push_pull`` of every key at the next clock, ``wait()`` on the same thread; CPU time of that
thread (``time.thread_time``: the encode, the sends, the receive and the decode or copy into the
parameters; the shard's threads and libzmq's I/O thread are not the worker's thread). No
clipping and no weight prediction (``PSModel``'s staging adds one read of the gradients for the
clip norm, and the prediction's pass over the parameters). Rounds alternate the cases with
memcpy, like the shard cases.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["ENCODER_SCALING_CASES", "RawReceive", "WORKER_CASES", "Worker", "WorkerCase",
           "measure"]

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class WorkerCase:
    """One worker configuration and the float32 arrays the floor counts (payloads apart)."""

    name: str
    optimizer: str = "adam"
    mode: str = "async"
    push: str = "raw"
    pull: str = "raw"
    reads: int
    writes: int
    goal: float = 1.3
    """Acceptance: CPU per step at most this times the floor."""

    @property
    def onebit(self) -> bool:
        return self.optimizer == "onebit_adam"


WORKER_CASES = (
    WorkerCase(name="worker: sync fp32 (adam, raw -> raw)", mode="sync", reads=1, writes=1),
    WorkerCase(name="worker: adam, async, bf16 -> raw", push="bf16", reads=3, writes=2),
    WorkerCase(name="worker: adam, async, fp16 -> raw", push="fp16", reads=3, writes=2),
    WorkerCase(name="worker: adam, async, sparse -> raw", push="sparse", reads=3, writes=2),
    WorkerCase(name="worker: adam, async, sign1 -> raw", push="sign1", reads=3, writes=2),
    WorkerCase(name="worker: adam, async, sign1 -> sign1", push="sign1", pull="sign1",
               reads=3, writes=2),
    WorkerCase(name="worker: 1-bit Adam, sync", optimizer="onebit_adam", mode="sync",
               push="sign1", reads=4, writes=2),
    WorkerCase(name="worker: 1-bit Adam, async, worker moments", optimizer="onebit_adam",
               push="sign1", pull="sign1", reads=5, writes=4),
)
"""Every worker configuration the bench measures, in table order."""

ENCODER_SCALING_CASES = ("worker: adam, async, sign1 -> raw",
                         "worker: 1-bit Adam, async, worker moments")
"""The worker cases whose encode is timed with several encoder threads
(``EncoderConfig.threads``, ``KernelsBench.thread_counts``)."""


class Worker:
    """One registered worker of ``case`` over ``keys`` keys of ``n`` elements against its own
    in-process shard; :meth:`step` is one push_pull of every key at the next clock,
    :meth:`encode` the encode of one alone (on ``threads`` encoder threads)."""

    def __init__(self, case: WorkerCase, keys: int, n: int, *, threads: int = 1) -> None:
        from bitps.proto.codecs import CodecConfig
        from bitps.proto.keyplan import ParamSpec, make_plan
        from bitps.ps import ServerConfig, create_server
        from bitps.ps.config import OptimizerConfig
        from bitps.ps.onebit import OneBitConfig
        from bitps.worker.config import ClientConfig, EncoderConfig
        from bitps.worker.training.encoder import Encoder
        from bitps.worker.transport.client import PSClient

        self.case = case
        rule_config = OneBitConfig(freeze_step=1) if case.onebit else None
        self.shard = create_server(ServerConfig(
            mode=case.mode, host="127.0.0.1", grpc_port=0, data_port=0, metrics_port=-1,
            threads=1, optimizer=OptimizerConfig(name=case.optimizer, lr=1e-4,
                                                 rule_config=rule_config)))
        plan = make_plan([ParamSpec("w", (keys * n,))], num_shards=1, partition_bytes=4 * n)
        # heartbeats are not the worker's step: one an hour
        self.client = PSClient(ClientConfig(
            servers=(f"127.0.0.1:{self.shard.ports['grpc_port']}",), partition_bytes=4 * n,
            heartbeat_s=3600.0))
        push = CodecConfig(name=case.push)
        pull = CodecConfig(name=case.pull) if case.pull != case.push else None
        self.encoder = Encoder(EncoderConfig(push_codec=push, pull_codec=pull,
                                             clip_norm=0.0, threads=threads), self.client)
        rng = np.random.default_rng(0)
        self.params = (rng.standard_normal(keys * n) * 0.02).astype(np.float32)
        self.keys = [k.key for k in plan.keys]
        self.outs = [self.params[k.offset:k.offset + k.length] for k in plan.keys]
        self.encoder.register(plan, dict(zip(self.keys, self.outs)))
        grads = (rng.standard_normal(keys * n) * 1e-3).astype(np.float32)
        self.grads = [grads[k.offset:k.offset + k.length] for k in plan.keys]
        self.clock = self.client.clock
        self.push_bytes = self.pull_bytes = 0
        if case.onebit:
            self.step()  # the warmup step (bf16 pushes); the next ones are compressed

    def step(self) -> None:
        m = self.client.metrics
        push0, pull0 = self._wire(), m.pull_bytes.value
        self.encoder.push_pull(self.keys, self.grads, self.outs, clock=self.clock).wait()
        self.clock += 1
        self.client.clock = self.clock
        self.push_bytes = int(self._wire() - push0)
        self.pull_bytes = int(m.pull_bytes.value - pull0)

    def encode(self) -> None:
        """Encode every key's gradient for the current clock, as a push would (the error
        feedback and the policy's moments advance; nothing is sent)."""
        self.encoder.encode(self.keys, self.grads, clock=self.clock)

    def _wire(self) -> float:
        """The compressed payload bytes pushed so far (``bitps_worker_codec_wire_bytes``)."""
        return sum(c.value for c in self.client.metrics.codec_wire_bytes.children.values())

    def floor_bytes(self) -> int:
        """What the floor counts: the state arrays, and the codes the worker's thread makes
        or reads (a raw push is sent from the gradient; a raw pull's frame is an array)."""
        c, arrays = self.case, 4 * sum(g.size for g in self.grads)
        coded_push = self.push_bytes
        # sync 1-bit Adam publishes momenta codes whatever the pull codec
        coded_pull = self.pull_bytes if c.pull != "raw" or c.onebit else 0
        return arrays * (c.reads + c.writes) + coded_push + coded_pull

    def close(self) -> None:
        self.encoder.close()
        self.client.close()
        self.shard.stop(0)


class RawReceive:
    """What libzmq alone costs a raw pull: ``keys`` messages of ``n`` float32 sent zero-copy
    over TCP on loopback by another thread, received on this one straight into ``keys``
    arrays (``recv_into``, as ``worker.transport.channel`` receives a raw reply); :meth:`step`
    returns this thread's CPU seconds for the receives (a blocked wait takes none)."""

    def __init__(self, keys: int, n: int) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._rx = self._ctx.socket(zmq.PAIR)
        port = self._rx.bind_to_random_port("tcp://127.0.0.1")
        self._tx = self._ctx.socket(zmq.PAIR)
        self._tx.connect(f"tcp://127.0.0.1:{port}")
        self._src = np.ones(n, np.float32)
        self._outs = np.zeros((keys, n), np.float32)

    def step(self) -> float:
        sender = threading.Thread(target=self._send)
        sender.start()
        t0 = time.thread_time()
        for out in self._outs:
            self._rx.recv_into(out)
        cpu = time.thread_time() - t0
        sender.join()
        return cpu

    def _send(self) -> None:
        for _ in range(len(self._outs)):
            self._tx.send(self._src, copy=False)

    def close(self) -> None:
        self._rx.close(linger=0)
        self._tx.close(linger=0)
        self._ctx.term()


def measure(cases: list[WorkerCase], keys: int, n: int, rounds: int, repeats: int,
            copy_round) -> tuple[dict[str, list[float]], dict[str, int], list[float],
                                 list[float]]:
    """CPU per step of each case's worker thread, rounds alternated with ``copy_round()`` (the
    memcpy that sets the bandwidth; its times returned too) and with a :class:`RawReceive` of
    the same bytes (libzmq's own part of a raw pull; its CPU times returned too); and each
    case's floor bytes."""
    workers = {c.name: Worker(c, keys, n) for c in cases}
    raw = RawReceive(keys, n)
    try:
        for w in workers.values():
            w.step()  # compile, touch every buffer once
        raw.step()
        cpu: dict[str, list[float]] = {c.name: [] for c in cases}
        copies, receives = [], []
        for _ in range(rounds):
            copies.append(copy_round())
            receives.append(raw.step())
            for c in cases:
                w = workers[c.name]
                t0 = time.thread_time()
                for _ in range(repeats):
                    w.step()
                cpu[c.name].append((time.thread_time() - t0) / repeats)
        return cpu, {name: w.floor_bytes() for name, w in workers.items()}, copies, receives
    finally:
        raw.close()
        for w in workers.values():
            w.close()
