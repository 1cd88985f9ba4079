"""Checkpoints driven by the shard process (issue 17): ``bitps-server --checkpoint-dir``.

A shard killed with SIGKILL and restarted on the same directory and ports serves exactly its
newest checkpoint (parameters, versions, clocks, updates) and refuses to apply again a push
applied before it; at most one interval of updates is lost. SIGTERM answers a held pull with
``SHUTTING_DOWN`` at once, writes a final checkpoint and exits 0 within seconds.
``--exit-when-done`` exits once every rank has left, never before one registered. Bad
combinations of the flags are refused by name.

Real ``bitps-server`` processes (their own ports, only they are killed) and in-process shards,
a real ``PSClient`` and a raw ZeroMQ peer.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from bitps.bench.faults import RawPeer as Raw
from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import ServerConfig, create_server
from bitps.ps.__main__ import parse_config
from bitps.ps.checkpoint import checkpoints, load_latest
from bitps.worker import ClientConfig, PSClient

ROOT = Path(__file__).resolve().parents[1]
N = 64  # one key of 64 float32: one push is one update


class Shard:
    """One ``bitps-server`` process and the ports of its ready line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bitps.ps", "--metrics-port", "-1", "--optimizer", "sgd",
             "--lr", "0.5", "--no-lookahead", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.ready = json.loads(line)

    def status(self) -> pb.StatusReply:
        with grpc.insecure_channel(f"127.0.0.1:{self.ready['grpc_port']}") as ch:
            return pb_grpc.ControlStub(ch).Status(pb.StatusRequest(), timeout=5)

    def client(self, rank: int = 0, world: int = 1) -> tuple[PSClient, list[int]]:
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        c = PSClient(ClientConfig(servers=(f"127.0.0.1:{self.ready['grpc_port']}",),
                                  rank=rank, world_size=world))
        c.register(plan, {k.key: np.zeros(k.length, np.float32) for k in plan.keys}
                   if rank == 0 else None)
        return c, [k.key for k in plan.keys]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def shards():
    started: list[Shard] = []

    def start(*args: str) -> Shard:
        started.append(shard := Shard(*args))
        return shard

    yield start
    for s in started:
        s.kill()


