"""Defects an operator found against live shards (issue 17), each pinned by a test.

Real components: in-process shards on port 0 (``create_server``) or ``bitps-server``
processes, real sockets, real ``PSClient``s and raw gRPC / ZeroMQ peers that send what a buggy
or hostile worker would. Fault injection (a core method made to raise inside the data thread)
stands in for a shard bug; nothing of the behaviour under test is mocked.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitps.bench.faults import RawPeer as Raw
from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient

ROOT = Path(__file__).resolve().parents[1]
SGD = OptimizerConfig(name="sgd", lr=0.5)
MiB = 1 << 20


def _servers(shard) -> tuple[str, ...]:
    return (f"127.0.0.1:{shard.ports['grpc_port']}",)


def _plan(n: int = 1000, partition_bytes: int = 4096):
    plan = make_plan([ParamSpec("w", (n,))], num_shards=1, partition_bytes=partition_bytes)
    return plan, [k.key for k in plan.keys]


def _client(shard, rank: int = 0, world: int = 1, **cfg) -> PSClient:
    return PSClient(ClientConfig(servers=_servers(shard), rank=rank, world_size=world, **cfg))


def _joined(shard, plan, rank: int = 0, world: int = 1, start=None, **cfg) -> PSClient:
    client = _client(shard, rank, world, **cfg)
    if start is None:
        start = np.zeros(sum(k.length for k in plan.keys), np.float32)
    client.register(plan, {k.key: start[k.offset:k.offset + k.length] for k in plan.keys}
                    if rank == 0 else None)
    return client


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="bitps.Control"), timeout=5).status


def _round_trip(client, keys, clock) -> None:
    grads = [np.zeros(k_len, np.float32) for k_len in _lengths(client, keys)]
    outs = [np.empty(n, np.float32) for n in _lengths(client, keys)]
    client.push_pull(keys, grads, outs, clock=clock).wait()


def _lengths(client, keys) -> list[int]:
    return [client.plan.keys[k].length for k in keys]


# -- 1. a malformed header answers a typed error; a thread failure is never a zombie -------------
def test_out_of_range_header_fields_get_typed_errors_and_the_shard_keeps_serving(cluster):
    (shard,) = cluster(1, mode="async", optimizer=SGD)
    plan, keys = _plan()
    client = _joined(shard, plan)
    raw = Raw(shard.ports["data_port"])
    grad = np.ones(plan.keys[0].length, np.float32).tobytes()
    top = (1 << 64) - 1
    reply, _ = raw.ask([grad], op=pb.PUSH_PULL, worker=0, clock=top, keys=[keys[0]])
    assert reply.op == pb.ERROR and reply.error == pb.BAD_CLOCK, reply
    assert str(top) in reply.message
    reply, _ = raw.ask(op=pb.PULL, worker=0, clock=top, keys=[keys[0]])
    assert reply.error == pb.BAD_CLOCK
    for bad in (float("nan"), float("inf"), -1.0):
        reply, _ = raw.ask(op=pb.PULL, worker=0, clock=0, keys=[keys[0]], deadline_s=bad)
        assert reply.error == pb.BAD_HEADER and "deadline" in reply.message, (bad, reply)
    raw.close()
    assert shard.core.updates_applied == 0
    _round_trip(client, keys, 0)  # still serving, on both planes
    assert shard.core.updates_applied == len(keys)
    assert client.status(0).initialized
    assert _health(shard.ports["grpc_port"]) == health_pb2.HealthCheckResponse.SERVING
    client.close()


def test_a_failing_data_thread_turns_health_not_serving(cluster, monkeypatch):
    (shard,) = cluster(1, mode="async", optimizer=SGD)
    plan, keys = _plan()
    client = _joined(shard, plan, deadline_s=2.0)

    def broken(*args):
        raise ZeroDivisionError("injected fault")

    monkeypatch.setattr(shard.core, "_dispatch", broken)  # fault injection in the data thread
    with pytest.raises(PSError):
        _round_trip(client, keys, 0)
    end = time.monotonic() + 5
    while shard.failure is None and time.monotonic() < end:
        time.sleep(0.02)
    assert shard.failure is not None
    assert "bitps-data" in str(shard.failure) and "injected fault" in str(shard.failure)
    assert _health(shard.ports["grpc_port"]) == health_pb2.HealthCheckResponse.NOT_SERVING
    client.close(leave=False)


def test_an_ended_metrics_thread_takes_the_shard_down(cluster):
    """Issue 29: the Prometheus endpoint's thread (prometheus-client's) is under the
    no-zombie rule too: when it ends while the shard serves, the shard fails (health
    NOT_SERVING, ``failure`` names it) instead of serving on without metrics. A stop ends it
    without a failure."""
    (shard,) = cluster(1, mode="async", optimizer=SGD, metrics_port=0)
    shard._http.shutdown()  # its serve_forever returns: the thread ends
    end = time.monotonic() + 5
    while shard.failure is None and time.monotonic() < end:
        time.sleep(0.02)
    assert shard.failure is not None and "metrics" in str(shard.failure), shard.failure
    assert "Prometheus endpoint" in str(shard.failure)
    assert _health(shard.ports["grpc_port"]) == health_pb2.HealthCheckResponse.NOT_SERVING
    (calm,) = cluster(1, mode="async", optimizer=SGD, metrics_port=0)
    calm.stop(0)
    time.sleep(0.5)  # more than the supervisor's poll
    assert calm.failure is None


_FAILING_SERVER = """
import sys
from bitps.ps import __main__ as cli
from bitps.ps.shard import ShardCore
ticks = [0]
real = ShardCore.tick
def tick(self):
    ticks[0] += 1
    if ticks[0] == 25:  # about half a second in: a bug in the tick path
        raise KeyError("injected fault")
    return real(self)
