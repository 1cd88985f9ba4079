"""Acceptance 2 of issue 18: in sync mode, through real shards, p = 2 and p = 4 pipelines end
with the parameters of single-process training with gradient accumulation over the same
micro-batches (fp32, rtol 1e-6) after 5 steps, for GPipe, 1F1B and ZB-H1; and the flush-free
2BW plan ends with the parameters of its one-step-stale update rule computed in one process.

One launch per p: p gloo stage processes run the four schedules in sequence, each against its
own ``bitps-server`` shard (sync, sgd, the rule that matches ``torch.optim.SGD`` bit for bit:
``tests/test_update_rules.py``). Every stage is a PS worker that registers only its own keys of
the whole model's plan (``PSModel(plan=...)``, a partial plan); the shard counts, per key, only
the workers that push it. GPipe runs with overlap off (``step()`` pushes and pulls), 1F1B and
ZB-H1 with overlap on (the last micro-batch's weight-backward hands the buckets to the
communication thread; the next forward waits for its parameters), 2BW with overlap off as one
plan over the 5 steps (weight stashing: each step computes on the version its PULL got).

This file is also the stage process (``python tests/test_pipeline_equality.py '<json>'``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bitps.bench.faults import start_server
from tests.test_pipeline_runtime import (
    collect,
    finish,
    init_stage,
    make_model,
    micro_batches,
    stage_module,
    start_stages,
)

STEPS, M, LR = 5, 4, 0.1
SCHEDULES = {"gpipe": "off", "1f1b": "on", "zb-h1": "on", "2bw": "off"}  # -> overlap mode


def train_through_shards(cfg: dict) -> None:
    """Each schedule: ``STEPS`` steps of this stage through its shard; the stage's parameters
    after them."""
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker import ClientConfig, PSClient, PSModel
    from bitps.worker.config import OverlapConfig
    from bitps.worker.pipeline.runtime import StageRuntime
    from bitps.worker.pipeline.schedules import get_schedule

    ctx = init_stage(cfg)
    p, s = cfg["p"], ctx.stage
    xs, ys = micro_batches(STEPS * M)
    out = {}
    for name, server in zip(SCHEDULES, cfg["servers"]):
        model = make_model()
        module = stage_module(model, s, p)
        client = PSClient(ClientConfig(servers=(server,), rank=cfg["rank"], world_size=p,
                                       initializes=ctx.replica == 0, clip_norm=0.0))
        whole = make_plan([ParamSpec(n, tuple(q.shape)) for n, q in model.named_parameters()],
                          num_shards=client.num_shards,
                          partition_bytes=client.cfg.partition_bytes)
        ps_model = PSModel(module, client, plan=whole,
                           overlap=OverlapConfig(mode=SCHEDULES[name]))
        rt = StageRuntime(ctx, module, loss_fn=F.mse_loss, ps_model=ps_model)
        sched = get_schedule(name)
        losses = []
        if sched.flushes:
            plan = sched.generate(p, M)[s]
            for k in range(STEPS):
                mbs = slice(k * M, (k + 1) * M)
                report = rt.run_step(plan, inputs=xs[mbs] if ctx.first else None,
                                     targets=ys[mbs] if ctx.last else None)
                losses.append(report.losses)
        else:  # flush-free: one plan over every step, weight versions from the shard
            report = rt.run_step(sched.generate(p, M, STEPS)[s],
                                 inputs=xs if ctx.first else None,
                                 targets=ys if ctx.last else None)
            losses = [report.losses[k * M:(k + 1) * M] for k in range(STEPS)]
        ps_model.synchronize()
        out[name] = dict(params={n: q.tolist() for n, q in module.named_parameters()},
                         losses=losses, keys=len(ps_model.keys),
                         overlapped=ps_model.last_stats.overlapped)
        ps_model.close()
    finish(dict(stage=s, results=out))


def reference(*, stale: bool = False, steps: int = STEPS
              ) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Single-process training: per step, gradient accumulation over the step's M
    micro-batches (loss / M each), then ``torch.optim.SGD``. ``stale``: 2BW's one-step-stale
    update, ``W(k+1) = W(k) - lr * grad f_k(W(k-1))`` (steps 0 and 1 read ``W(0)``)."""
    model, reader = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    xs, ys = micro_batches(steps * M)
    versions = [{n: q.detach().clone() for n, q in model.named_parameters()}]
    losses = []
    for k in range(steps):
        with torch.no_grad():
            for n, q in reader.named_parameters():
                q.copy_(versions[max(k - 1, 0) if stale else k][n])
        reader.zero_grad(set_to_none=True)
        step_losses = []
        for x, y in zip(xs[k * M:(k + 1) * M], ys[k * M:(k + 1) * M]):
            loss = F.mse_loss(reader(x), y)
            (loss / M).backward()
            step_losses.append(loss.item())
        for q, r in zip(model.parameters(), reader.parameters()):
            q.grad = r.grad
        opt.step()
        versions.append({n: q.detach().clone() for n, q in model.named_parameters()})
        losses.append(step_losses)
    return versions[-1], losses


@pytest.mark.parametrize("p", [2, 4])
def test_pipelines_through_sync_shards_end_with_single_process_parameters(p):
    shards = [start_server("--mode", "sync", "--optimizer", "sgd", "--lr", str(LR))
              for _ in SCHEDULES]
    try:
        outs = collect(start_stages(dict(p=p, servers=[s.grpc_address for s in shards],
                                         deadline_s=90), p, script=Path(__file__)),
                       timeout=90)
    finally:
        for s in shards:
            s.kill()
    initial = dict(make_model().named_parameters())
    outs.sort(key=lambda o: o["stage"])
    for name in SCHEDULES:
        want, want_losses = reference(stale=name == "2bw")
        names = set()
        for o in outs:
            res = o["results"][name]
            assert res["keys"] > 0 and res["overlapped"] == (SCHEDULES[name] == "on")
            for n, q in res["params"].items():
                got = torch.tensor(q)
                assert not torch.equal(got, initial[n]), f"{name}: {n} never changed"
                torch.testing.assert_close(got, want[n], rtol=1e-6, atol=0,
                                           msg=f"{name} p={p} stage {o['stage']} {n}")
                names.add(n)
        assert names == set(want), f"{name}: the stages together hold every parameter"
        got_losses = outs[-1]["results"][name]["losses"]
        for got_step, want_step in zip(got_losses, want_losses, strict=True):
            assert got_step == pytest.approx(want_step, rel=1e-6)


if __name__ == "__main__":
    train_through_shards(json.loads(sys.argv[1]))
