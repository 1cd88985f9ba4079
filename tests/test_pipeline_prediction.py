"""Weight prediction for the flush-free ``2bw`` schedule (``worker.pipeline.prediction``): its
arithmetic against a float32 NumPy reference bit for bit; a one-stage 2BW run through an
in-process SGD "shard" computes on the predicted views while the module keeps the exact values
(against a plain-torch reference written here); flushing schedules are unchanged bit for bit
with a predictor given; the config field and flag.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitps.worker.pipeline.config import ParallelConfig
from bitps.worker.pipeline.errors import ConfigError
from bitps.worker.pipeline.prediction import WeightPredictor, predict
from bitps.worker.pipeline.runtime import StageContext, StageRuntime
from bitps.worker.pipeline.schedules import get_schedule
from bitps.worker.pipeline.settings import parse_config
from tests.test_pipeline_runtime import make_model, micro_batches

LR = 0.05


def np_predict(exact: np.ndarray, previous: np.ndarray, horizon: float) -> np.ndarray:
    h = np.float32(horizon)
    return (exact + (exact - previous) * h).astype(np.float32)


@pytest.mark.parametrize("horizon", [1.0, 0.5, 2.0, 1.3])
def test_predict_matches_a_float32_numpy_reference_bit_for_bit(horizon):
    g = torch.Generator().manual_seed(3)
    exact, previous = torch.randn(257, 33, generator=g), torch.randn(257, 33, generator=g)
    keep = exact.clone(), previous.clone()
    got = predict(exact, previous, horizon)
    want = np_predict(exact.numpy(), previous.numpy(), horizon)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    assert torch.equal(exact, keep[0]) and torch.equal(previous, keep[1])  # only read


def test_views_extrapolate_from_the_previous_version_and_never_write_the_exact_values():
    pred = WeightPredictor(horizon=1.0)
    g = torch.Generator().manual_seed(0)
    versions = [{"w": torch.randn(5, 4, generator=g), "steps": torch.tensor([v])}
                for v in range(4)]
    copies = [{n: t.clone() for n, t in v.items()} for v in versions]
    v0 = pred.view(0, versions[0])
    assert torch.equal(v0["w"], versions[0]["w"]) and v0["w"] is not versions[0]["w"]
    for v in (1, 2, 3):
        got = pred.view(v, versions[v])
        want = np_predict(versions[v]["w"].numpy(), versions[v - 1]["w"].numpy(), 1.0)
        assert np.array_equal(got["w"].numpy(), want)
        assert torch.equal(got["steps"], versions[v]["steps"])  # integers: as pulled
        got["w"].add_(1.0)  # the view is the caller's: the predictor's copies are apart
    for v, c in zip(versions, copies):
        assert all(torch.equal(v[n], c[n]) for n in v)
    # the same version again (refreshed values): recomputed from the same predecessor
    fresh = {"w": versions[3]["w"] * 2, "steps": versions[3]["steps"]}
    want = np_predict(fresh["w"].numpy(), versions[2]["w"].numpy(), 1.0)
    assert np.array_equal(pred.view(3, fresh)["w"].numpy(), want)
    with pytest.raises(ValueError, match="increasing version order"):
        pred.view(2, versions[2])
    with pytest.raises(ValueError, match="horizon must be > 0"):
        WeightPredictor(horizon=0)


class SGDShard:
    """The PS of a one-stage pipeline in this process: ``step()`` applies ``w -= lr * grad`` to
    the module (the exact copy, as a pull would write it) and records every pushed gradient."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.pushed = module, []

    def step(self) -> None:
        with torch.no_grad():
            grads = {n: p.grad.clone() for n, p in self.module.named_parameters()}
            self.pushed.append(grads)
            for n, p in self.module.named_parameters():
                p.sub_(grads[n] * LR)
                p.grad = None

    def synchronize(self) -> None:
        pass

    def no_sync(self):
        return contextlib.nullcontext()


