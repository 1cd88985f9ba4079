"""Fault injection for the tests and the chaos bench (``bitps-bench chaos``): a proxy that drops,
delays and duplicates data-plane messages, and helpers that start, kill and pause real processes.

Network faults. :class:`ShardProxy` stands between workers and one shard, on both planes:

- :class:`DataProxy` is a ZeroMQ ROUTER facing the workers. Every worker connection (a DEALER
  of a ``PSClient`` channel) gets a DEALER of its own towards the shard's data port, so each
  connection is forwarded as its own FIFO connection: the shard reads a pull for step c as proof
  that the same connection's earlier pushes have arrived, and the proxy never reorders within a
  connection (a delay holds back what follows it on that connection; a late duplicate travels on
  a side connection). :class:`Rule` s act on parsed ``DataHeader`` s, selected by a predicate
  (op, worker, clock of the request) and a rate: every n-th match, with a probability from a
  seeded RNG, at most ``limit`` times. :attr:`DataProxy.counts` and :attr:`DataProxy.log` say
  what it did.
- :class:`ControlProxy` forwards gRPC calls byte for byte (metadata, status codes and trailers
  too) and rewrites one field: ``RegisterReply.data_port`` becomes the data proxy's port. That is
  the seam: ``PSClient`` connects its DEALERs to ``tcp://<host of ClientConfig.servers[i]>:<the
  data_port the shard's RegisterReply names>``, so a worker given the proxy's gRPC address
  (:attr:`ShardProxy.address`) sends its data through the proxy with no product change.

    proxy = ShardProxy(grpc_address, data_port,
                       rules=[Rule("duplicate", when=pushes, every=10)], seed=0)
    client = PSClient(ClientConfig(servers=(proxy.address,)))
    ...
    proxy.data.counts["duplicate"]; proxy.close()

Process faults. :func:`start_server` runs ``bitps-server`` on free ports (it reads the ready
line); :func:`start_worker` runs a numpy-only worker loop (:func:`worker_main`) in its own
process. A :class:`Proc` is killed (``SIGKILL``), stopped (``SIGSTOP``) and continued
(``SIGCONT``) by its own pid only; :func:`wait_clock` polls a shard's Status RPC until a worker's
clock reaches a step, so a fault lands at a chosen step.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.wire import PROTOCOL

__all__ = ["ControlProxy", "DataProxy", "Message", "Proc", "Rule", "ServerProcess",
           "ShardProxy", "pulls", "pushes", "start_server", "start_worker", "wait_clock"]

ROOT = Path(__file__).resolve().parents[1]
_GRPC_OPTS = [("grpc.max_send_message_length", 64 << 20),
              ("grpc.max_receive_message_length", 64 << 20)]


# -- data plane ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One message the proxy sees. ``header``: its frame 0 parsed (``None`` if it does not
    parse); ``request``: the request it is (``direction == "request"``) or answers."""

    direction: str
    header: pb.DataHeader | None
    request: pb.DataHeader | None

    @property
    def op(self) -> int:
        """The request's op (PUSH, PULL, PUSH_PULL), also for its reply; 0 when unknown."""
        return self.request.op if self.request is not None else 0


def pushes(msg: Message) -> bool:
    """The message is a push or push_pull (or answers one)."""
    return msg.op in (pb.PUSH, pb.PUSH_PULL)


def pulls(msg: Message) -> bool:
    """The message is a pull or push_pull (or answers one)."""
    return msg.op in (pb.PULL, pb.PUSH_PULL)


@dataclass
class Rule:
    """What to do with some messages. ``action``: ``"drop"``, ``"delay"`` (hold ``delay_s``) or
    ``"duplicate"`` (the copy follows at once on the same connection, or with ``delay_s`` on a
    side connection to the shard: a late resend). It acts on messages going ``direction``
    (``"request"``: to the shard, ``"reply"``: to the worker) for which ``when`` holds, on every
    ``every``-th of those, then with probability ``rate``, at most ``limit`` times."""

    action: str
    direction: str = "request"
    when: Callable[[Message], bool] = lambda msg: msg.header is not None
    every: int = 1
    rate: float = 1.0
    delay_s: float = 0.0
    limit: int | None = None
    matched: int = field(default=0, init=False)
    acted: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.action not in ("drop", "delay", "duplicate"):
            raise ValueError(f"action {self.action!r}; expected drop, delay or duplicate")
        if self.direction not in ("request", "reply"):
            raise ValueError(f"direction {self.direction!r}; expected request or reply")
        if self.every < 1 or not 0 <= self.rate <= 1 or self.delay_s < 0:
            raise ValueError(f"every {self.every} (>= 1), rate {self.rate} (0..1), delay_s "
                             f"{self.delay_s} (>= 0)")


