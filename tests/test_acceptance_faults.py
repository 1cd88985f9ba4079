"""The acceptance scenarios of issue 17 on real processes: ``bitps-server`` shards and
``bitps-worker`` ranks training the demo model on loopback (``bench/faults.py`` starts, kills,
stops and continues them, by pid).

1. A shard killed with ``kill -9`` mid-run and restarted with the same flags and ports, in async
   and sync: both workers finish every step; the restarted shard holds its newest checkpoint
   bit for bit; fewer than one checkpoint interval of updates is lost; in sync, with a
   checkpoint every step, ``bitps-export`` of the run equals an uninterrupted run's bit for bit,
   and the exported file loads strictly into the demo model. The shard is killed once the
   workers are frozen and its newest checkpoint is on disk (the kill lands mid-exchange; the
   frozen workers let the test read the restarted shard before they push again). Killed while
   a sync step's checkpoint is being written, no step is lost either: the step's replies wait
   until its checkpoint is on disk (``checkpoint_durable``), so the workers redo it.
2. A worker killed with ``kill -9`` in ssp: the other passes the staleness bound once the shards
   drop the dead rank (within the heartbeat timeout), a replacement under the same rank joins
   at the live clock and both finish; every push applied once. A worker stopped with SIGSTOP
   and continued is ``test_faults.py::test_a_stopped_worker_in_ssp_is_dropped_then_resumes_
   without_harm`` (not repeated here).
3. A rolling restart (issue 29): both shards SIGTERMed and started again one after the
   other mid-run, in sync and ssp: every worker exits 0, and in sync the export equals an
   uninterrupted run's bit for bit.
4. Export: ``test_checkpoint.py::test_export_rebuilds_the_model_and_torch_loads_it_with_the_live_
   loss`` proves in one process that the exported loss equals the live model's; here the
   process run's export loads with ``strict=True`` and its loss is below the initial model's.

Every worker process imports torch and transformers (about 8 s of CPU each), so the model is
tiny (``--seq-len 16 --batch-size 2``) and the runs are 20 steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bitps.bench.faults import ROOT, Proc, ServerProcess, start_server, wait_clock

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from bitps.ps.checkpoint import load_latest  # noqa: E402
from bitps.ps.export import main as export_main  # noqa: E402

STEPS, KILL_AT = 20, 8
DEMO = ("--seq-len", "16", "--batch-size", "2", "--corpus-bytes", "20000")
WORKER = (*DEMO, "--threads", "1", "--overlap", "off", "--json", "--metrics-port", "-1",
          "--log-every", "1", "--deadline", "2", "--reconnect-timeout", "30",
          "--reconnect-backoff", "0.05", "--reconnect-backoff-max", "0.2")
SHARD = ("--num-shards", "2", "--optimizer", "adam", "--lr", "0.003")


@pytest.fixture(scope="module")
def keys_per_shard() -> list[int]:
    """Keys of the demo model's plan on each of 2 shards: one sync step updates each once."""
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker.demo import DemoConfig, build_model

    model = build_model(DemoConfig(seq_len=16, batch_size=2, corpus_bytes=20000))
    plan = make_plan([ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters()],
                     num_shards=2)
    return [len(plan.for_shard(s)) for s in range(2)]


