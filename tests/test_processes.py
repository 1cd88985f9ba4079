"""Real processes on loopback: the shard CLI, and bitps-launch running a whole cluster.

Few and purposeful: each worker process imports torch + transformers (seconds on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_server_prints_ready_serves_health_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "bitps.ps", "--metrics-port", "0",
                             "--mode", "ssp"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["shard_id"] == 0
        assert all(ready[k] > 0 for k in ("grpc_port", "data_port", "metrics_port"))
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="bitps.Control"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert _metrics(ready["metrics_port"])["bitps_live_workers"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_server_rejects_bad_flags():
    out = subprocess.run([sys.executable, "-m", "bitps.ps", "--staleness", "-1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "staleness must be >= 0, got -1" in out.stderr


def _launch(tmp_path: Path, *extra: str, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--workers", "2",
         "--mode", "async", "--run-dir", str(tmp_path), *extra, "--", "--steps", str(steps),
         "--seq-len", "64", "--log-every", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.2)
    return json.loads(path.read_text())


def test_launch_async_cluster_trains_with_live_metrics(tmp_path):
    proc = _launch(tmp_path, "--expect-loss-drop", "0.3", steps=120)
    try:
        cluster = _wait_for(tmp_path / "cluster.json", proc)
        time.sleep(1.0)
        shard = _metrics(cluster["shards"][0]["metrics_port"])
        worker = _metrics(cluster["workers"][0]["metrics_port"])
        assert shard["bitps_updates_applied_total"] > 0
        assert shard["bitps_live_workers"] == 2
        assert worker["bitps_worker_push_bytes_total"] > 0
        assert worker["bitps_worker_loss"] > 0
        assert proc.wait(240) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for done in summary["workers"]:
        assert done["steps"] == 120
        assert done["final_loss"] <= 0.7 * done["first_loss"], done
    assert all(not _alive(pid) for pid in cluster["pids"].values())


@pytest.mark.parametrize("how", ["worker crash", "SIGTERM to the launcher"])
def test_launch_tears_everything_down(tmp_path, how):
    proc = _launch(tmp_path, steps=100_000)
    try:
        cluster = _wait_for(tmp_path / "cluster.json", proc)
        if how == "worker crash":
            os.kill(cluster["pids"]["worker-1"], signal.SIGKILL)
            expected = 1
        else:
            proc.send_signal(signal.SIGTERM)
            expected = 130
        assert proc.wait(60) == expected
    finally:
        proc.kill()
        proc.wait()
    end = time.monotonic() + 10
    while any(_alive(pid) for pid in cluster["pids"].values()) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [n for n, pid in cluster["pids"].items() if _alive(pid)]


def test_sighup_restarts_the_shards_one_at_a_time_while_training_runs(tmp_path):
    """``bitps-launch --checkpoints``: SIGHUP to the launcher (its pid is in cluster.json)
    stops each shard with SIGTERM and starts it again on its ports from its final checkpoint,
    one after the other (issue 29); the sync workers wait each out and finish every step."""
    steps = 150  # long enough to outlast both restarts (each a fresh python and numba)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--workers", "2",
         "--mode", "sync", "--checkpoints", "--run-dir", str(tmp_path), "--",
         "--steps", str(steps), "--seq-len", "16", "--batch-size", "2", "--corpus-bytes",
         "20000", "--step-delay", "0.05", "--log-every", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        cluster = _wait_for(tmp_path / "cluster.json", proc)
        end = time.monotonic() + 60
        while _metrics(cluster["shards"][0]["metrics_port"])["bitps_updates_applied_total"] < 5:
            assert time.monotonic() < end and proc.poll() is None, "no training"
            time.sleep(0.1)
        os.kill(cluster["pids"]["launcher"], signal.SIGHUP)
        assert proc.wait(240) == 0, proc.stderr.read()[-3000:]
        log = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    words = " ".join(log.split())
    assert "rolling restart: shard 0 of 2 is back" in words, words[-2000:]
    assert "rolling restart 1: every shard restarted" in words, words[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [done["steps"] for done in summary["workers"]] == [steps, steps]
    for i in (0, 1):
        assert (tmp_path / f"shard-{i}-restart-1.log").exists()
        assert list((tmp_path / "checkpoints" / f"shard-{i}").glob("ckpt-*"))
    worker_logs = " ".join((tmp_path / f"worker-{r}.log").read_text() for r in (0, 1))
    assert "is back at clock" in worker_logs


def test_launch_with_curve_trains_and_its_shards_refuse_a_plain_client(tmp_path):
    """``bitps-launch --curve`` (issue 29): key pairs for the shards and every rank go into
    RUN_DIR/keys; the workers train over CURVE, and a client without keys is refused."""
    import numpy as np

    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.proto.wire import PSError
    from bitps.worker import ClientConfig, PSClient

    proc = subprocess.Popen(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "1", "--workers", "2",
         "--mode", "async", "--curve", "--run-dir", str(tmp_path), "--", "--steps", "100000",
         "--seq-len", "16", "--batch-size", "2", "--corpus-bytes", "20000", "--log-every", "5"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        cluster = _wait_for(tmp_path / "cluster.json", proc)
        end = time.monotonic() + 60
        while _metrics(cluster["shards"][0]["metrics_port"])["bitps_updates_applied_total"] < 4:
            assert time.monotonic() < end and proc.poll() is None, "no training"
            time.sleep(0.1)
        plan = make_plan([ParamSpec("w", (8,))], num_shards=1)
        plain = PSClient(ClientConfig(servers=(f"127.0.0.1:{cluster['shards'][0]['grpc_port']}",),
                                      rank=0, world_size=2))
        try:
            with pytest.raises(PSError) as err:
                plain.register(plan, {k.key: np.zeros(k.length, np.float32) for k in plan.keys})
        finally:
            plain.close(leave=False)
        assert err.value.code == pb.UNAUTHENTICATED and "CURVE" in err.value.message
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
    finally:
        proc.kill()
        proc.wait()
    keys = tmp_path / "keys"
    assert sorted(p.name for p in (keys / "allowed").iterdir()) == ["worker-0.key",
                                                                    "worker-1.key"]
    assert (keys / "server.key_secret").exists()
