"""``bench.spy``: py-spy's collapsed stacks summed by their innermost function, and a real
recording of a real process (skipped where py-spy is missing or may not read processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bitps.bench.spy import Spy, executable, top_consumers

RAW = """\
<module> (train.py:11);step (bitps/worker/training/model.py:120);encode (enc.py:88) 30
<module> (train.py:11);step (bitps/worker/training/model.py:120);encode (enc.py:90) 10
<module> (train.py:11);backward (torch/_tensor.py:626) 50
<module> (train.py:11) 5
 5
"""


def test_samples_are_summed_by_innermost_function_and_file_per_step():
    out = top_consumers(RAW, rate=100, steps=2, n=2)
    assert out["samples"] == 100 and out["steps"] == 2
    assert out["cpu_ms_per_step"] == pytest.approx(500.0)  # 100 samples at 100 Hz over 2 steps
    # encode's two lines are one function; the unreadable stack counts in the total only
    assert [(t["function"], t["file"]) for t in out["top"]] == [
        ("backward", "torch/_tensor.py"), ("encode", "enc.py")]
    assert out["top"][0]["ms_per_step"] == pytest.approx(250.0)
    assert out["top"][1]["ms_per_step"] == pytest.approx(200.0)
    assert out["top"][1]["share"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="steps 0"):
        top_consumers(RAW, rate=100, steps=0)


_BUSY = """
import time
def spin():
    x = 0
    for i in range(100000):
        x += i
    return x
def idle():
    time.sleep(0.01)
t = time.time()
while time.time() - t < 2.0:
    spin()
    idle()
"""


def test_a_real_recording_names_the_function_that_used_the_cpu(tmp_path):
    if executable() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    proc = subprocess.Popen([sys.executable, "-c", _BUSY])
    try:
        spy = Spy(proc.pid, tmp_path / "p.spy", rate=200)
        proc.wait(30)
        try:
            raw = spy.wait()
        except RuntimeError as err:  # a container without ptrace for its own children
            if "ermission" in str(err) or "ptrace" in str(err).lower():
                pytest.skip(f"py-spy may not read processes here: {err}")
            raise
    finally:
        proc.kill()
    out = top_consumers(raw, rate=200, steps=1)
    assert out["samples"] > 50
    # the sleeping thread is not sampled: spin is what ran. Not all of it: the interpreter's
    # start (imports, under <module>) is sampled too, and takes longer on a loaded machine
    # (CI: 0.72 of the samples were spin's)
    assert out["top"][0]["function"] == "spin" and out["top"][0]["share"] > 0.5, out["top"]


def test_stop_ends_the_recording_of_a_process_that_goes_on(tmp_path):
    """A shard outlives its ranks: stop() ends its recording with the samples so far (py-spy
    killed with SIGTERM, as wait() once did past its timeout, wrote nothing)."""
    if executable() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    proc = subprocess.Popen([sys.executable, "-c", "def spin():\n while True: sum(range(99))\n"
                             "spin()"])
    try:
        spy = Spy(proc.pid, tmp_path / "p.spy", rate=200)
        time.sleep(1.0)
        try:
            raw = spy.stop()
        except RuntimeError as err:
            if "ermission" in str(err) or "ptrace" in str(err).lower():
                pytest.skip(f"py-spy may not read processes here: {err}")
            raise
        assert proc.poll() is None  # the process goes on
    finally:
        proc.kill()
    out = top_consumers(raw, rate=200, steps=1)
    assert out["top"][0]["function"] == "spin" and out["samples"] > 50, out


def _can_record(tmp_path) -> str | None:
    """Why py-spy cannot record a sibling process here (``None``: it can)."""
    if executable() is None:
        return "py-spy is not installed (the bench extra)"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        spy = Spy(proc.pid, tmp_path / "probe.spy")
        proc.wait(30)
        spy.wait()
    except RuntimeError as err:
        return f"py-spy may not read processes here: {err}"
    finally:
        proc.kill()
    return None


def test_e2e_profile_names_each_ranks_top_consumers(tmp_path):
    """``bitps-bench e2e --profile``: py-spy records each rank and shard from its steady phase
    on, and the row and the notes name the functions that used its CPU, per step."""
    import json

    if why := _can_record(tmp_path):
        pytest.skip(why)
    from tests.helpers import ROOT

    out = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), "e2e",
                          "--quick", "--name", "e2e-prof", "--profile", "--cases",
                          "ceiling (no traffic)", "bitps sync fp32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads((tmp_path / "e2e-prof.json").read_text())
    by = {r["run"]: r for r in doc["rows"]}
    assert "profile" not in by["ceiling (no traffic)"]  # only learning runs are recorded
    profiles = by["bitps sync fp32"]["profile"]
    # each rank, and each shard from rank 0's step on (a shard's recording is stopped)
    assert [(p.get("rank"), p.get("shard")) for p in profiles] == [
        (0, None), (1, None), (None, 0), (None, 1)]
    assert any(t["file"].startswith("ps/") for t in profiles[2]["top"]), profiles[2]
    for p in profiles:
        assert p["from"] == 2 and p["steps"] == 30 - 2 - 1
        assert p["samples"] > 0 and p["top"]
        assert sum(t["ms_per_step"] for t in p["top"]) <= p["cpu_ms_per_step"] + 1e-6
    md = (tmp_path / "e2e-prof.md").read_text()
    assert "Profiles (py-spy" in md and f"({profiles[0]['top'][0]['file']})" in md
    assert "bitps sync fp32, shard 1, 27 steps" in md