def run_one_stage(schedule: str, steps: int, m: int, predictor=None):
    """Train a one-stage pipeline (the whole model) for ``steps`` steps of ``schedule``; the
    module, the shard (its pushes) and every micro-batch's loss."""
    model = make_model()
    shard = SGDShard(model)
    rt = StageRuntime(StageContext(stage=0, num_stages=1), model, loss_fn=F.mse_loss,
                      ps_model=shard, predictor=predictor)
    xs, ys = micro_batches(steps * m)
    sched = get_schedule(schedule)
    losses = []
    if sched.flushes:
        for k in range(steps):
            report = rt.run_step(sched.generate(1, m)[0], inputs=xs[k * m:(k + 1) * m],
                                 targets=ys[k * m:(k + 1) * m])
            losses += report.losses
    else:
        losses = rt.run_step(sched.generate(1, m, steps)[0], inputs=xs, targets=ys).losses
    return model, shard, losses


def reference_2bw(steps: int, m: int, horizon: float):
    """Plain torch: step k's gradient at the view of version max(k - 1, 0), version v + 1 =
    version v less lr x step v's gradient; the exact weights and the gradients pushed."""
    model = make_model()
    exact = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    xs, ys = micro_batches(steps * m)
    pushed = []
    for k in range(steps):
        v = max(k - 1, 0)
        w = exact[v]
        if v > 0:
            w = {n: t + (t - exact[v - 1][n]) * horizon for n, t in w.items()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(w[n])
        model.zero_grad(set_to_none=True)
        for x, y in zip(xs[k * m:(k + 1) * m], ys[k * m:(k + 1) * m]):
            (F.mse_loss(model(x), y) / m).backward()
        pushed.append({n: p.grad.clone() for n, p in model.named_parameters()})
        exact.append({n: exact[-1][n] - pushed[-1][n] * LR for n in exact[-1]})
    return exact[-1], pushed


@pytest.mark.parametrize("horizon", [1.0, 2.0])
def test_2bw_computes_on_predicted_views_and_the_module_keeps_the_exact_weights(horizon):
    steps, m = 5, 3
    model, shard, _ = run_one_stage("2bw", steps, m, WeightPredictor(horizon))
    want_exact, want_pushed = reference_2bw(steps, m, horizon)
    assert len(shard.pushed) == steps
    for k, (got, want) in enumerate(zip(shard.pushed, want_pushed)):
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7,
                                       msg=f"step {k} {n}")
    for n, p in model.named_parameters():  # exact: only the shard's updates, no prediction
        torch.testing.assert_close(p.detach(), want_exact[n], rtol=1e-6, atol=1e-7, msg=n)
    # and prediction made a difference: without it the pushes differ from step 2 on
    plain = run_one_stage("2bw", steps, m)[1].pushed
    assert all(torch.equal(a[n], b[n]) for a, b in zip(plain[:2], shard.pushed[:2]) for n in a)
    assert not all(torch.equal(plain[2][n], shard.pushed[2][n]) for n in plain[2])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_flushing_schedules_are_unchanged_bit_for_bit_with_a_predictor(schedule):
    plain_model, plain, plain_losses = run_one_stage(schedule, 4, 2)
    model, shard, losses = run_one_stage(schedule, 4, 2, WeightPredictor(1.0))
    assert losses == plain_losses
    for a, b in zip(plain.pushed, shard.pushed, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    for (n, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), n


def test_the_config_field_and_flag():
    assert ParallelConfig().weight_prediction == 2.0  # on for 2bw: it wins (docs/pipeline.md)
    assert ParallelConfig.from_mapping({"weight_prediction": 1}).weight_prediction == 1
    with pytest.raises(ConfigError, match="weight_prediction"):
        ParallelConfig(weight_prediction=-1.0)
    cfg = parse_config(["--servers", "h:1", "--schedule", "2bw", "--weight-prediction", "1.5"],
                       environ={})
    assert cfg.parallel.weight_prediction == 1.5
    cfg = parse_config(["--servers", "h:1"], environ={"BITPS_WEIGHT_PREDICTION": "0.5"})
    assert cfg.parallel.weight_prediction == 0.5