def _parse(frame: bytes) -> pb.DataHeader | None:
    header = pb.DataHeader()
    try:
        header.ParseFromString(frame)
    except Exception:  # protobuf raises DecodeError and, on some inputs, others
        return None
    return header


class DataProxy:
    """A ZeroMQ proxy in front of the data port ``target`` (``tcp://host:port``), served by one
    thread; workers connect to ``tcp://127.0.0.1:<port>``. Set :attr:`rules` at any time."""

    def __init__(self, target: str, rules=(), *, seed: int = 0,
                 idle_close_s: float | None = None) -> None:
        self.target = target
        self.idle_close_s = idle_close_s
        """Close the shard-side connection of a worker connection silent this long (``None``:
        never): a worker that reconnected or died leaves its old one idle, and a long run
        would otherwise hold one connection to the shard per reconnect."""
        self.rules: list[Rule] = list(rules)
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        """Messages seen by direction (``request``, ``reply``), ``ERROR`` replies (``error``),
        replies to late duplicates (``late_reply``), and each action taken."""
        self.log: list[tuple] = []
        """Per action taken: (action, direction, op, worker, request_id, clock)."""
        self._ctx = zmq.Context()
        self._front = self._socket(zmq.ROUTER)
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._side = self._socket(zmq.DEALER)
        self._side.connect(target)
        self._poller = zmq.Poller()
        for sock in (self._front, self._side):
            self._poller.register(sock, zmq.POLLIN)
        self._conns: dict[bytes, zmq.Socket] = {}
        self._ident_of: dict[zmq.Socket, bytes] = {}
        self._requests: dict[tuple[bytes, int], pb.DataHeader] = {}
        self._queues: dict[tuple[bytes, str], deque] = {}
        self._late: list[tuple[float, list]] = []
        self._heard: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="data-proxy", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in [self._front, self._side, *self._conns.values()]:
            sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            for sock, _ in self._poller.poll(self._timeout_ms()):
                frames = sock.recv_multipart()
                if sock is self._front:
                    self._arrive(frames[0], "request", frames[1:])
                elif sock is self._side:
                    self.counts["late_reply"] += 1  # the worker has had its answer
                else:
                    self._arrive(self._ident_of[sock], "reply", frames)
            self._flush(time.monotonic())
            if self.idle_close_s is not None:
                self._close_idle(time.monotonic() - self.idle_close_s)

    def _close_idle(self, before: float) -> None:
        for ident in [i for i, t in self._heard.items() if t < before
                      and not self._queues.get((i, "request"))
                      and not self._queues.get((i, "reply"))]:
            del self._heard[ident]
            conn = self._conns.pop(ident, None)
            if conn is not None:  # None: every request it sent was dropped
                del self._ident_of[conn]
                self._poller.unregister(conn)
                conn.close(linger=0)
            for key in [k for k in self._requests if k[0] == ident]:
                del self._requests[key]
            self.counts["closed_idle"] += 1

    def _timeout_ms(self) -> int:
        dues = [q[0][0] for q in self._queues.values() if q] + [d for d, _ in self._late]
        if not dues:
            return 20
        return max(0, min(20, int((min(dues) - time.monotonic()) * 1000) + 1))

    def _arrive(self, ident: bytes, direction: str, frames: list) -> None:
        header = _parse(frames[0]) if frames else None
        if direction == "request":
            self._heard[ident] = time.monotonic()
        if header is not None and direction == "request":
            self._requests[ident, header.request_id] = header
        request = header if direction == "request" or header is None else \
            self._requests.get((ident, header.request_id))
        msg = Message(direction, header, request)
        self.counts[direction] += 1
        if direction == "reply" and header is not None and header.op == pb.ERROR:
            self.counts["error"] += 1
        now = time.monotonic()
        rule = self._decide(msg)
        if rule is not None:
            self.counts[rule.action] += 1
            h = header or pb.DataHeader()
            self.log.append((rule.action, direction, msg.op, h.worker, h.request_id, h.clock))
            if rule.action == "drop":
                return
        due = now + rule.delay_s if rule is not None and rule.action == "delay" else now
        self._enqueue(ident, direction, due, frames)
        if rule is not None and rule.action == "duplicate":
            if rule.delay_s and direction == "request":
                self._late.append((now + rule.delay_s, frames))
            else:
                self._enqueue(ident, direction, due, frames)

    def _decide(self, msg: Message) -> Rule | None:
        for rule in list(self.rules):
            if rule.direction != msg.direction or not rule.when(msg):
                continue
            rule.matched += 1
            if rule.matched % rule.every or (rule.limit is not None and rule.acted >= rule.limit):
                continue
            if rule.rate < 1 and self.rng.random() >= rule.rate:
                continue
            rule.acted += 1
            return rule
        return None

    def _enqueue(self, ident: bytes, direction: str, due: float, frames: list) -> None:
        if direction == "request" and ident not in self._conns:
            conn = self._socket(zmq.DEALER)
            conn.connect(self.target)
            self._conns[ident], self._ident_of[conn] = conn, ident
            self._poller.register(conn, zmq.POLLIN)
        queue = self._queues.setdefault((ident, direction), deque())
        # FIFO per connection: nothing overtakes a delayed message on its connection
        queue.append((max(due, queue[-1][0]) if queue else due, frames))

    def _flush(self, now: float) -> None:
        for (ident, direction), queue in self._queues.items():
            while queue and queue[0][0] <= now:
                frames = queue.popleft()[1]
                if direction == "request":
                    self._conns[ident].send_multipart(frames)
                else:
                    self._front.send_multipart([ident, *frames])
        for item in [x for x in self._late if x[0] <= now]:
            self._late.remove(item)
            self._side.send_multipart(item[1])


