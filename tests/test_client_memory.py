"""A finished exchange holds nothing: what a push sent is freed when the caller lets go of it.

The defect (found 2026-12-06 while profiling a sync fp32 worker): a ``Handle`` kept its
``Request``s (for a redo) and every ``Request`` kept its ``Handle``, a reference cycle. Reference
counting never freed it, so a raw push's payloads, the step's gradients sent zero-copy, lived
until Python's cyclic collector ran: on the 28.6 M LM a worker's resident memory grew by about
150 MB a step between collections (1.2 GB to 2.4 GB in 8 steps), and every step's gradients
and activations landed in fresh pages (about 50,000 page faults a step against 19,000 after).
Real components: in-process shards on port 0, real sockets, a real ``PSClient`` and
``PSModel``; the collector is switched off so that only reference counting can free anything.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient

SGD = OptimizerConfig(name="sgd", lr=0.1)


@pytest.fixture
def no_collector():
    """The cyclic collector off (and its garbage kept) for the test's body; what it would
    have had to free is in ``gc.garbage`` after :func:`collected`."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    yield
    gc.set_debug(0)
    gc.garbage.clear()
    if was:
        gc.enable()
    gc.collect()


def collected() -> list[str]:
    """The types of what only the cyclic collector could free, found by running it once."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    return sorted({type(o).__name__ for o in gc.garbage})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_raw_push_frees_its_gradients_when_the_handle_is_dropped(cluster, no_collector, mode):
    (shard,) = cluster(1, mode=mode, optimizer=SGD)
    plan = make_plan([ParamSpec("w", (3 * 300_000,))], num_shards=1, partition_bytes=1 << 20)
    keys = [k.key for k in plan.keys]
    client = PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",)))
    try:
        params = np.zeros(3 * 300_000, np.float32)
        outs = [params[k.offset:k.offset + k.length] for k in plan.keys]
        client.register(plan, dict(zip(keys, outs)))
        for clock in range(4):
            if clock == 1:
                gc.collect()  # what the first exchange compiled (numba) is not the exchange's
            # big enough to go zero-copy (the frames ZeroMQ sends from the arrays themselves)
            grads = [np.full(k.length, 0.01, np.float32) for k in plan.keys]
            alive = [weakref.ref(g) for g in grads]
            handle = client.push_pull(keys, grads, outs, clock=clock)
            handle.wait()
            del grads, handle
            assert [r() is None for r in alive] == [True] * len(keys), (
                f"clock {clock}: a finished exchange still holds the pushed gradients")
        assert collected() == []
    finally:
        client.close()


def test_psmodel_raw_float32_steps_leave_nothing_for_the_collector(cluster, no_collector):
    from bitps.worker.config import EncoderConfig, OverlapConfig
    from bitps.worker.training.model import PSModel

    (shard,) = cluster(1, mode="sync", optimizer=SGD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    client = PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",)))
    # float32 pushes, no clip norm: the payloads are the gradients themselves
    ps = PSModel(model, client, encoder=EncoderConfig(clip_norm=0.0),
                 overlap=OverlapConfig(mode="off"))
    try:
        x = torch.randn(8, 64)
        for step in range(5):
            if step == 1:
                gc.collect()  # what the first step compiled or set up once
            model(x).square().mean().backward()
            grads = [weakref.ref(p.grad) for p in model.parameters()]
            ps.step()
            assert all(r() is None for r in grads), "a pushed gradient outlived its step"
        assert collected() == []
    finally:
        ps.close()
