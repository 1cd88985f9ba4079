"""Acceptance 6 of issue 18: a stage process that dies (``kill -9``) or stops (``SIGSTOP``)
mid-step makes its neighbours fail with ``StageFailedError`` naming that stage, within their
deadline: no hang.

Three gloo stage processes run 1F1B (p = 3, m = 4). The middle stage announces, in its second
forward, that it is mid-step and then works slowly; the test kills or stops it there by pid.
Stage 0 is then waiting for a gradient from it, stage 2 for an activation. Measured on torch
2.13 gloo: a dead peer fails the wait within milliseconds ("Connection closed by peer"); a
stopped one fails it when ``Work.wait(timeout)`` expires.

This file is also the stage process (``python tests/test_pipeline_faults.py '<json>'``).
"""

from __future__ import annotations

import json
import select
import signal
import sys
import time
from pathlib import Path

import pytest
import torch.nn.functional as F

from tests.test_pipeline_runtime import (
    collect,
    finish,
    init_stage,
    make_model,
    micro_batches,
    stage_module,
    start_stages,
)

P, M, TIMEOUT_S = 3, 4, 3.0


def run_until_failure(cfg: dict) -> None:
    """Run one 1F1B step; the victim stage slows down in its second forward after saying so
    on stdout. Report the ``StageFailedError`` this stage got (a victim reports nothing)."""
    from bitps.worker.pipeline.runtime import StageFailedError, StageRuntime
    from bitps.worker.pipeline.schedules import get_schedule

    ctx = init_stage(cfg)
    module = stage_module(make_model(), ctx.stage, P)
    if ctx.stage == cfg["victim"]:
        calls = []

        def slow(mod, args):
            calls.append(1)
            if len(calls) == 2:
                print("MID-STEP", flush=True)
                time.sleep(20)  # the test kills or stops us here
        module[0].register_forward_pre_hook(slow)  # the runtime calls the children
    rt = StageRuntime(ctx, module, loss_fn=F.mse_loss)
    xs, ys = micro_batches(M)
    plan = get_schedule("1f1b").generate(P, M)
    t0 = time.monotonic()
    try:
        rt.run_step(plan[ctx.stage], inputs=xs if ctx.first else None,
                    targets=ys if ctx.last else None)
    except StageFailedError as exc:
        finish(dict(stage=ctx.stage, failed=True, peer_stage=exc.stage, peer_rank=exc.rank,
                    peer_replica=exc.replica, what=exc.what, reason=exc.reason,
                    message=str(exc), waited_s=time.monotonic() - t0))
    finish(dict(stage=ctx.stage, failed=False))


def wait_line(proc, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the victim exited {proc.returncode}: {proc.stderr.read()}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready and text in proc.stdout.readline():
            return
    raise AssertionError(f"the victim never printed {text!r} within {timeout} s")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_failed_stage_makes_its_neighbours_fail_naming_it_within_the_deadline(how):
    victim = 1
    procs = start_stages(dict(victim=victim, p=P, timeout_s=TIMEOUT_S, deadline_s=40),
                         P, script=Path(__file__))
    try:
        wait_line(procs[victim], "MID-STEP", timeout=30)
        procs[victim].send_signal(how)
        hit = time.monotonic()
        peers = [p for r, p in enumerate(procs) if r != victim]
        outs = collect(peers, timeout=TIMEOUT_S + 10)
        elapsed = time.monotonic() - hit
    finally:
        procs[victim].kill()  # a stopped process dies from SIGKILL too
        procs[victim].wait()
    assert elapsed < TIMEOUT_S + 5, f"the neighbours took {elapsed:.1f} s"
    for out in outs:
        assert out["failed"], out
        assert (out["peer_stage"], out["peer_rank"], out["peer_replica"]) == (victim, victim, 0)
        assert f"stage {victim} (replica 0, rank {victim})" in out["message"]
        if how == signal.SIGKILL:
            assert "peer closed the connection" in out["reason"], out
        else:
            assert f"no answer within {TIMEOUT_S:g} s" in out["reason"], out
    by_stage = {o["stage"]: o for o in outs}
    assert by_stage[0]["what"] == "RECV_B of micro-batch 0"  # 1F1B: stage 0 awaits B0 first
    # stage 2 fails at its next transfer with stage 1: the send of B0 (if the fault came before
    # it) or the receive of F1
    assert by_stage[2]["what"] in ("SEND_B of micro-batch 0", "RECV_F of micro-batch 1")


if __name__ == "__main__":
    run_until_failure(json.loads(sys.argv[1]))