ShardCore.tick = tick
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_shard_process_whose_thread_fails_exits_nonzero():
    proc = subprocess.run([sys.executable, "-c", _FAILING_SERVER, "--metrics-port", "-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "bitps-data" in last and "injected fault" in last, proc.stderr


# -- 2. registrants waiting for rank 0 never take every gRPC thread ------------------------------
def test_32_registrants_before_rank_0_leave_status_answering(cluster):
    (shard,) = cluster(1, mode="async", optimizer=SGD, heartbeat_timeout_s=60)
    plan, keys = _plan(64)
    world = 32
    clients = [_client(shard, r, world, register_timeout_s=30, heartbeat_s=5)
               for r in range(world)]
    order = list(range(1, world))
    random.Random(17).shuffle(order)
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            values = {k: np.zeros(64, np.float32) for k in keys} if rank == 0 else None
            clients[rank].register(plan, values)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=join, args=(r,)) for r in order]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every early rank is waiting now
    t0 = time.monotonic()
    status = clients[1].status(0)
    assert time.monotonic() - t0 < 1.0 and not status.initialized
    assert _health(shard.ports["grpc_port"]) == health_pb2.HealthCheckResponse.SERVING
    last = threading.Thread(target=join, args=(0,))
    last.start()
    for t in [*threads, last]:
        t.join(30)
    assert not errors, errors
    assert all(c.plan is not None for c in clients)
    assert sum(w.live for w in clients[0].status(0).workers) == world
    for c in clients:
        c.close()