def _wait(cond, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < end, f"{what} not met within {timeout} s"
        time.sleep(0.05)
    return value


def _grad(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(N).astype(np.float32)


def test_a_killed_shard_restarts_from_its_newest_checkpoint_bit_for_bit(shards, tmp_path):
    """10 updates with a checkpoint every 4; the 8th is a raw push whose id the test knows.
    SIGKILL after the 8-update checkpoint is on disk: the 2 updates after it are lost (fewer
    than one interval). The restarted shard (same directory and ports) serves exactly that
    checkpoint: updates, every worker's clock, the key's version and parameters bit for bit,
    and a replay of the 8th push is acknowledged and not applied again."""
    every = 4
    args = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every-updates", str(every))
    a = shards(*args)
    client, keys = a.client()
    for clock in range(7):
        client.push(keys, [_grad(clock)], clock=clock).wait()
    raw = Raw(a.ready["data_port"])
    replayed = dict(op=pb.PUSH, worker=0, clock=7, keys=keys, incarnation=424242,
                    request_id=1 << 40)
    assert raw.ask([_grad(7).tobytes()], **replayed)[0].op == pb.REPLY
    for clock in (8, 9):
        client.push(keys, [_grad(clock)], clock=clock).wait()
    assert a.status().updates_applied == 10
    # the save is written in the background: wait for it, then kill mid-flight
    _wait(lambda: (c := load_latest(tmp_path)) is not None and c.updates == 8,
          what="the 8-update checkpoint")
    a.proc.kill()
    a.proc.wait()
    client.close(leave=False)
    raw.close()
    assert [int(p.name.split("-")[1]) for p in checkpoints(tmp_path)] == [8, 4]
    ckpt = load_latest(tmp_path)
    lost = 10 - ckpt.updates
    assert 0 <= lost < every

    b = shards(*args, "--grpc-port", str(a.ready["grpc_port"]),
               "--data-port", str(a.ready["data_port"]))
    assert b.ready["grpc_port"] == a.ready["grpc_port"]
    status = b.status()
    saved_clocks = {w["rank"]: w["clock"] for w in ckpt.manifest["clocks"]["workers"]}
    assert status.updates_applied == ckpt.updates == 8
    assert {w.rank: w.clock for w in status.workers} == saved_clocks
    raw = Raw(b.ready["data_port"])
    try:
        pull = dict(op=pb.PULL, worker=0, clock=saved_clocks[0], keys=keys)
        reply, frames = raw.ask(**pull)
        assert reply.op == pb.REPLY, reply.message
        assert list(reply.versions) == [ckpt.manifest["keys"][str(keys[0])]["version"]] == [8]
        assert frames[0] == ckpt.params[str(keys[0])].tobytes()
        # exactly once across the restart: the 8th push again, from a new connection
        again, _ = raw.ask([_grad(7).tobytes()], **replayed)
        assert again.op == pb.REPLY and again.request_id == replayed["request_id"]
        assert b.status().updates_applied == 8
        assert raw.ask(**pull)[1][0] == frames[0]
    finally:
        raw.close()


def test_sigterm_answers_a_held_pull_writes_a_final_checkpoint_and_exits_0(shards, tmp_path):
    """A sync shard holds rank 0's pull for clock 1 (rank 1 has not pushed) with a 60 s
    deadline. SIGTERM: the pull gets a SHUTTING_DOWN error within 2 s, the process exits 0
    within 5 s, and its final checkpoint (no interval set: the only one) holds rank 0's push
    summed into the open step."""
    shard = shards("--mode", "sync", "--checkpoint-dir", str(tmp_path))
    client, keys = shard.client(rank=0, world=2)
    client.push(keys, [_grad(0)], clock=0).wait()
    raw = Raw(shard.ready["data_port"])
    try:
        raw.send(op=pb.PULL, worker=0, clock=1, keys=keys, deadline_s=60)
        _wait(lambda: any(w.pending_pulls for w in shard.status().workers), what="a held pull")
        assert checkpoints(tmp_path) == []
        t0 = time.monotonic()
        shard.proc.send_signal(signal.SIGTERM)
        reply, _ = raw.recv(timeout_s=5)
        replied_s = time.monotonic() - t0
        assert reply.op == pb.ERROR and reply.error == pb.SHUTTING_DOWN, reply
        assert "shutting down" in reply.message and "clock 1" in reply.message
        assert shard.proc.wait(10) == 0
        exit_s = time.monotonic() - t0
    finally:
        raw.close()
        client.close(leave=False)
    print(f"SIGTERM: held pull answered in {replied_s:.3f} s, exit 0 in {exit_s:.3f} s")
    assert replied_s < 2 and exit_s < 5
    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.updates == 0
    info = ckpt.manifest["keys"][str(keys[0])]
    assert info["pushed"] == [0] and info["folded"] == 1
    assert ckpt.state[f"{keys[0]}/acc"].tobytes() == _grad(0).tobytes()
    assert "final checkpoint" in shard.proc.stderr.read()


def test_exit_when_done_waits_for_every_rank_to_register_and_leave(tmp_path):
    """``exit_when_done``: serve() keeps serving with nobody registered, with one rank of two
    registered and after it left; it returns once the second has registered and left, after a
    final checkpoint that records both as left."""
    shard = create_server(ServerConfig(metrics_port=-1, exit_when_done=True,
                                       checkpoint_dir=str(tmp_path)))
    served = threading.Thread(target=shard.serve, daemon=True)
    served.start()
    host = Shard.__new__(Shard)  # only for its client(): the ports of this in-process shard
    host.ready = shard.ports
    try:
        time.sleep(0.5)
        assert served.is_alive()  # nobody registered yet: not done
        first, _ = host.client(rank=0, world=2)
        first.close()
        time.sleep(0.5)
        assert served.is_alive()  # rank 1 never registered: not done
        second, _ = host.client(rank=1, world=2)
        t0 = time.monotonic()
        second.close()
        served.join(5)
        assert not served.is_alive(), "serve() did not return once every rank had left"
        print(f"exit_when_done: serve() returned {time.monotonic() - t0:.3f} s after the "
              f"last Leave")
    finally:
        shard.stop(0)
    workers = load_latest(tmp_path).manifest["clocks"]["workers"]
    assert [(w["rank"], w["registered"], w["left"]) for w in workers] == [
        (0, True, True), (1, True, True)]


def test_exit_when_done_exits_the_process_with_status_0(shards):
    shard = shards("--exit-when-done")
    client, _ = shard.client()
    client.close()
    assert shard.proc.wait(10) == 0


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint-every-updates", "100"],
     "checkpoint_every_updates 100 given without checkpoint_dir"),
    (["--checkpoint-every-s", "30"], "checkpoint_every_s 30.0 given without checkpoint_dir"),
    (["--checkpoint-keep", "5"], "checkpoint_keep 5 given without checkpoint_dir"),
    (["--checkpoint-dir", "d", "--checkpoint-keep", "0"], "checkpoint_keep must be >= 1, got 0"),
    (["--checkpoint-dir", "d", "--checkpoint-every-updates", "-1"],
     "checkpoint_every_updates and checkpoint_every_s must be >= 0 (0 = off), got -1 and 0.0"),
    (["--checkpoint-dir", "d", "--checkpoint-every-s", "nan"],
     "checkpoint_every_s must be >= 0 (0 = off), got 0 and nan"),
])
def test_bad_checkpoint_settings_are_refused_by_name(argv, message):
    with pytest.raises(ValueError) as err:
        parse_config(argv, environ={})
    assert message in str(err.value)


