"""The stage runtime (``worker.pipeline.runtime``) on real gloo processes, and its parts in one
process: B then W gives BW's gradients; every schedule runs p = 2 and p = 4 and yields the
gradients of single-process gradient accumulation; busy, bubble and p2p bytes are reported; a
stage under an ``ActivationPool`` tags its micro-batches so eviction follows the schedule; the
prefetcher re-raises its thread's errors.

This file is also the stage process of the multi-process tests (``python
tests/test_pipeline_runtime.py '<json>'``, see :func:`stage_main`); ``test_pipeline_equality``
and ``test_pipeline_faults`` start it too.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bitps.worker.pipeline.actions import Action, Op
from bitps.worker.pipeline.lookahead import Prefetcher, PrefetchError
from bitps.worker.pipeline.runtime import StageContext, StageRuntime
from bitps.worker.pipeline.stage import StageCompute

ROOT = Path(__file__).resolve().parents[1]
HEADER_BYTES = 80  # p2p: one int64[10] shape header per direction and run_step
WIDTH, UNITS, MICRO = 16, 8, 3


# -- the model, its stages and data (shared with the other pipeline test files) ---------------
def make_model(seed: int = 0, width: int = WIDTH, units: int = UNITS) -> nn.Sequential:
    """``units`` Linear layers with Tanh between them; children named by index, so a stage's
    slice keeps the whole model's parameter names."""
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i in range(units):
        layers[str(2 * i)] = nn.Linear(width, width)
        if i < units - 1:
            layers[str(2 * i + 1)] = nn.Tanh()
    return nn.Sequential(layers)


def stage_module(model: nn.Sequential, s: int, p: int, units: int = UNITS) -> nn.Sequential:
    """Stage ``s`` of ``p``: ``units / p`` consecutive (Linear, Tanh) units."""
    lo, hi = s * units // p, (s + 1) * units // p
    return nn.Sequential(OrderedDict((n, c) for n, c in model.named_children()
                                     if lo <= int(n) // 2 < hi))


def micro_batches(n: int, *, seed: int = 1, b: int = MICRO, width: int = WIDTH):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, width, generator=g) for _ in range(n)]
    ys = [torch.randn(b, width, generator=g) for _ in range(n)]
    return xs, ys


def reference_grads(model: nn.Module, xs, ys) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process gradient accumulation over the micro-batches: the mean loss's gradient."""
    model.zero_grad(set_to_none=True)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.mse_loss(model(x), y)
        (loss / len(xs)).backward()
        losses.append(loss.item())
    return {n: p.grad.clone() for n, p in model.named_parameters()}, losses