# -- control plane ---------------------------------------------------------------------------------
_KINDS = {"/bitps.Control/Register": "stream_unary",
          "/bitps.Control/RuleState": "unary_stream",
          "/grpc.health.v1.Health/Watch": "unary_stream"}


class ControlProxy:
    """Forwards every gRPC call to ``target`` unchanged, except that a RegisterReply names
    ``data_port``; listens on ``127.0.0.1:<port>``. :attr:`calls` counts calls by method."""

    def __init__(self, target: str, *, data_port: int) -> None:
        self.data_port = data_port
        self.calls: Counter = Counter()
        self._channel = grpc.insecure_channel(target, options=_GRPC_OPTS)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                   handlers=[_Forward(self)], options=_GRPC_OPTS)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def close(self) -> None:
        self._server.stop(0).wait()
        self._channel.close()

    def relay(self, method: str, request, context):
        """One call: the shard's answer, or the shard's status, details and trailers."""
        self.calls[method] += 1
        kind = _KINDS.get(method, "unary_unary")
        md = [(k, v) for k, v in context.invocation_metadata()
              if not k.startswith((":", "grpc-")) and k != "user-agent"]
        timeout = context.time_remaining()
        try:
            answer = getattr(self._channel, kind)(method)(request, metadata=md, timeout=timeout)
            if kind == "unary_stream":
                return list(answer)
        except grpc.RpcError as err:
            context.set_trailing_metadata(err.trailing_metadata() or ())
            context.abort(err.code(), err.details() or "")
        if method == "/bitps.Control/Register":
            reply = pb.RegisterReply.FromString(answer)
            reply.data_port = self.data_port
            answer = reply.SerializeToString()
        return answer


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, proxy: ControlProxy) -> None:
        self.proxy = proxy

    def service(self, details):
        method, relay = details.method, self.proxy.relay
        kind = _KINDS.get(method, "unary_unary")
        if kind == "unary_stream":
            def stream(request, context):
                yield from relay(method, request, context)
            return grpc.unary_stream_rpc_method_handler(stream)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(lambda request, context: relay(method, request, context))


class ShardProxy:
    """Both planes of one shard behind proxies: give workers :attr:`address` as the shard's
    server; :attr:`data` is the :class:`DataProxy` whose rules act on its data messages."""

    def __init__(self, grpc_address: str, data_port: int, rules=(), *, seed: int = 0,
                 idle_close_s: float | None = None) -> None:
        host = grpc_address.rsplit(":", 1)[0]
        self.data = DataProxy(f"tcp://{host}:{data_port}", rules, seed=seed,
                              idle_close_s=idle_close_s)
        self.control = ControlProxy(grpc_address, data_port=self.data.port)
        self.address = f"127.0.0.1:{self.control.port}"

    def close(self) -> None:
        self.control.close()
        self.data.close()


# -- processes -------------------------------------------------------------------------------------
class Proc:
    """A process this test started; signals go to its pid alone."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    def kill(self) -> None:
        """``kill -9`` and reap."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def rss_kib(self) -> int:
        """VmRSS from ``/proc/PID/status``."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def threads(self) -> int:
        """Its threads (``/proc/PID/task``)."""
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def fds(self) -> int:
        """Its open file descriptors (``/proc/PID/fd``): sockets, pipes, files."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def read_line(self, timeout: float) -> str:
        """The next stdout line, or AssertionError after ``timeout`` seconds."""
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        assert ready, f"pid {self.pid} wrote no line within {timeout} s"
        return self.popen.stdout.readline()


