"""In-process shards on port 0 with real PSClients over real loopback sockets.

Exactness against local torch training, SSP bounds read from the shard's own admission records,
live Prometheus endpoints, typed errors over the wire, and deadlines.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest
import zmq
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from bitps.proto import bitps_pb2 as pb
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient, PSTimeoutError


def servers_of(shards) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)


def flat_plan(n: int, num_shards: int, partition_bytes: int = 4096):
    plan = make_plan([ParamSpec("w", (n,))], num_shards=num_shards,
                     partition_bytes=partition_bytes)
    return plan, [k.key for k in plan.keys]


# -- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_sync_one_worker_equals_local_torch(cluster, optimizer):
    """20 steps of the demo model through 2 sync shards == local torch.optim on the same batches,
    bit for bit (stricter than the rtol 1e-6 asked for).

    The kernels round op for op as torch's CPU kernels do. Adam is compared with torch's fused CPU
    kernel (``fused=True``): the default single-tensor path takes sqrt from MKL, which is not
    correctly rounded, and Adam's normalisation turns such 1-ulp differences into visible ones
    through a nonlinear model within a few steps.
    """
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn
    from bitps.worker.training.model import PSModel

    torch.set_num_threads(1)
    lr = {"sgd": 0.05, "momentum": 0.02, "adam": 3e-3, "adamw": 3e-3}[optimizer]
    wd = 0.01 if optimizer == "adamw" else 0.0
    shards = cluster(2, mode="sync", optimizer=OptimizerConfig(name=optimizer, lr=lr,
                                                               momentum=0.9, weight_decay=wd))
    demo = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    corpus = load_corpus(demo.corpus_bytes)
    remote, local = build_model(demo), build_model(demo)
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=lr, foreach=False),
           "momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, foreach=False),
           "adam": lambda p: torch.optim.Adam(p, lr=lr, fused=True),
           "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd, fused=True)}[
        optimizer](local.parameters())
    client = PSClient(ClientConfig(servers=servers_of(shards), partition_bytes=64 << 10))
    ps_model = PSModel(remote, client)
    assert len(ps_model.keys) > len(list(remote.parameters()))  # big tensors were split
    data = batches(corpus, batch_size=4, seq_len=32, rank=0, world_size=1, seed=0)
    losses = []
    for _ in range(20):
        x, y = next(data)
        loss = loss_fn(remote, x, y)
        loss.backward()
        ps_model.step()
        opt.zero_grad()
        local_loss = loss_fn(local, x, y)
        local_loss.backward()
        opt.step()
        losses.append((loss.item(), local_loss.item()))
    ps_model.close()
    assert losses[-1][0] < losses[0][0]
    for (name, a), b in zip(remote.named_parameters(), local.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {float((a - b).abs().max())}"


# -- SSP ------------------------------------------------------------------------------------------
def test_ssp_bounds_clock_gap_and_fast_worker_waits(cluster):
    staleness, steps = 1, 12
    (shard,) = cluster(1, mode="ssp", staleness=staleness,
                       optimizer=OptimizerConfig(name="sgd", lr=0.01))
    plan, keys = flat_plan(3000, 1)
    gaps: list[int] = []
    errors: list[BaseException] = []

    def run(rank: int, delay: float) -> None:
        try:
            client = PSClient(ClientConfig(servers=servers_of([shard]), rank=rank,
                                           world_size=2, deadline_s=20))
            init = np.zeros(3000, np.float32)
            views = [init[k.offset:k.offset + k.length] for k in plan.keys]
            client.register(plan, dict(zip(keys, views)) if rank == 0 else None)
            grads = [np.full(k.length, 0.1, np.float32) for k in plan.keys]
            outs = [np.empty(k.length, np.float32) for k in plan.keys]
            client.pull(keys, outs, clock=0).wait()
            for t in range(steps):
                time.sleep(delay)
                client.push_pull(keys, grads, outs, clock=t).wait()
                with shard.core.lock:
                    clocks = [w.clock for w in shard.core.clocks.workers.values()]
                gaps.append(max(clocks) - min(clocks))
            client.close()
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(0, 0.0)),
               threading.Thread(target=run, args=(1, 0.03))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    records = list(shard.core.admissions)
    assert len(records) >= 2 * (steps + 1)
    # The SSP guarantee, from the shard's own records: nobody got parameters for clock c before
    # every live worker had reached c - S.
    assert max(r.clock - r.min_clock for r in records) <= staleness
    fast_waits = [r.waited_s for r in records if r.worker == 0]
    assert max(fast_waits) > 0.01, "the fast worker was never held"
    # Seen from outside too: the shard's clocks of the two workers never drift beyond S + 1
    # (a held worker's clock already counts the step it is waiting to start).
    assert max(gaps) <= staleness + 1
    # Every applied push recorded both staleness figures.
    reg = shard.metrics.registry
    applied = 2 * steps * len(keys)
    assert reg.get_sample_value("bitps_staleness_clock_gap_steps_count") == applied
    assert reg.get_sample_value("bitps_staleness_version_gap_updates_count") == applied
    assert reg.get_sample_value("bitps_staleness_version_gap_updates_sum") > 0
    assert reg.get_sample_value("bitps_pull_wait_seconds_count") > 0


# -- metrics ------------------------------------------------------------------------------------
def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


SHARD_METRICS = [
    "bitps_push_bytes_total", "bitps_pull_bytes_total", "bitps_push_latency_seconds_count",
    "bitps_pull_latency_seconds_count", "bitps_staleness_clock_gap_steps_count",
    "bitps_staleness_version_gap_updates_count", "bitps_updates_applied_total",
    "bitps_requests_total", "bitps_clock_steps", "bitps_min_clock_steps",
]
WORKER_METRICS = [
    "bitps_worker_push_bytes_total", "bitps_worker_pull_bytes_total",
    "bitps_worker_push_latency_seconds_count", "bitps_worker_pull_latency_seconds_count",
    "bitps_worker_min_clock_steps",
]


def test_live_metrics_endpoints_parse_and_move(cluster):
    (shard,) = cluster(1, mode="async", metrics_port=0)
    plan, keys = flat_plan(5000, 1)
    client = PSClient(ClientConfig(servers=servers_of([shard])))
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=client.metrics.registry)
    try:
        client.register(plan, {k: np.zeros(plan.keys[k].length, np.float32) for k in keys})
        grads = [np.ones(k.length, np.float32) for k in plan.keys]
        outs = [np.empty(k.length, np.float32) for k in plan.keys]

        def steps(first: int, n: int) -> None:
            for t in range(first, first + n):
                client.push_pull(keys, grads, outs, clock=t).wait()
                client.metrics.clock.set(t + 1)

        steps(0, 3)
        before = (_scrape(shard.ports["metrics_port"]), _scrape(httpd.server_port))
        steps(3, 4)
        after = (_scrape(shard.ports["metrics_port"]), _scrape(httpd.server_port))
    finally:
        client.close()
        httpd.shutdown()
        httpd.server_close()
    for names, b, a in ((SHARD_METRICS, before[0], after[0]),
                        (WORKER_METRICS, before[1], after[1])):
        for name in names:
            assert name in a, name
            assert a[name] > b[name], f"{name} did not move: {b[name]} -> {a[name]}"
    assert after[0]["bitps_updates_applied_total"] == 7 * len(keys)
    assert after[1]["bitps_worker_push_bytes_total"] == 7 * 5000 * 4
    assert after[1]["bitps_worker_clock_steps"] == 7


# -- errors over the wire -----------------------------------------------------------------------
def test_bad_requests_get_typed_errors_over_zmq_and_change_nothing(cluster):
    (shard,) = cluster(1, mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    plan, keys = flat_plan(1000, 1)
    client = PSClient(ClientConfig(servers=servers_of([shard])))
    start = np.arange(1000, dtype=np.float32)
    client.register(plan, {k.key: start[k.offset:k.offset + k.length] for k in plan.keys})
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{shard.ports['data_port']}")

    def ask(frames) -> pb.DataHeader:
        sock.send_multipart(frames)
        reply = pb.DataHeader()
        reply.ParseFromString(sock.recv_multipart()[0])
        return reply

    def header(**kw) -> bytes:
        base = dict(op=pb.PUSH, protocol=PROTOCOL, worker=0, request_id=7, clock=0,
                    keys=[keys[0]], dtype=pb.FLOAT32, incarnation=0x7E57)
        return pb.DataHeader(**{**base, **kw}).SerializeToString()

    good = np.ones(plan.keys[0].length, np.float32).tobytes()
    cases = {
        pb.BAD_HEADER: [b"\x08\xff\xff garbage"],
        pb.UNKNOWN_KEY: [header(keys=[999]), good],
        pb.BAD_LENGTH: [header(), good[:-4]],
        pb.BAD_DTYPE: [header(dtype=pb.FLOAT16), good],
        pb.UNKNOWN_OP: [header(op=42), good],
        pb.NOT_REGISTERED: [header(worker=5), good],
        pb.FRAME_COUNT: [header(), good, good],
    }
    for code, frames in cases.items():
        reply = ask(frames)
        assert reply.op == pb.ERROR and reply.error == code, (pb.ErrorCode.Name(code), reply)
        assert reply.message
    assert "999" in ask(cases[pb.UNKNOWN_KEY]).message
    sock.close()
    # Still serving, nothing changed.
    outs = [np.empty(k.length, np.float32) for k in plan.keys]
    client.pull(keys, outs, clock=0).wait()
    np.testing.assert_array_equal(np.concatenate(outs), start)
    assert shard.core.updates_applied == 0
    # A different model signature is refused with a typed error.
    other, _ = flat_plan(1001, 1)
    intruder = PSClient(ClientConfig(servers=servers_of([shard]), rank=1, world_size=2))
    with pytest.raises(PSError) as err:
        intruder.register(other)
    assert err.value.code == pb.BAD_HEADER and "signature" in err.value.message
    intruder.close(leave=False)
    client.close()


def test_held_pull_times_out_and_status_names_who_is_late(cluster):
    (shard,) = cluster(1, mode="sync", heartbeat_timeout_s=30)
    plan, keys = flat_plan(100, 1)
    client = PSClient(ClientConfig(servers=servers_of([shard]), rank=0, world_size=2,
                                   deadline_s=1.0))
    client.register(plan, {k: np.zeros(100, np.float32) for k in keys})
    grads, outs = [np.ones(100, np.float32)], [np.empty(100, np.float32)]
    handle = client.push_pull(keys, grads, outs, clock=0)
    time.sleep(0.2)
    status = client.status(0)
    assert status.mode == "sync" and status.initialized and status.num_keys == len(keys)
    (w0,) = [w for w in status.workers if w.rank == 0]
    assert w0.pending_pulls == 1 and "lacks pushes from workers [1]" in w0.waiting_for
    with pytest.raises(PSTimeoutError) as err:
        handle.wait()
    # Whichever side gives up first, the error names the worker and the step it waited on.
    assert "worker 0" in str(err.value) and "clock" in str(err.value)
    client.close()


def test_psmodel_pushes_zeros_for_parameters_without_gradients(cluster):
    torch = pytest.importorskip("torch")
    from bitps.worker.training.model import PSModel

    (shard,) = cluster(1, mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    model = torch.nn.ModuleDict({"used": used, "unused": unused})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ps_model = PSModel(model, PSClient(ClientConfig(servers=servers_of([shard]))))
    used(torch.ones(3, 4)).sum().backward()
    ps_model.step()
    ps_model.close()
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == name.startswith("used"), name
        assert p.grad is None


def test_token_is_required_on_control_and_data_planes(cluster):
    (shard,) = cluster(1, mode="async", token="s3cret")
    plan, keys = flat_plan(100, 1)
    values = {k: np.zeros(100, np.float32) for k in keys}
    stranger = PSClient(ClientConfig(servers=servers_of([shard])))
    with pytest.raises(PSError) as err:
        stranger.register(plan, values)
    assert err.value.code == pb.UNAUTHENTICATED
    stranger.close(leave=False)
    member = PSClient(ClientConfig(servers=servers_of([shard]), token="s3cret"))
    member.register(plan, values)
    outs = [np.empty(100, np.float32)]
    member.push_pull(keys, [np.ones(100, np.float32)], outs, clock=0).wait()
    assert shard.core.updates_applied == 1
    member.cfg = ClientConfig(servers=servers_of([shard]), token="wrong")
    with pytest.raises(PSError) as err:
        member.pull(keys, outs, clock=1).wait()
    assert err.value.code == pb.UNAUTHENTICATED
    member.close(leave=False)