# -- 2b. a Register that cannot reach its shard is made again, for a bounded time -----------------
def test_register_calls_again_while_the_shard_cannot_be_reached_then_gives_up():
    """A shard that refuses the connection (its port not listening yet, as a connection reset
    at start-up looks to gRPC: ``UNAVAILABLE``, no shard error) no longer fails the worker's
    Register at once: it is called again and joins once the shard listens (0.3 s later). A
    port that never listens is still a typed ``UNAVAILABLE`` error within seconds, not
    ``register_timeout_s``."""
    from bitps.ps import ServerConfig, create_server

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, started = free_port(), []
    late = threading.Timer(0.3, lambda: started.append(create_server(ServerConfig(
        grpc_port=port, mode="async", optimizer=SGD))))
    late.start()
    plan, keys = _plan(64)
    client = PSClient(ClientConfig(servers=(f"127.0.0.1:{port}",), register_timeout_s=30))
    try:
        client.register(plan, {k: np.ones(64, np.float32) for k in keys})
        assert client.status(0).initialized
    finally:
        late.join()
        client.close()
        for shard in started:
            shard.stop(0)
    never = PSClient(ClientConfig(servers=(f"127.0.0.1:{free_port()}",),
                                  register_timeout_s=30))
    t0 = time.monotonic()
    with pytest.raises(PSError) as err:
        never.register(plan, {k: np.ones(64, np.float32) for k in keys})
    never.close()
    assert "UNAVAILABLE" in err.value.message and 1.0 < time.monotonic() - t0 < 5.0, err.value


# -- 3. impossible clocks, held-pull caps, deadlines ---------------------------------------------
def test_an_impossible_clock_is_refused_and_the_ssp_bound_still_holds(cluster):
    (shard,) = cluster(1, mode="ssp", staleness=1, optimizer=SGD)
    plan, keys = _plan(64)
    fast = _joined(shard, plan, rank=0, world=2, deadline_s=5)
    slow = _joined(shard, plan, rank=1, world=2, deadline_s=5)
    raw = Raw(shard.ports["data_port"])
    reply, _ = raw.ask(op=pb.PULL, worker=1, clock=10**9, keys=keys)
    assert reply.error == pb.BAD_CLOCK and str(10**9) in reply.message, reply
    assert "max_clock_lead" in reply.message
    raw.close()
    assert {w.rank: w.clock for w in fast.status(0).workers} == {0: 0, 1: 0}
    # Worker 1 is really at clock 0: worker 0's pull for clock 2 must wait for it.
    outs = [np.empty(64, np.float32) for _ in keys]
    held = fast.pull(keys, outs, clock=2)
    time.sleep(0.3)
    assert not held.done()
    slow.pull(keys, [np.empty(64, np.float32) for _ in keys], clock=1).wait()
    held.wait()
    assert max(r.clock - r.min_clock for r in shard.core.admissions) <= 1
    fast.close()
    slow.close()


def test_held_pull_flood_is_capped_and_round_trips_stay_fast(cluster):
    (shard,) = cluster(1, mode="ssp", staleness=0, optimizer=SGD, heartbeat_timeout_s=60)
    cap = shard.cfg.max_held_pulls
    plan, keys = _plan(64)
    fast = _joined(shard, plan, rank=0, world=2)
    other = _joined(shard, plan, rank=1, world=2)

    def median_round_trip(first_clock: int) -> float:
        times = []
        for c in range(first_clock, first_clock + 40):
            t0 = time.perf_counter()
            _round_trip(fast, keys, c)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    raw = Raw(shard.ports["data_port"])
    # Worker 1 waits at clock 500 for worker 0, who is at clock 0: every pull is held.
    attempts = 5000
    raw.send(op=pb.PULL, worker=1, clock=500, keys=keys[:1])
    before = median_round_trip(0)
    for _ in range(attempts - 1):
        raw.send(op=pb.PULL, worker=1, clock=500, keys=keys[:1])
    refused = 0
    while refused < attempts - cap:
        reply, _ = raw.recv()
        assert reply.error == pb.LIMIT and f"{cap}" in reply.message, reply
        refused += 1
    assert fast.status(0).workers[1].pending_pulls == cap
    after = median_round_trip(40)
    assert after < 1.5 * before + 0.002, (before, after)
    raw.close()
    fast.close()
    other.close(leave=False)


