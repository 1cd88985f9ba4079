"""examples/train.py, a user's own model trained through bitps: on 2 shards x 2 worker ranks,
started by ``bitps-launch --script`` and by ``torchrun`` against shards started by hand, every
rank's loss falls by at least 30 %, read from what the script prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bitps.bench.faults import start_server
from bitps.worker.launch import launcher

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
STEPS = "100"
LR = "3e-3"  # the learning rate bitps-launch gives its shards (their optimizer: adam, the default)
RESULT = re.compile(r"rank (\d+): first loss ([\d.]+), last loss ([\d.]+), drop")


def _drops(output: str) -> dict[int, float]:
    """Every rank's loss drop, from the script's last line per rank."""
    return {int(rank): 1 - float(last) / float(first)
            for rank, first, last in RESULT.findall(output)}


def _launch(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bitps.worker.launch", "--shards", "2", "--workers", "2",
         "--lr", LR, "--run-dir", str(tmp_path), "--script", str(SCRIPT), "--",
         "--steps", STEPS, "--expect-loss-drop", "0.3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


def _torchrun(tmp_path: Path) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    shards = [start_server("--shard-id", str(i), "--num-shards", "2", "--lr", LR)
              for i in range(2)]
    try:
        env = dict(os.environ, BITPS_SERVERS=",".join(s.grpc_address for s in shards))
        # --standalone: the rendezvous takes a free port, not torchrun's fixed 29500
        return subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", "--log-dir",
             str(tmp_path), str(SCRIPT), "--steps", STEPS, "--expect-loss-drop", "0.3"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        for s in shards:
            s.kill()


@pytest.mark.parametrize("start", [_launch, _torchrun], ids=["bitps-launch", "torchrun"])
def test_example_trains_on_two_shards_and_two_workers(tmp_path, start):
    out = start(tmp_path)
    text = out.stdout + out.stderr  # bitps-launch shows the ranks' lines on stderr
    assert out.returncode == 0, text[-3000:]
    drops = _drops(text)
    assert sorted(drops) == [0, 1], text[-3000:]
    assert all(d >= 0.3 for d in drops.values()), drops


@pytest.mark.parametrize("argv, named", [
    (["--script", "examples/missing.py"], "--script 'examples/missing.py': no such file"),
    (["--script", str(SCRIPT), "--pp", "2"], "not pipeline stages; got --pp"),
    (["--script", str(SCRIPT), "--algorithm", "diloco"], "--algorithm diloco sets bitps-worker"),
    (["--script", str(SCRIPT), "--expect-loss-drop", "0.3"], "a script checks its own loss"),
])
def test_launch_refuses_what_a_script_cannot_run_before_starting_anything(tmp_path, capsys,
                                                                          argv, named):
    run_dir = tmp_path / "run"
    assert launcher.main(["--run-dir", str(run_dir), *argv]) == 2
    assert named in " ".join(capsys.readouterr().err.split())
    assert not run_dir.exists()  # no run dir: no process was started