class Cluster:
    """The processes of one test, each killed at the end (by pid); logs under ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs, self.logs = tmp, [], []

    def _log(self, name: str):
        path = self.tmp / f"{name}-{len(self.logs)}.log"
        self.logs.append(f := open(path, "w"))  # noqa: SIM115
        return f

    def shard(self, *flags: str) -> ServerProcess:
        self.procs.append(s := start_server(*flags, "--log-level", "INFO",
                                            stderr=self._log("shard")))
        return s

    def worker(self, servers, rank: int, steps: int, *extra: str) -> Proc:
        popen = subprocess.Popen(
            [sys.executable, "-m", "bitps.worker", "--servers", ",".join(servers),
             "--rank", str(rank), "--world-size", "2", "--steps", str(steps), *WORKER, *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=(log := self._log(f"worker{rank}")),
            text=True)
        self.procs.append(w := Proc(popen))
        w.log = Path(log.name)
        return w

    def close(self) -> None:
        for p in self.procs:
            if p.alive():
                p.cont()
            p.kill()
        for f in self.logs:
            f.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def _finish(worker: Proc, timeout: float = 90) -> list[dict]:
    """The worker's JSON events once it exited 0."""
    rc = worker.popen.wait(timeout)
    events = [json.loads(line) for line in worker.popen.stdout.read().splitlines()]
    assert rc == 0, (rc, events[-3:])
    return events


def _terminate(shard: ServerProcess) -> None:
    """SIGTERM: the shard writes its final checkpoint and exits 0."""
    shard.popen.send_signal(signal.SIGTERM)
    assert shard.popen.wait(30) == 0


