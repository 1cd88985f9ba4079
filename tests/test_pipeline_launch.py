"""bitps-launch --dp D --pp P and the stage process (python -m bitps.worker.pipeline): every
refused configuration is refused before any process starts or any connection is made; a real
dp x pp launch through the shards trains, with metrics from every stage process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bitps.worker.launch import launcher
from bitps.worker.pipeline.settings import check_plan, parse_config
from tests.helpers import promtool_problems

ROOT = Path(__file__).resolve().parents[1]

# (launcher arguments, what the error must name): each is refused before anything starts.
REFUSED = {
    "p > layers": (["--dp", "1", "--pp", "8", "--", "--model", "mlp"],
                   r"pipeline_parallel_size=8: expected at most the model's 6 layers"),
    "m < p for 1f1b": (["--pp", "4", "--gradient-accumulation-steps", "2", "--schedule", "1f1b"],
                       r"'1f1b' refuses p=4 stages with m=2 micro-batches"),
    "global batch not D x b x m": (
        ["--dp", "2", "--pp", "2", "--micro-batch-size", "8", "--gradient-accumulation-steps",
         "4", "--", "--global-batch", "60"],
        r"global_batch=60: expected data_parallel_size x micro_batch_size x "
        r"gradient_accumulation_steps = 2 x 8 x 4 = 64"),
    "dynamic size outside its range": (
        ["--pp", "2", "--micro-batch-size", "20", "--", "--dynamic-micro-batch"],
        r"micro_batch_size=20: expected a size in \[micro_batch_min, micro_batch_max\] = "
        r"\[4, 16\]"),
    "dynamic with a flush-free schedule": (
        ["--pp", "2", "--schedule", "2bw", "--", "--dynamic-micro-batch"],
        r"dynamic_micro_batch needs a flushing schedule"),
    "2p > layers for zb-v": (
        ["--pp", "4", "--schedule", "zb-v", "--", "--model", "mlp"],
        r"pipeline_parallel_size=4: expected at most 3 with schedule 'zb-v': it cuts the model "
        r"into 2 x 4 = 8 parts of at least one layer, and the model has 6 layers"),
    "zb-v on CUDA": (["--pp", "2", "--schedule", "zb-v", "--", "--device", "cuda:0"],
                     r"schedule 'zb-v' \(2 model chunks per rank\) runs on gloo \(CPU\) only"),
    "unknown schedule": (["--pp", "2", "--schedule", "interleaved"],
                         r"got 'interleaved'; expected one of gpipe, 1f1b, zb-h1, 2bw"),
    "unknown model": (["--pp", "2", "--", "--model", "gpt5"], r"model 'gpt5': expected one of"),
    "local SGD preset": (["--pp", "2", "--algorithm", "diloco"],
                         r"--algorithm diloco: pipelines train with the shards' optimizer"),
}

# (config file text, what the error must name)
REFUSED_FILES = {
    "bad dict key": ("[parallel_config]\ndata_parallel_size = 2\nmicro_batch_sizes = 8\n",
                     r"table \[parallel_config\]: unknown key 'micro_batch_sizes' \(did you mean "
                     r"'micro_batch_size'\?\)"),
    "bad TOML": ("[parallel_config\npipeline_parallel_size = 2\n", r"is not valid TOML"),
    "wrong type": ("[parallel_config]\nmicro_batch_size = \"8\"\n",
                   r"key 'micro_batch_size': got '8' \(string\); expected an integer"),
    "flat key of the table": ("micro_batch_size = 8\n", r"unknown key 'micro_batch_size'"),
    "m < p in the file": ("[parallel_config]\npipeline_parallel_size = 4\n"
                          "gradient_accumulation_steps = 2\n",
                          r"refuses p=4 stages with m=2"),
}


def _refused_in_process(argv: list[str], run_dir: Path, capsys) -> str:
    code = launcher.main(["--run-dir", str(run_dir), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    # Every child the launcher starts logs to a file in the run dir, made after the check:
    # no run dir, no process.
    assert not run_dir.exists()
    return " ".join(err.split())  # rich wraps long lines


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_configuration_starts_nothing(case, tmp_path, capsys):
    argv, expected = REFUSED[case]
    assert re.search(expected, _refused_in_process(argv, tmp_path / "run", capsys))


@pytest.mark.parametrize("case", sorted(REFUSED_FILES))
def test_refused_config_file_starts_nothing(case, tmp_path, capsys):
    text, expected = REFUSED_FILES[case]
    path = tmp_path / "pp.toml"
    path.write_text(text)
    assert re.search(expected, _refused_in_process(["--config", str(path)], tmp_path / "run",
                                                   capsys))


def test_launcher_subprocess_exits_2_and_spawns_no_child(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "bitps.worker.launch", "--run-dir", str(run_dir), "--dp", "1",
         "--pp", "4", "--gradient-accumulation-steps", "3", "--schedule", "1f1b"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    err = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stderr
    assert "refuses p=4 stages with m=3" in err and "'1f1b'" in err
    assert not run_dir.exists()


def test_stage_process_refuses_before_any_communication():
    # The stage's rendezvous address is a socket we listen on: a refused plan exits 2 and
    # never connects to it (init_process_group would), nor to the "shard".
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(8)
        master.setblocking(False)
        port = master.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        out = subprocess.run(
            [sys.executable, "-m", "bitps.worker.pipeline", "--servers", f"127.0.0.1:{port}",
             "--pipeline-parallel-size", "4", "--gradient-accumulation-steps", "2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "PlanError" in out.stderr and "refuses p=4 stages with m=2" in out.stderr
        with pytest.raises(BlockingIOError):
            master.accept()


def test_world_size_must_be_d_times_p():
    cfg = parse_config(["--servers", "h:1", "--data-parallel-size", "2",
                        "--pipeline-parallel-size", "2", "--world-size", "3"], environ={})
    with pytest.raises(ValueError, match=r"2 x 2 = 4, got 3"):
        check_plan(cfg)


def test_stage_reads_torchruns_environment_and_the_table(tmp_path):
    path = tmp_path / "pp.toml"
    path.write_text("steps = 7\n[parallel_config]\ndata_parallel_size = 2\n"
                    "pipeline_parallel_size = 4\nmicro_batch_size = 8\n"
                    "gradient_accumulation_steps = 4\n")
    cfg = parse_config(["--config", str(path), "--servers", "h:1"],
                       environ={"RANK": "6", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1",
                                "MASTER_PORT": "29400", "LOCAL_RANK": "2"})
    check_plan(cfg)
    assert (cfg.replica, cfg.stage_index, cfg.run.local_rank, cfg.run.steps) == (1, 2, 2, 7)
    assert (cfg.stage.master_addr, cfg.stage.master_port) == ("10.0.0.1", 29400)
    assert (cfg.parallel.global_batch, cfg.parallel.schedule) == (64, "1f1b")
    # a flag wins over the file
    cfg = parse_config(["--config", str(path), "--servers", "h:1", "--micro-batch-size", "4"],
                       environ={"WORLD_SIZE": "8"})
    assert cfg.parallel.replica_batch == 16


def _text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _metrics(port: int, text: str | None = None) -> dict[str, float]:
    """Sample name (with its direction label, if any) -> value."""
    text = _text(port) if text is None else text
    return {s.name + (f"/{s.labels['direction']}" if "direction" in s.labels else ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_dp2_pp2_launch_trains_with_metrics_from_every_stage(tmp_path):
    # Replica batch 16; dynamic micro-batching may run 4 or 8 (m = 4 or 2: 1F1B needs m >= p,
    # so not 16), and every stage of a replica must run the same size at every step.
    config = tmp_path / "pp.toml"
    config.write_text("[parallel_config]\ndata_parallel_size = 2\npipeline_parallel_size = 2\n"
                      "micro_batch_size = 4\ngradient_accumulation_steps = 4\n"
                      "dynamic_micro_batch = true\nlookahead = true\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--mode", "async",
         "--run-dir", str(run_dir), "--config", str(config), "--expect-loss-drop", "0.3",
         "--", "--model", "mlp", "--steps", "150", "--log-every", "10"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    scraped: dict[int, dict] = {}
    texts: dict[int, str] = {}
    try:
        end = time.monotonic() + 60
        while not (run_dir / "cluster.json").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < end, "cluster.json never appeared"
            time.sleep(0.2)
        stages = json.loads((run_dir / "cluster.json").read_text())["workers"]
        assert sorted(s["rank"] for s in stages) == [0, 1, 2, 3]
        while len(scraped) < 4 and time.monotonic() < end and proc.poll() is None:
            for s in stages:
                text = _text(s["metrics_port"])
                m = _metrics(s["metrics_port"], text)
                if m.get("bitps_stage_steps_total", 0) > 0:
                    scraped[s["rank"]], texts[s["rank"]] = m, text
            time.sleep(0.2)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert sorted(scraped) == [0, 1, 2, 3], "not every stage was scraped while it ran"
    for rank, m in scraped.items():
        assert m["bitps_stage_busy_seconds_total"] > 0
        assert 0 <= m["bitps_stage_bubble_ratio"] < 1
        assert m["bitps_stage_micro_batch_size"] in (4, 8)
        assert m["bitps_stage_p2p_bytes_total/sent"] > 0, rank
        assert m["bitps_stage_p2p_bytes_total/received"] > 0, rank
        assert m["bitps_worker_push_bytes_total"] > 0  # the stage is a PS client
    summary = json.loads((run_dir / "summary.json").read_text())
    done = summary["stages"]
    assert [(d["replica"], d["stage"]) for d in done] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for d in done:
        assert d["steps"] == 150
        assert set(d["micro_batch_sizes"]) == {4, 8}, d  # the tuner explored both ends
    for first, last in (done[0:2], done[2:4]):
        assert first["micro_batch_sizes"] == last["micro_batch_sizes"]
        assert last["final_loss"] <= 0.7 * last["first_loss"], last  # the last stage's loss
    # one profiled partition (measured on rank 0), adopted by every stage
    starts = summary["starts"]
    assert all(s["partition"] == starts[0]["partition"] for s in starts)
    assert starts[0]["costs"] is not None and len(starts[0]["costs"]) == 6
    assert [s["layers"] for s in starts[:2]] == [
        f"{a}-{b - 1}" for a, b in starts[0]["partition"]]
    for rank, text in texts.items():  # Prometheus's own linter on each live stage's endpoint
        assert promtool_problems(text) == [], rank


def test_dp1_pp2_zbv_launch_trains_with_the_loss_on_stage_0(tmp_path):
    # zb-v: the 6 layers cut into 4 parts (profiled); stage 0 holds virtual stages 0 and 3
    # (the inputs and the loss), stage 1 virtual stages 1 and 2. Look-ahead feeds stage 0 and
    # dynamic micro-batching tunes the size (replica batch 16: 4, 8 or 16; zb-v takes any m).
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "1", "--mode", "async",
         "--run-dir", str(run_dir), "--dp", "1", "--pp", "2", "--schedule", "zb-v",
         "--micro-batch-size", "4", "--gradient-accumulation-steps", "4",
         "--expect-loss-drop", "0.3", "--", "--model", "mlp", "--steps", "150",
         "--log-every", "10", "--lookahead", "--dynamic-micro-batch"],
        cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"]["schedule"] == "zb-v"
    starts = {s["stage"]: s for s in summary["starts"]}
    partition = starts[0]["partition"]  # virtual stages 0..3, in order, covering 0..5
    assert len(partition) == 4 and partition[0][0] == 0 and partition[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(partition, partition[1:]))
    for stage, virtual in ((0, [0, 3]), (1, [1, 2])):
        s = starts[stage]
        assert s["partition"] == partition and s["virtual_stages"] == virtual
        assert s["computes_loss"] == (stage == 0)
        assert s["layers"] == ",".join(f"{partition[v][0]}-{partition[v][1] - 1}"
                                       for v in virtual)
    assert starts[0]["keys"] + starts[1]["keys"] == 12  # 6 layers x (weight, bias)
    done = {d["stage"]: d for d in summary["stages"]}
    assert done[0]["computes_loss"] and not done[1]["computes_loss"]
    assert done[1]["first_loss"] is None and done[1]["final_loss"] is None
    assert done[0]["final_loss"] <= 0.7 * done[0]["first_loss"], done[0]
    for d in done.values():
        assert d["steps"] == 150 and d["p2p_bytes_sent"] > 0 and d["p2p_bytes_received"] > 0
        assert len(set(d["micro_batch_sizes"])) > 1, d  # the tuner explored
    assert done[0]["micro_batch_sizes"] == done[1]["micro_batch_sizes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_torchrun_style_stages_and_a_dying_stage_fails_its_peer_naming_it(tmp_path, how):
    # No launcher: a shard and two stage processes given torchrun's environment, as torchrun
    # would start them. Stage 1 is killed (or terminated) mid-run; stage 0 must fail within
    # its p2p deadline with an error naming stage 1, not hang. Terminated, stage 1 leaves the
    # shard itself and exits 0.
    shard = subprocess.Popen([sys.executable, "-m", "bitps.ps", "--mode", "async"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stages = []
    try:
        ready = json.loads(shard.stdout.readline())
        torchrun = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(_free_port()))
        for rank in (0, 1):
            stages.append(subprocess.Popen(
                [sys.executable, "-m", "bitps.worker.pipeline", "--servers",
                 f"127.0.0.1:{ready['grpc_port']}", "--pipeline-parallel-size", "2",
                 "--model", "mlp", "--balance", "uniform", "--steps", "100000",
                 "--p2p-timeout", "10", "--json", "--log-every", "1"],
                cwd=ROOT, env=dict(torchrun, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=subprocess.PIPE, stderr=(tmp_path / f"stage{rank}.log").open("w"),
                text=True))
        first = stages[0]
        events = []
        while not any(e["event"] == "step" for e in events):
            line = first.stdout.readline()
            assert line, "stage 0 ended before its first step"
            events.append(json.loads(line))
        t0 = time.monotonic()
        if how == "SIGKILL":
            stages[1].kill()
        else:
            stages[1].send_signal(signal.SIGTERM)
            assert stages[1].wait(30) == 0
            last = [json.loads(line) for line in stages[1].stdout.read().splitlines()][-1]
            assert last == {"event": "terminated", "rank": 1}
            assert "leave shard 0 failed" not in (tmp_path / "stage1.log").read_text()
        assert first.wait(30) == 1
        waited = time.monotonic() - t0
        error = [json.loads(line) for line in first.stdout.read().splitlines()][-1]
    finally:
        for p in (*stages, shard):
            p.kill()
            p.wait()
    assert error["event"] == "error" and (error["replica"], error["stage"]) == (0, 0)
    assert "StageFailedError" in error["error"] and "stage 1" in error["error"], error
    assert waited < 10 + 5, waited  # within the deadline (a closed peer is seen at once)


def test_stage_metrics_record_a_step_report():
    from prometheus_client import generate_latest

    from bitps.worker.pipeline.metrics import StageMetrics
    from bitps.worker.pipeline.runtime import StepReport
    from bitps.worker.pipeline.simulate import StageTimes

    m = StageMetrics(stage=2, replica=1)
    for wall, busy in ((1.0, 0.75), (2.0, 1.0)):
        m.observe(StepReport(step=0, wall_s=wall, busy_s=busy, bubble=1 - busy / wall,
                             losses=[2.0, 4.0], times=StageTimes(f=0.1, b=0.2, w=0.0),
                             p2p_bytes_sent=100, p2p_bytes_received=40, micro_batch_size=8))
    samples = {(s.name, s.labels.get("direction")): (s.value, s.labels)
               for f in text_string_to_metric_families(generate_latest(m.registry).decode())
               for s in f.samples}
    assert all(labels["stage"] == "2" and labels["replica"] == "1"
               for _, labels in samples.values())
    value = {k: v for k, (v, _) in samples.items()}
    assert value[("bitps_stage_busy_seconds_total", None)] == 1.75
    assert value[("bitps_stage_wall_seconds_total", None)] == 3.0
    assert value[("bitps_stage_bubble_ratio", None)] == 0.5  # the last step's
    assert value[("bitps_stage_micro_batch_size", None)] == 8
    assert value[("bitps_stage_p2p_bytes_total", "sent")] == 200
    assert value[("bitps_stage_p2p_bytes_total", "received")] == 80
    assert value[("bitps_stage_steps_total", None)] == 2
    assert value[("bitps_stage_step_seconds_count", None)] == 2
    assert value[("bitps_stage_loss", None)] == 3.0
    assert not [name for name, _ in samples if name.endswith("_created")]