def test_the_server_refuses_bad_checkpoint_flags_and_an_unusable_directory(tmp_path):
    """Exit status 2 and the reason for a combination; 1 and the path for a directory that
    is a file, before anything is served."""
    out = subprocess.run([sys.executable, "-m", "bitps.ps", "--checkpoint-every-s", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "checkpoint_every_s 30.0 given without checkpoint_dir" \
        in out.stderr
    (blocker := tmp_path / "file").write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "bitps.ps", "--metrics-port", "-1",
                          "--checkpoint-dir", str(blocker)],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and str(blocker) in out.stderr and not out.stdout


def test_the_final_checkpoint_is_written_only_when_something_changed(tmp_path):
    """Issue 29: a stop right after a periodic checkpoint wrote a final one with the same
    state, so ``--checkpoint-keep 3`` held two distinct states. Now the final checkpoint is
    left out when nothing changed since the newest one's copy; a change (here: the worker
    left) still gets one."""
    def run(directory: Path, *, leave: bool) -> list[int]:
        shard = create_server(ServerConfig(mode="async", metrics_port=-1, checkpoint_keep=3,
                                           checkpoint_dir=str(directory),
                                           checkpoint_every_updates=1))
        plan = make_plan([ParamSpec("w", (N,))], num_shards=1, partition_bytes=1 << 20)
        client = PSClient(ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",)))
        client.register(plan, {k.key: np.zeros(k.length, np.float32) for k in plan.keys})
        keys = [k.key for k in plan.keys]
        try:
            for step in range(3):
                client.push(keys, [_grad(step)], clock=step).wait()
            _wait(lambda: shard.checkpointer.last_path is not None
                  and shard.checkpointer.last_path.name.startswith("ckpt-000000000003"),
                  what="the periodic checkpoint of update 3")
            if leave:
                client.close()
        finally:
            shard.stop(0)
            client.close(leave=False)
        # the updates applied each kept checkpoint holds, and whether its worker had left
        out = []
        for path in checkpoints(directory):
            manifest = json.loads((path / "manifest.json").read_text())
            out.append((manifest["core"]["updates_applied"],
                        manifest["clocks"]["workers"][0]["left"]))
        return out

    assert run(tmp_path / "idle", leave=False) == [(3, False), (2, False), (1, False)]
    assert run(tmp_path / "left", leave=True) == [(3, True), (3, False), (2, False)]
