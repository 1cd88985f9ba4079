"""The hang doctor: a shard's Status names whom each held pull waits for, and ``bitps-status``
(a real subprocess against in-process shards on port 0, two raw ``PSClient``s, one of which
stops pushing) names the stalled rank, the waiting rank and the shard; a shard that is down is
reported and makes the exit status non-zero."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient
from bitps.worker.launch import status, waits

HEARTBEAT_S = 1.0
_SCRIPT = Path(sys.executable).with_name("bitps-status")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m",
                                                "bitps.worker.launch.status"]


def _servers(shards) -> str:
    return ",".join(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})


def _closed_port() -> int:
    """A loopback port nothing listens on (bound by the OS, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stalled(cluster):
    """``stalled(mode)``: one shard, ranks 0 and 1 registered, rank 0's push_pull of step 0
    held because rank 1 stopped pushing (it still heartbeats). Returns the shard, both
    clients and rank 0's handle; rank 1's step afterwards releases it."""
    made = []

    def make(mode: str):
        (shard,) = cluster(1, mode=mode, staleness=0, heartbeat_timeout_s=30,
                           optimizer=OptimizerConfig(name="sgd", lr=0.1))
        plan = make_plan([ParamSpec("w", (64,))], num_shards=1)
        keys = [k.key for k in plan.keys]
        clients = [PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                                         rank=r, world_size=2, deadline_s=30,
                                         heartbeat_s=HEARTBEAT_S)) for r in (0, 1)]
        clients[0].register(plan, {k: np.zeros(64, np.float32) for k in keys})
        clients[1].register(plan)
        made.extend(clients)
        grads = [np.ones(64, np.float32) for _ in keys]
        handle = clients[0].push_pull(keys, grads, [np.empty(64, np.float32) for _ in keys],
                                      clock=0)
        return shard, clients, handle, (keys, grads)

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_status_names_the_stalled_rank_within_a_heartbeat(stalled, mode):
    shard, clients, handle, (keys, grads) = stalled(mode)
    t0 = time.monotonic()
    while not clients[0].status(0).held_pulls:  # the push_pull is on its way to the shard
        assert time.monotonic() - t0 < HEARTBEAT_S, "the held pull never showed in Status"
        time.sleep(0.01)
    reply = clients[0].status(0)
    (w0, w1) = reply.workers
    assert (w0.clock, w1.clock, reply.min_clock, reply.max_clock) == (1, 0, 0, 1)
    assert (w0.clock_lead, w1.clock_lag, w0.registered, w1.dropped) == (1, 1, True, False)
    (held,) = w0.held
    assert (held.clock, list(held.waiting_for), held.num_keys) == (1, [1], len(keys))
    assert 0 <= held.waited_s < HEARTBEAT_S and held.deadline_in_s > 0
    assert w0.waiting_for == held.reason and w0.pending_pulls == 1

    run = _cli("--servers", _servers([shard]), "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["ok"] and doc["shards"][0]["mode"] == mode
    (stall,) = doc["stalled"]
    assert (stall["rank"], stall["waited_by"], stall["shards"]) == (1, [0], [0])
    assert stall["state"] == "live" and stall["last_heard_s"] < 30
    assert [w["waits_for"] for w in doc["workers"]] == [[1], []]
    assert doc["findings"][0].startswith("rank 1 is waited for by rank 0 on shard 0 for ")

    # rank 1 catches up: the pull is answered and nobody waits any more
    clients[1].push_pull(keys, grads, [np.empty(64, np.float32) for _ in keys], clock=0).wait()
    handle.wait()
    assert not waits.merge(waits.fetch(_servers([shard]).split(",")))["stalled"]


def test_human_output_names_the_stalled_worker(stalled):
    shard, *_ = stalled("sync")
    time.sleep(0.2)
    run = _cli("--servers", _servers([shard]))
    assert run.returncode == 0, run.stderr
    assert "rank 1 is waited for by rank 0 on shard 0 for " in run.stdout
    assert "last heard" in run.stdout and "it still heartbeats" in run.stdout
    assert "workers" in run.stdout and "shards" in run.stdout


def test_a_shard_that_is_down_is_reported_and_fails_the_exit_status(cluster):
    (shard,) = cluster(1, mode="async")
    down = f"127.0.0.1:{_closed_port()}"
    run = _cli("--servers", f"{_servers([shard])},{down}", "--json", "--timeout", "3")
    assert run.returncode == 1, run.stderr
    doc = json.loads(run.stdout)
    assert not doc["ok"] and doc["shards"][0]["answered"]
    assert doc["shards"][1] == {"index": 1, "server": down, "answered": False,
                                "error": doc["shards"][1]["error"]}
    assert "UNAVAILABLE" in doc["shards"][1]["error"]
    assert doc["findings"] == [f"shard 1 ({down}) did not answer: {doc['shards'][1]['error']}"]
    human = _cli("--servers", down, "--timeout", "3")
    assert human.returncode == 1 and f"shard 0 ({down}) did not answer" in human.stdout


def test_token_is_sent_and_a_wrong_one_is_a_failed_shard(cluster, capsys):
    (shard,) = cluster(1, mode="async", token="s3cret")
    servers = _servers([shard])
    assert status.main(["--servers", servers, "--token", "s3cret", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"][0]["answered"]
    assert status.main(["--servers", servers, "--token", "wrong", "--json"]) == 1
    assert "UNAUTHENTICATED" in json.loads(capsys.readouterr().out)["shards"][0]["error"]


def test_bad_flags_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("BITPS_SERVERS", raising=False)
    assert status.main([]) == 2
    assert "--servers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        status.main(["--servers", "x:1", "--watch", "soon"])
    assert exit_.value.code == 2


# -- the pure parts: merging and the worker's one line -------------------------------------------
def _worker(rank, clock, *, seen=0.1, held=(), registered=True, **kw) -> pb.WorkerStatus:
    return pb.WorkerStatus(rank=rank, clock=clock, live=registered, seconds_since_seen=seen,
                           registered=registered, held=held, pending_pulls=len(held), **kw)


def _held(clock, waiting_for, waited=3.2) -> pb.HeldPullStatus:
    return pb.HeldPullStatus(clock=clock, waited_s=waited, waiting_for=waiting_for,
                             reason="words")


def test_merge_over_shards_names_every_waiter_and_a_silent_or_absent_rank():
    answers = [waits.ShardAnswer(i, f"h:{i}", reply=pb.StatusReply(
        shard_id=i, mode="sync", heartbeat_timeout_s=10, workers=[
            _worker(0, 4, held=[_held(5, [2, 3], waited=1.0 + i)]),
            _worker(1, 5, held=[_held(5, [2])], samples_per_s=2.5 + i),
            _worker(2, 4, seen=9.0),
            _worker(3, 0, registered=False)])) for i in range(2)]
    doc = waits.merge(answers)
    by_rank = {s["rank"]: s for s in doc["stalled"]}
    assert by_rank[2]["waited_by"] == [0, 1] and by_rank[2]["shards"] == [0, 1]
    assert by_rank[2]["waited_s"] == 3.2
    assert doc["findings"][0] == (
        "rank 2 is waited for by ranks 0, 1 on shards 0, 1 for 3.2 s; last heard 9.0 s ago "
        "(silent: dead, hung or cut off? shards drop it after 10 s of silence)")
    assert doc["findings"][1] == ("rank 3 is waited for by rank 0 on shards 0, 1 for 2.0 s; "
                                  "it has not registered (is it running?)")
    assert [w["state"] for w in doc["workers"]] == ["live", "live", "live", "absent"]
    # a rank's compute speed as BatchBalance reports it: the largest any shard has
    assert [w["samples_per_s"] for w in doc["workers"]] == [0.0, 3.5, 0.0, 0.0]


def test_explain_wait_names_whom_and_describe_wait_never_raises():
    reply = pb.StatusReply(shard_id=1, workers=[_worker(0, 3, held=[_held(3, [1])]),
                                                _worker(1, 1, seen=0.5)])
    assert waits.explain_wait(reply, 0) == (
        "shard 1 holds rank 0's pull for clock 3 (3.2 s, 1 held), waiting for rank 1 "
        "(clock 1, last heard 0.5 s ago)")
    assert waits.explain_wait(reply, 1).startswith("shard 1 holds no pull of rank 1")
    assert waits.describe_wait(lambda: reply, 0) == waits.explain_wait(reply, 0)
    with grpc.insecure_channel(f"127.0.0.1:{_closed_port()}") as ch:
        line = waits.describe_wait(pb_grpc.ControlStub(ch), 0, timeout_s=2)
    assert line.startswith("the shard did not answer Status: UNAVAILABLE")