# -- processes --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stages(cfg: dict, world: int, *, script: Path | None = None,
                 env: dict | None = None) -> list[subprocess.Popen]:
    """``world`` stage processes running :func:`stage_main` (or ``script``) with ``cfg`` plus
    their rank, the world size and a fresh rendezvous port."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(script or Path(__file__)),
         json.dumps({**cfg, "rank": r, "world": world, "port": port})],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}) for r in range(world)]


def collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each process's last stdout line as JSON; every process is killed past ``timeout``."""
    end = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            assert proc.returncode == 0, f"rank {len(outs)} exited {proc.returncode}:\n{err}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def init_stage(cfg: dict) -> StageContext:
    """Join the gloo group of ``cfg``'s world and say where this rank sits (rank r is replica
    r // p, stage r % p, as the launcher numbers them)."""
    import torch.distributed as dist

    faulthandler.dump_traceback_later(cfg.get("deadline_s", 60), exit=True)
    rank, world, p = cfg["rank"], cfg["world"], cfg["p"]
    timeout = datetime.timedelta(seconds=cfg.get("timeout_s", 20))
    store = dist.TCPStore("127.0.0.1", cfg["port"], world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    s = rank % p
    return StageContext(stage=s, num_stages=p, replica=rank // p,
                        prev_rank=rank - 1 if s > 0 else None,
                        next_rank=rank + 1 if s < p - 1 else None,
                        timeout_s=cfg.get("timeout_s", 20))


def finish(result: dict) -> None:
    """Print the result and leave at once (a torn-down gloo group can block in its
    destructor when a peer is gone)."""
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def report_dict(r) -> dict:
    return dict(step=r.step, wall_s=r.wall_s, busy_s=r.busy_s, bubble=r.bubble,
                losses=r.losses, sent=r.p2p_bytes_sent, received=r.p2p_bytes_received,
                micro_batch_size=r.micro_batch_size, peak_inflight=r.peak_inflight,
                times=[r.times.f, r.times.b, r.times.w])


def run_schedules(cfg: dict) -> None:
    """Each schedule of ``cfg`` on a fresh copy of the model, without a PS: this stage's
    gradients after the plan (2BW: 3 steps; ``.grad`` then holds the last step's) and the
    report; then one more GPipe step at another micro-batch size."""
    from bitps.worker.pipeline.schedules import get_schedule

    ctx = init_stage(cfg)
    p, m, s = cfg["p"], cfg["m"], ctx.stage
    out = {}
    for name in cfg["schedules"]:
        sched = get_schedule(name)
        steps = 1 if sched.flushes else 3
        module = stage_module(make_model(), s, p)
        rt = StageRuntime(ctx, module, loss_fn=F.mse_loss)
        xs, ys = micro_batches(steps * m)
        plan = sched.generate(p, m, steps)
        report = rt.run_step(plan[s], inputs=xs if ctx.first else None,
                             targets=ys if ctx.last else None)
        out[name] = dict(report=report_dict(report), versions=rt.max_live_versions,
                         grads={n: q.grad.tolist() for n, q in module.named_parameters()})
        if name == "gpipe":  # dynamic micro-batching: the shapes come with the headers
            xs2, ys2 = micro_batches(2, seed=7, b=2 * MICRO)
            again = rt.run_step(get_schedule("gpipe").generate(p, 2)[s],
                                inputs=xs2 if ctx.first else None,
                                targets=ys2 if ctx.last else None)
            out["gpipe-resized"] = dict(report=report_dict(again))
    finish(dict(stage=s, results=out))


def stage_main(cfg: dict) -> None:
    {"schedules": run_schedules}[cfg["scenario"]](cfg)


# -- tests ------------------------------------------------------------------------------------
def test_b_then_w_gives_the_gradients_of_bw_bit_for_bit():
    a, b, ref = make_model(), make_model(), make_model()
    ca = StageCompute(a, first=False, last=False)
    cb = StageCompute(b, first=False, last=False)
    xs, gs = micro_batches(4)
    for mb in range(4):
        ca.forward(mb, xs[mb])
        cb.forward(mb, xs[mb])
    assert ca.inflight == 4
    for mb in range(4):  # every B first, the W's after, as ZB-H1 defers them
        gi_a = ca.backward_input(mb, gs[mb])
        gi_b = cb.backward(mb, gs[mb])
        x = xs[mb].clone().requires_grad_(True)
        ref(x).backward(gs[mb])
        assert torch.equal(gi_a, gi_b) and torch.equal(gi_a, x.grad)
    for mb in range(4):  # in micro-batch order: the sums of .grad then add up in BW's order
        ca.backward_weight(mb)
    assert ca.inflight == cb.inflight == 0  # each micro-batch freed after its last backward
    for (n, pa), pb, pr in zip(a.named_parameters(), b.parameters(), ref.parameters()):
        assert torch.equal(pa.grad, pb.grad), n
        torch.testing.assert_close(pa.grad, pr.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="needs its B first"):
        ca.forward(9, xs[0])
        ca.backward_weight(9)


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_runs_on_gloo_and_gives_single_process_gradients(p):
    m = 4
    names = ["gpipe", "1f1b", "zb-h1", "2bw"]
    outs = collect(start_stages(dict(scenario="schedules", p=p, m=m, schedules=names), p),
                   timeout=60)
    outs.sort(key=lambda o: o["stage"])
    for name in names:
        steps = 3 if name == "2bw" else 1
        xs, ys = micro_batches(steps * m)
        last = slice((steps - 1) * m, steps * m)  # 2BW: .grad holds the last step's gradient
        want, want_losses = reference_grads(make_model(), xs[last], ys[last])
        for o in outs:
            res = o["results"][name]
            for n, g in res["grads"].items():
                torch.testing.assert_close(torch.tensor(g), want[n], rtol=1e-6, atol=0,
                                           msg=f"{name} p={p} stage {o['stage']} {n}")
            r = res["report"]
            assert 0 < r["busy_s"] <= r["wall_s"] and 0 <= r["bubble"] < 1
            assert r["bubble"] == pytest.approx(1 - r["busy_s"] / r["wall_s"])
            assert r["micro_batch_size"] == MICRO and min(r["times"][:2]) > 0
            if name == "zb-h1":
                assert r["times"][2] > 0  # W timed on its own
            directions = (o["stage"] > 0) + (o["stage"] < p - 1)  # one header each per run
            assert r["sent"] == r["received"] == directions * (
                HEADER_BYTES + steps * m * MICRO * WIDTH * 4)
            if name == "2bw":
                assert res["versions"] <= 2
            held = {"gpipe": m, "1f1b": min(p - o["stage"], m)}  # graphs held at once
            if name in held:
                assert r["peak_inflight"] == held[name], (name, o["stage"])
            else:
                assert r["peak_inflight"] <= p, (name, o["stage"])
        losses = outs[-1]["results"][name]["report"]["losses"]
        assert losses[-m:] == pytest.approx(want_losses, rel=1e-6)
    xs2, ys2 = micro_batches(2, seed=7, b=2 * MICRO)
    _, want_losses = reference_grads(make_model(), xs2, ys2)
    for o in outs:
        assert o["results"]["gpipe-resized"]["report"]["micro_batch_size"] == 2 * MICRO
    # the model was not updated between the two steps (no PS): same weights, new shapes
    assert outs[-1]["results"]["gpipe-resized"]["report"]["losses"] == pytest.approx(
        want_losses, rel=1e-6)


def test_a_stage_refuses_a_misplaced_context_or_another_stages_actions():
    with pytest.raises(ValueError, match="prev_rank must be given"):
        StageContext(stage=1, num_stages=2)
    with pytest.raises(ValueError, match="next_rank must be None"):
        StageContext(stage=1, num_stages=2, prev_rank=0, next_rank=2)
    rt = StageRuntime(StageContext(stage=0, num_stages=1), make_model(), loss_fn=F.mse_loss)
    xs, ys = micro_batches(1)
    with pytest.raises(ValueError, match="actions of another stage"):
        rt.run_step([Action(op=Op.F, stage=1, mb=0)], inputs=xs, targets=ys)
    with pytest.raises(ValueError, match="needs targets"):
        rt.run_step([Action(op=Op.F, stage=0, mb=0)], inputs=xs)


def test_a_stage_under_a_pool_tags_micro_batches_so_eviction_follows_the_schedule():
    from bitps.worker.config import PoolConfig
    from bitps.worker.memory.pool import ActivationPool

    width, b = 256, 64  # each Linear's saved input: 64 KiB
    seen = {}

    def residency_after_forwards(pool):
        def probe(module, args, out):
            seen.setdefault(module.calls, pool.residency())
            module.calls += 1
        return probe

    kept = {}
    for policy in ("schedule", "lru"):
        model = make_model(width=width, units=4)
        last = model[-1]
        last.calls = 0
        pool = ActivationPool(PoolConfig(capacity_bytes=11 * 64 << 10, policy=policy,
                                         allocator="bestfit", min_tensor_bytes=1024),
                              params=model.parameters())
        seen.clear()
        last.register_forward_hook(residency_after_forwards(pool))
        ctx = StageContext(stage=0, num_stages=1)
        rt = StageRuntime(ctx, model, loss_fn=F.mse_loss, pool=pool)
        order = [2, 0, 3, 1]
        actions = ([Action(op=Op.F, stage=0, mb=mb) for mb in range(4)]
                   + [Action(op=Op.BW, stage=0, mb=mb) for mb in order])
        xs, ys = micro_batches(4, b=b, width=width)
        report = rt.run_step(actions, inputs=xs, targets=ys)
        assert len(report.losses) == 4
        after_all_forwards = seen[3]
        kept[policy] = {mb for mb, (resident, off) in after_all_forwards.items() if off == 0}
        assert pool.stats().evictions > 0 and pool.residency() == {}
    # 5 saved tensors per micro-batch (3 Tanh outputs, the loss's input and target) in an arena
    # of 11: the schedule keeps the micro-batches whose backward comes first (2, then 0) and
    # offloads 1, whose backward comes last
    assert {2, 0} <= kept["schedule"] and 1 not in kept["schedule"]
    assert 0 not in kept["lru"]  # LRU offloads the oldest, though its backward is second


def test_the_prefetcher_reraises_its_threads_error_and_joins_on_close():
    def source():
        for i in range(3):
            yield torch.full((2,), float(i))
        raise OSError("disk gone")

    pre = Prefetcher(source(), prepare=lambda t: t * 2, depth=2)
    got = [pre.get(timeout=10)[0].item() for _ in range(3)]
    assert got == [0.0, 2.0, 4.0]
    with pytest.raises(PrefetchError) as info:
        pre.get(timeout=10)
    assert isinstance(info.value.__cause__, OSError)
    pre.close()
    assert not pre._thread.is_alive()

    made = []

    def counted():
        for i in range(100):
            made.append(i)
            yield torch.tensor([float(i)])

    pre = Prefetcher(counted(), depth=2)
    first = pre.get(timeout=10)
    time.sleep(0.2)
    assert first.item() == 0 and len(made) <= 4  # bounded: depth items ahead, one in hand
    pre.close()
    assert not pre._thread.is_alive() and threading.active_count() >= 1


def test_the_first_stage_takes_its_inputs_from_the_prefetcher_and_reports_to_metrics():
    from bitps.worker.pipeline.metrics import StageMetrics

    xs, ys = micro_batches(4)
    model = make_model()
    want, want_losses = reference_grads(make_model(), xs, ys)
    metrics = StageMetrics(0, 0)
    with Prefetcher(iter(xs), prepare=lambda x: x.clone(), depth=2) as pre:
        rt = StageRuntime(StageContext(stage=0, num_stages=1), model, loss_fn=F.mse_loss,
                          prefetcher=pre, metrics=metrics)
        actions = [Action(op=o, stage=0, mb=mb) for mb in range(4) for o in (Op.F, Op.BW)]
        report = rt.run_step(actions, targets=ys)
    assert report.losses == pytest.approx(want_losses, rel=1e-6)
    for n, q in model.named_parameters():
        torch.testing.assert_close(q.grad, want[n], rtol=1e-6, atol=0)
    labels = {"stage": "0", "replica": "0"}
    sample = metrics.registry.get_sample_value
    assert sample("bitps_stage_bubble_ratio", labels) == pytest.approx(report.bubble)
    assert sample("bitps_stage_micro_batch_size", labels) == MICRO
    assert sample("bitps_stage_busy_seconds_total", labels) == pytest.approx(report.busy_s)


if __name__ == "__main__":
    stage_main(json.loads(sys.argv[1]))