class ServerProcess(Proc):
    """A ``bitps-server`` process; :attr:`ready` is its ready line."""

    def __init__(self, popen: subprocess.Popen, timeout: float = 30) -> None:
        super().__init__(popen)
        line = self.read_line(timeout)
        assert line, f"bitps-server exited with {popen.wait()} before its ready line"
        self.ready = json.loads(line)
        self.grpc_address = f"127.0.0.1:{self.ready['grpc_port']}"
        self.data_port = self.ready["data_port"]

    def health(self) -> int:
        """The gRPC health status of ``bitps.Control``."""
        with grpc.insecure_channel(self.grpc_address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="bitps.Control"), timeout=5).status

    def status(self, token: str = "") -> pb.StatusReply:
        md = (("bitps-token", token),) if token else None
        with grpc.insecure_channel(self.grpc_address) as ch:
            return pb_grpc.ControlStub(ch).Status(pb.StatusRequest(token=token), timeout=5,
                                                  metadata=md)


def start_server(*flags: str, stderr=subprocess.DEVNULL) -> ServerProcess:
    """``bitps-server`` on free ports, metrics off unless ``flags`` say otherwise."""
    popen = subprocess.Popen([sys.executable, "-m", "bitps.ps", "--metrics-port", "-1",
                              "--log-level", "WARNING", *flags], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
    return ServerProcess(popen)


def wait_clock(server: ServerProcess, rank: int, clock: int, *, timeout: float = 60,
               token: str = "") -> pb.StatusReply:
    """Poll ``server``'s Status until worker ``rank``'s clock is at least ``clock``."""
    end = time.monotonic() + timeout
    while True:
        status = server.status(token)
        if any(w.rank == rank and w.clock >= clock for w in status.workers):
            return status
        assert time.monotonic() < end, f"worker {rank} never reached clock {clock}: {status}"
        time.sleep(0.01)


def start_worker(servers: list[str], *, rank: int, world: int, steps: int, n: int = 2048,
                 pace_s: float = 0.0, deadline_s: float = 30.0) -> Proc:
    """A worker process running :func:`worker_main`: register a flat float32 parameter of ``n``
    elements (rank 0 sends ``arange(n) / n``), pull, then ``steps`` push_pulls of a gradient
    computed from the parameters, ``pace_s`` apart. Its last stdout line is a JSON summary."""
    cfg = dict(servers=servers, rank=rank, world=world, steps=steps, n=n, pace_s=pace_s,
               deadline_s=deadline_s)
    popen = subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Proc(popen)


def worker_main(cfg: dict) -> None:
    import numpy as np

    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker import ClientConfig, PSClient

    n, servers = cfg["n"], tuple(cfg["servers"])
    plan = make_plan([ParamSpec("w", (n,))], num_shards=len(servers), partition_bytes=4096)
    keys = [k.key for k in plan.keys]
    client = PSClient(ClientConfig(servers=servers, rank=cfg["rank"], world_size=cfg["world"],
                                   deadline_s=cfg["deadline_s"], heartbeat_s=0.2))
    start = np.arange(n, dtype=np.float32) / n
    client.register(plan, {k.key: start[k.offset:k.offset + k.length] for k in plan.keys}
                    if cfg["rank"] == 0 else None)
    outs = [np.empty(k.length, np.float32) for k in plan.keys]
    client.pull(keys, outs, clock=client.start_clock).wait()
    finite = True
    for t in range(client.start_clock, client.start_clock + cfg["steps"]):
        time.sleep(cfg["pace_s"])
        grads = [0.1 * o + np.float32(0.01 * (cfg["rank"] + 1)) for o in outs]
        client.push_pull(keys, grads, outs, clock=t).wait()
        client.clock = t + 1
        finite = finite and all(bool(np.isfinite(o).all()) for o in outs)
    print(json.dumps({"rank": cfg["rank"], "clock": client.clock, "finite": finite}), flush=True)
    client.close()


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))


_raw_incarnations = itertools.count(0x7A11, 2)  # odd, and each RawPeer its own


class RawPeer:
    """A hand-written data-plane peer: one DEALER, frames in, header + frames out. Its requests
    carry its own nonzero incarnation (:attr:`incarnation`, as a PSClient's do: a push without
    one is refused while the shard's exactly-once window is on) unless told otherwise."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ids = iter(range(1, 1 << 30))
        self.incarnation = next(_raw_incarnations)

    def send(self, payload=(), **fields) -> int:
        fields = {"protocol": PROTOCOL, "dtype": pb.FLOAT32, "request_id": next(self.ids),
                  "incarnation": self.incarnation, **fields}
        header = pb.DataHeader(**fields)
        self.sock.send_multipart([header.SerializeToString(), *payload])
        return header.request_id

    def recv(self, timeout_s: float = 5.0) -> tuple[pb.DataHeader, list[bytes]]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply within {timeout_s} s")
        first, *rest = self.sock.recv_multipart()
        header = pb.DataHeader()
        header.ParseFromString(first)
        return header, rest

    def ask(self, payload=(), **fields) -> tuple[pb.DataHeader, list[bytes]]:
        self.send(payload, **fields)
        return self.recv()

    def close(self) -> None:
        self.sock.close()
