"""The RuleState fetch (``ControlClient.rule_state``) streams every shard at once: a worker
fetching 1-bit Adam's m and v at the switch waits for the slowest shard, not for the sum of all
(the state is as large as the model). Fake stubs stand in for the shards' gRPC streams."""

from __future__ import annotations

import threading

import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.proto.wire import PSError
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.control import ControlClient


class _Stream:
    """A RuleState stream: waits at ``barrier`` (every shard's stream open at once), then
    yields one state per key, or raises ``error`` instead."""

    def __init__(self, states, barrier, error=None):
        self.states, self.barrier, self.error = states, barrier, error
        self.cancelled = False

    def __iter__(self):
        self.barrier.wait()
        if self.error is not None:
            raise self.error
        yield from self.states

    def cancel(self):
        self.cancelled = True


class _Stub:
    def __init__(self, stream):
        self.stream = stream

    def RuleState(self, request, timeout=None, metadata=None):  # noqa: N802 (gRPC's name)
        return self.stream


def _client_and_plan(shards: int):
    plan = make_plan([ParamSpec(f"w{i}", (64,)) for i in range(2 * shards)], num_shards=shards)
    client = ControlClient(ClientConfig(servers=tuple(f"127.0.0.1:{1 + i}"
                                                      for i in range(shards))),
                           metrics=WorkerMetrics())
    return client, plan


def test_every_shard_is_streamed_at_once():
    client, plan = _client_and_plan(3)
    barrier = threading.Barrier(3, timeout=10)  # broken if the streams are read one by one
    by_shard = {s: [pb.KeyRuleState(key=k.key, version=4) for k in plan.for_shard(s)]
                for s in range(3)}
    client.stubs = tuple(_Stub(_Stream(by_shard[s], barrier)) for s in range(3))
    loaded, lock = [], threading.Lock()

    def load(state, n):
        with lock:
            loaded.append((state.key, n))

    try:
        client.rule_state([k.key for k in plan.keys], load, plan=plan,
                          versions={k.key: 4 for k in plan.keys})
    finally:
        client.close()
    assert sorted(loaded) == sorted((k.key, k.length) for k in plan.keys)


def test_a_refused_state_raises_the_lowest_failing_shards_error_after_the_others_end():
    client, plan = _client_and_plan(3)
    barrier = threading.Barrier(3, timeout=10)
    states = {s: [pb.KeyRuleState(key=k.key, version=4) for k in plan.for_shard(s)]
              for s in range(3)}
    states[2][0].version = 3  # shard 2 answers a state of another version
    streams = [_Stream(states[0], barrier),
               _Stream([], barrier, error=PSError(pb.NOT_REGISTERED, "shard 1 is gone",
                                                   shard=1)),
               _Stream(states[2], barrier)]
    client.stubs = tuple(_Stub(s) for s in streams)
    loaded = []
    try:
        with pytest.raises(PSError) as err:
            client.rule_state([k.key for k in plan.keys], lambda st, n: loaded.append(st.key),
                              plan=plan, versions={k.key: 4 for k in plan.keys})
    finally:
        client.close()
    assert err.value.code == pb.NOT_REGISTERED and err.value.shard == 1
    assert streams[1].cancelled and streams[2].cancelled and not streams[0].cancelled
    assert set(loaded) >= {k.key for k in plan.for_shard(0)}