def _kill_while_writing(shard: ServerProcess, directory: Path, timeout: float = 10) -> None:
    """``kill -9`` the shard while a checkpoint is being written: a ``.tmp-`` directory
    without its manifest (written last; a pruned checkpoint renamed to ``.tmp-`` has one)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in directory.glob(".tmp-*"):
            if not (entry / "manifest.json").exists():
                shard.kill()
                return
    raise TimeoutError(f"no checkpoint was being written in {directory} for {timeout} s")


def _wait(cond, timeout: float):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def _settled(shard: ServerProcess, directory: Path, every: int, timeout: float = 10):
    """With the workers stopped: the shard's Status once its count is steady and its newest
    checkpoint is on disk (fewer than ``every`` updates behind), and that checkpoint."""
    end = time.monotonic() + timeout
    before = shard.status().updates_applied
    while True:
        time.sleep(0.1)
        status, ckpt = shard.status(), load_latest(directory)
        if status.updates_applied == before and ckpt is not None and \
                status.updates_applied - ckpt.updates < every:
            return status, ckpt
        assert time.monotonic() < end, (status.updates_applied, ckpt and ckpt.updates)
        before = status.updates_applied


def _export(dirs, out: Path) -> dict[str, np.ndarray]:
    assert export_main(["--checkpoint-dir", *map(str, dirs), "--out", str(out)]) == 0
    return safetensors_numpy.load_file(str(out))


def _kill_frozen(mode: str, shard: ServerProcess, workers, directory: Path, every: int) -> int:
    """Freeze the workers mid-step, let the shard finish what reached it and its background
    write, ``kill -9`` it; the updates after the newest checkpoint, fewer than ``every``."""
    workers[1].stop()
    if mode == "sync":
        # worker 0 pushes its step and waits in a pull on the shard for worker 1's push: the
        # kill lands mid-exchange, and worker 0 has to recover the shard and redo it
        _wait(lambda: any(w.rank == 0 and w.pending_pulls for w in shard.status().workers), 10)
    workers[0].stop()
    before, newest = _settled(shard, directory, every)
    shard.kill()
    assert load_latest(directory).path == newest.path
    lost = before.updates_applied - newest.updates
    assert 0 <= lost < every
    return lost


def _restart(cluster, dead: ServerProcess, flags, directory: Path) -> ServerProcess:
    """Restart a killed shard with its flags and ports, the workers frozen; check that it
    holds the checkpoint the kill left: its counts and clocks, and that SIGTERM before any
    request writes no final checkpoint (nothing changed: the restored one stands, issue 29).
    The restored arrays bit for bit: tests/test_checkpoint.py."""
    ckpt = load_latest(directory)
    ports = ("--grpc-port", str(dead.ready["grpc_port"]),
             "--data-port", str(dead.ready["data_port"]))
    again = cluster.shard(*flags, *ports)
    status = again.status()
    assert status.updates_applied == ckpt.updates and status.initialized
    assert status.num_keys == len(ckpt.params)
    assert {w.rank: w.clock for w in status.workers} == \
        {w["rank"]: w["clock"] for w in ckpt.manifest["clocks"]["workers"]}
    _terminate(again)
    assert load_latest(directory).path == ckpt.path
    again = cluster.shard(*flags, *ports)
    assert again.status().updates_applied == ckpt.updates
    return again


def _run(cluster, mode: str, dirs, every, *, kill: bool, while_writing: bool = False):
    """2 shards (checkpoints into ``dirs``, every ``every[i]`` updates) and 2 workers training
    ``STEPS`` steps; with ``kill``, shard 1 is killed with ``kill -9`` once worker 1 is at
    ``KILL_AT`` and restarted on the same ports: once the workers are frozen and the newest
    checkpoint is on disk, or (``while_writing``) as soon as a checkpoint is being written.
    Returns the shards, the workers and the updates after the newest checkpoint at the kill
    (``None`` when not known)."""
    flags = [(*SHARD, "--shard-id", str(i), "--mode", mode, "--heartbeat-timeout", "30",
              "--checkpoint-dir", str(dirs[i]),
              *(("--checkpoint-every-updates", str(every[i])) if every[i] else ()))
             for i in range(2)]
    shards = [cluster.shard(*f) for f in flags]
    servers = [s.grpc_address for s in shards]
    workers = [cluster.worker(servers, r, STEPS) for r in range(2)]
    lost = None
    if kill:
        wait_clock(shards[1], 1, KILL_AT, timeout=90)
        if while_writing:
            _kill_while_writing(shards[1], dirs[1])
            for w in workers:
                w.stop()
        else:
            lost = _kill_frozen(mode, shards[1], workers, dirs[1], every[1])
        shards[1] = _restart(cluster, shards[1], flags[1], dirs[1])
        for w in workers:
            w.cont()
    for w in workers:
        done = _finish(w)[-1]
        assert done["event"] == "done" and done["steps"] == STEPS, done
    return shards, workers, lost


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_shard_killed_mid_run_restarts_from_its_checkpoint_and_training_completes(
        cluster, tmp_path, keys_per_shard, mode):
    every = keys_per_shard  # one step's worth: each push updates each of a shard's keys once
    dirs = [tmp_path / f"run/shard{i}" for i in range(2)]
    shards, workers, lost = _run(cluster, mode, dirs, every, kill=True)
    statuses = [s.status() for s in shards]
    pushes = 2 * STEPS if mode == "async" else STEPS  # updates per key, none lost
    assert statuses[0].updates_applied == pushes * every[0]
    # Lost for good: the updates after the newest checkpoint whose replies the workers had (the
    # rest were redone); fewer than one interval.
    lost_for_good = pushes * every[1] - statuses[1].updates_applied
    print(f"{mode}: {lost} updates after the newest checkpoint at the kill, {lost_for_good} "
          f"lost for good, of {pushes * every[1]}")
    assert 0 <= lost_for_good <= lost < every[1]
    if mode == "async":
        return
    # Sync loses none: the step's replies went out after its last push, and its checkpoint
    # was on disk; worker 0's push of the step after was lost with the shard and redone.
    assert lost_for_good == 0
    log = workers[0].log.read_text()
    # Shard 1 was recovered with nothing lost. Shard 0 may be recovered too: worker 0 was
    # frozen past its pull's deadline there, and a redo to a shard that kept its clock is
    # answered from the exactly-once window. Or worker 0's pull was answered before the kill
    # (worker 1's push was on its way when worker 1 froze, and the shard finishes what
    # reached it): then the new life is found from its incarnation before the next request
    # (a full run of 2026-12-06 failed on that timing, its counts and clocks all as here).
    assert re.search(r"recovering shards \[(\d+, )*1\]|shard 1 restarted \(incarnation",
                     log), log
    assert "steps of updates lost" not in log, log
    for s in statuses:
        assert {w.rank: w.clock for w in s.workers} == {0: STEPS, 1: STEPS}
    for s in shards:
        _terminate(s)
    got = _export(dirs, tmp_path / "run.safetensors")

    ref_dirs = [tmp_path / f"ref/shard{i}" for i in range(2)]
    ref_shards, _, _ = _run(cluster, mode, ref_dirs, (0, 0), kill=False)
    for s in ref_shards:
        _terminate(s)
    want = _export(ref_dirs, tmp_path / "ref.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    _exported_model_loads_and_is_trained(got)


# Found by this test: a step's replies left before its checkpoint was on disk; now a due
# checkpoint is durable first (ServerConfig.checkpoint_durable).
def test_a_sync_shard_killed_while_writing_a_step_checkpoint_loses_no_step(
        cluster, tmp_path, keys_per_shard):
    every = keys_per_shard
    dirs = [tmp_path / f"run/shard{i}" for i in range(2)]
    shards, _, _ = _run(cluster, "sync", dirs, every, kill=True, while_writing=True)
    applied = shards[1].status().updates_applied
    print(f"sync, killed while writing: {STEPS * every[1] - applied} updates lost for good")
    assert applied == STEPS * every[1]


def _exported_model_loads_and_is_trained(tensors: dict[str, np.ndarray]) -> None:
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn

    demo = DemoConfig(seq_len=16, batch_size=2, corpus_bytes=20000)
    initial = build_model(demo)
    trained = build_model(DemoConfig(**{**demo.__dict__, "seed": 1}))
    trained.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    data = batches(load_corpus(demo.corpus_bytes), batch_size=16, seq_len=16, rank=0,
                   world_size=1, seed=7)
    x, y = next(data)
    with torch.no_grad():
        before, after = loss_fn(initial, x, y).item(), loss_fn(trained, x, y).item()
    assert np.isfinite(after) and after < before - 0.1, (before, after)


def test_a_killed_ssp_worker_is_dropped_and_a_replacement_under_its_rank_joins(
        cluster, keys_per_shard):
    hb, staleness, steps, extra = 2.5, 2, 60, 10
    shards = [cluster.shard(*SHARD, "--shard-id", str(i), "--mode", "ssp", "--staleness",
                            str(staleness), "--heartbeat-timeout", str(hb)) for i in range(2)]
    servers = [s.grpc_address for s in shards]
    paced = ("--step-delay", "0.2")
    w0, w1 = (cluster.worker(servers, r, steps, *paced) for r in range(2))
    wait_clock(shards[1], 1, 5, timeout=90)
    w1.kill()
    t_kill = time.monotonic()
    dead = [{w.rank: w.clock for w in s.status().workers}[1] for s in shards]
    # Worker 0 passes the SSP bound of the dead rank's clock once the shards drop it.
    status = wait_clock(shards[1], 0, dead[1] + staleness + 2, timeout=hb + 10)
    waited = time.monotonic() - t_kill
    assert waited < hb + 3, waited
    gone = {w.rank: w for w in status.workers}[1]
    assert gone.dropped and not gone.live and gone.clock == dead[1], gone
    # Started once the drop is seen: started at the kill, it imported and registered before
    # the drop on a quiet machine (CI, and 2 in 8 runs here: rank 1 live again, not dropped)
    replacement = cluster.worker(servers, 1, extra, *paced)
    start = json.loads(replacement.read_line(60))
    assert start["event"] == "start"
    first = json.loads(replacement.read_line(30))
    assert first["event"] == "step"
    # joined while worker 0 trains, at the live clock rather than the dead rank's
    assert w0.alive()
    joined_at = first["clock"] - 1
    assert joined_at > dead[1] + staleness, (joined_at, dead)
    live = [{w.rank: w.live for w in s.status().workers} for s in shards]
    assert all(v[1] for v in live), live
    assert _finish(w0)[-1]["steps"] == steps
    assert _finish(replacement)[-1]["steps"] == extra
    for s, k, d in zip(shards, keys_per_shard, dead):
        st = s.status()
        clocks = {w.rank: w.clock for w in st.workers}
        assert clocks.keys() == {0, 1} and clocks[0] == steps, clocks
        # the replacement registers with each shard in turn, at that shard's live clock, and
        # keeps each shard's own: worker 0 may end a step between the two registrations (1 in
        # 13 runs here: 34 on a shard, against the 35 the replacement's own clock gave)
        assert abs(clocks[1] - extra - joined_at) <= 1, (clocks, joined_at)
        # every push applied once: worker 0's, the replacement's, and the dead rank's (its
        # last step's messages may have reached a shard in part)
        assert k * (steps + extra + d - 1) < st.updates_applied <= k * (steps + extra + d), \
            (st.updates_applied, k, d)
        assert s.alive() and s.health() == 1
    waited_s = round(waited, 2)
    print(f"ssp: rank 1 killed at clocks {dead}; worker 0 past the bound after {waited_s} s; "
          f"replacement joined at clock {joined_at}")


def _rolling_run(cluster, mode: str, dirs, *, restart: bool):
    """2 shards (a final checkpoint at SIGTERM, no periodic ones) and 2 workers training
    ``ROLLING_STEPS`` paced steps; with ``restart``, SIGTERM shard 0 once worker 1 is at clock
    6 and start it again on its ports from its checkpoint, then shard 1 at clock 12, as a
    rolling update does. Returns the shards."""
    flags = [(*SHARD, "--shard-id", str(i), "--mode", mode, "--staleness", "2",
              "--heartbeat-timeout", "30", "--checkpoint-dir", str(dirs[i])) for i in range(2)]
    shards = [cluster.shard(*f) for f in flags]
    servers = [s.grpc_address for s in shards]
    workers = [cluster.worker(servers, r, ROLLING_STEPS, "--step-delay", "0.05")
               for r in range(2)]
    if restart:
        for i, clock in ((0, 6), (1, 12)):
            wait_clock(shards[i], 1, clock, timeout=90)
            ports = ("--grpc-port", str(shards[i].ready["grpc_port"]),
                     "--data-port", str(shards[i].ready["data_port"]))
            _terminate(shards[i])  # held pulls: SHUTTING_DOWN; then the final checkpoint
            shards[i] = cluster.shard(*flags[i], *ports)
    for w in workers:
        done = _finish(w)[-1]
        assert done["event"] == "done" and done["steps"] == ROLLING_STEPS, done
    for s in shards:
        assert {w.rank: w.clock for w in s.status().workers} == {0: ROLLING_STEPS,
                                                                  1: ROLLING_STEPS}
        _terminate(s)
    return workers


ROLLING_STEPS = 20


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_rolling_restart_of_both_shards_mid_run_loses_nothing(cluster, tmp_path, mode):
    """Issue 29: a Kubernetes rolling update SIGTERMs the shards one after the other. Every
    worker waits each restart out (a held pull answered ``SHUTTING_DOWN`` is recovered like a
    lost shard) and exits 0; in sync the run's export equals an uninterrupted run's bit for
    bit."""
    dirs = [tmp_path / f"run/shard{i}" for i in range(2)]
    workers = _rolling_run(cluster, mode, dirs, restart=True)
    logs = " ".join(w.log.read_text() for w in workers)
    assert "shard 0" in logs and "shard 1" in logs and "is back at clock" in logs, logs[-3000:]
    if mode != "sync":
        return
    got = _export(dirs, tmp_path / "run.safetensors")
    ref_dirs = [tmp_path / f"ref/shard{i}" for i in range(2)]
    _rolling_run(cluster, mode, ref_dirs, restart=False)
    want = _export(ref_dirs, tmp_path / "ref.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