def test_the_deadline_a_pull_asks_for_is_capped(cluster):
    (shard,) = cluster(1, mode="ssp", staleness=0, optimizer=SGD, max_pull_deadline_s=0.5)
    plan, keys = _plan(64)
    clients = [_joined(shard, plan, rank=r, world=2) for r in (0, 1)]
    raw = Raw(shard.ports["data_port"])
    t0 = time.monotonic()
    reply, _ = raw.ask(op=pb.PULL, worker=0, clock=1, keys=keys, deadline_s=1e12)
    assert reply.error == pb.DEADLINE and time.monotonic() - t0 < 3
    raw.close()
    for c in clients:
        c.close()


# -- 4. a wrong token costs nothing ----------------------------------------------------------------
def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _start_server(*flags: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "bitps.ps", "--metrics-port", "-1", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc, json.loads(proc.stdout.readline())


def _register_messages(plan, token: str, values: int = 0, value_bytes: int = 0):
    req = pb.RegisterRequest(protocol=PROTOCOL, rank=0, world_size=1, signature=plan.signature,
                             num_shards=1, shard_id=0, sends_values=bool(values), token=token,
                             keys=[pb.KeySpec(key=k.key, name=k.name, offset=k.offset,
                                              length=k.length, dtype=pb.FLOAT32)
                                   for k in plan.keys])
    yield pb.RegisterMessage(request=req)
    blob = bytes(value_bytes)
    for k in range(values):
        yield pb.RegisterMessage(values=pb.KeyValues(key=k, data=blob))


def test_a_wrong_token_costs_the_shard_no_memory_on_either_plane():
    proc, ready = _start_server("--token", "right")
    try:
        plan, keys = _plan(64)
        opts = [("grpc.max_send_message_length", 64 * MiB)]
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}", options=opts) as ch:
            stub = pb_grpc.ControlStub(ch)
            time.sleep(0.5)
            rss0 = _rss_kib(proc.pid)
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(_register_messages(plan, "wrong", 16, 16 * MiB), timeout=30,
                              metadata=(("bitps-token", "wrong"),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # An old-style request: the token only in the message is refused as well.
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(_register_messages(plan, "wrong", 16, 16 * MiB), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            time.sleep(0.3)
            grown = _rss_kib(proc.pid) - rss0
            assert grown < 32 * 1024, f"RSS grew {grown} KiB for refused registrations"
            status = stub.Status(pb.StatusRequest(token="right"), timeout=5,
                                 metadata=(("bitps-token", "right"),))
            assert not status.workers and not status.initialized
        client = PSClient(ClientConfig(servers=(f"127.0.0.1:{ready['grpc_port']}",),
                                       token="right"))
        client.register(plan, {k: np.zeros(64, np.float32) for k in keys})
        raw = Raw(ready["data_port"])
        reply, _ = raw.ask([np.ones(64, np.float32).tobytes()], op=pb.PUSH, worker=0, clock=0,
                           keys=keys[:1], token="wrong")
        assert reply.error == pb.UNAUTHENTICATED
        raw.close()
        outs = [np.empty(64, np.float32) for _ in keys]
        client.pull(keys, outs, clock=0).wait()
        assert not np.concatenate(outs).any()  # the refused push changed nothing
        assert client.status(0).updates_applied == 0
        client.close()
    finally:
        proc.kill()
        proc.wait()


# -- 5. limits on plans, messages and workers ------------------------------------------------------
def test_plan_message_and_world_limits_are_typed_errors_and_rank_0_still_joins(cluster):
    (shard,) = cluster(1, mode="async", optimizer=SGD, max_plan_bytes=MiB, max_plan_keys=64,
                       max_message_keys=8, max_workers=4)
    stub = pb_grpc.ControlStub(grpc.insecure_channel(_servers(shard)[0]))

    def refused(plan, world=1) -> str:
        msgs = list(_register_messages(plan, ""))
        msgs[0].request.world_size = world
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(iter(msgs), timeout=10)
        md = dict(err.value.trailing_metadata())
        assert int(md["bitps-error-code"]) == pb.LIMIT, err.value.details()
        return err.value.details()

    big = make_plan([ParamSpec("w", (2 * MiB // 4,))], num_shards=1, partition_bytes=MiB)
    assert f"{2 * MiB}" in refused(big) and f"{MiB}" in refused(big)
    many = make_plan([ParamSpec("w", (65 * 256,))], num_shards=1, partition_bytes=1024)
    assert "65 keys" in refused(many) and "64" in refused(many)
    plan, keys = _plan(10 * 256, partition_bytes=1024)
    assert "world size 5" in refused(plan, world=5) and "max_workers 4" in refused(plan, 5)
    assert not shard.core.slots and not shard.core.clocks.workers  # nothing was kept
    client = _joined(shard, plan)  # the real rank 0 is accepted
    raw = Raw(shard.ports["data_port"])
    reply, _ = raw.ask(op=pb.PULL, worker=0, clock=0, keys=keys[:9])
    assert reply.error == pb.LIMIT and "9 keys" in reply.message and "8" in reply.message
    raw.close()
    _round_trip(client, keys[:8], 0)
    client.close()


# -- 6. a push is applied once, however often it arrives -------------------------------------------
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_replayed_push_is_applied_once(cluster, mode):
    (shard,) = cluster(1, mode=mode, optimizer=SGD, lookahead=False)
    plan, keys = _plan(64)
    client = _joined(shard, plan)
    grad = np.full(64, 0.25, np.float32)
    push = dict(op=pb.PUSH, worker=0, clock=0, keys=keys, incarnation=client.incarnation,
                request_id=1 << 40)
    first = Raw(shard.ports["data_port"])
    reply, _ = first.ask([grad.tobytes()], **push)
    assert reply.op == pb.REPLY
    again = Raw(shard.ports["data_port"])  # another connection, the same push
    for raw in (first, again):
        replay, _ = raw.ask([grad.tobytes()], **push)
        assert replay.op == pb.REPLY and replay.request_id == reply.request_id
    # A push_pull replaying it is answered with parameters and applies nothing either.
    out, frames = again.ask([grad.tobytes()], **{**push, "op": pb.PUSH_PULL})
    assert out.op == pb.REPLY and len(frames) == 1
    first.close()
    again.close()
    outs = [np.empty(64, np.float32)]
    client.pull(keys, outs, clock=1).wait()
    np.testing.assert_array_equal(outs[0], -0.5 * grad)  # one SGD step at lr 0.5
    np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32), -0.5 * grad)
    assert shard.core.updates_applied == 1
    # Another request id is another push.
    reply, _ = Raw(shard.ports["data_port"]).ask([grad.tobytes()],
                                                 **{**push, "request_id": 2})
    assert reply.op == pb.REPLY and shard.core.updates_applied == 2
    client.close()


def test_data_plane_connections_past_the_limit_get_limit_until_others_fall_silent(cluster):
    """``max_connections``: a third connection while two are active is answered ``LIMIT``
    naming the count and the limit, and changes nothing; once the others have been silent for
    the heartbeat timeout it is served."""
    (shard,) = cluster(1, mode="async", optimizer=SGD, max_connections=2,
                       heartbeat_timeout_s=1.0)
    plan, keys = _plan(64)
    client = _joined(shard, plan)  # its connections are the first (PSClient's own channel)
    peers = [Raw(shard.ports["data_port"]) for _ in range(3)]
    try:
        replies = [p.ask(op=pb.PULL, worker=0, clock=0, keys=keys)[0] for p in peers]
        errors = [r.error for r in replies]
        assert errors.count(pb.LIMIT) >= 1, errors
        refused = next(r for r in replies if r.error == pb.LIMIT)
        assert "max_connections 2" in refused.message, refused.message
        assert shard.core.updates_applied == 0
        time.sleep(1.3)  # everyone silent past the heartbeat timeout
        late, _ = peers[-1].ask(op=pb.PULL, worker=0, clock=0, keys=keys)
        assert late.op == pb.REPLY, late
    finally:
        for p in peers:
            p.close()
        client.close()
