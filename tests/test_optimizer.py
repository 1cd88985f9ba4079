"""``bitps.Optimizer``: a torch optimizer whose step is the shards'. With one worker in sync
mode it trains exactly as ``torch.optim.AdamW`` with the same schedule and param groups; with
two it makes the DDP update (AdamW on the mean gradient); what it cannot honour is refused."""

from __future__ import annotations

import threading

import pytest
import torch

import bitps
from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError
from bitps.ps import OptimizerConfig
from bitps.worker import ClientConfig, PSClient
from tests.helpers import run_ranks

STEPS = 50
# The shard's own lr and weight decay differ from the script's: only the pushed ones may count.
SHARD = OptimizerConfig(name="adamw", lr=0.5, weight_decay=0.3)

SCHEDULES = {
    "lambda_warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 10)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS,
                                                                     eta_min=1e-4),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    """Hugging Face's convention: no weight decay on biases; here also another lr."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0,
                                                      "lr": 2e-2}]


def _batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _loss(model, step, rank=0):
    x, y = _batch(step, rank)
    return torch.nn.functional.cross_entropy(model(x), y)


def _client(shards, rank=0, world=1) -> PSClient:
    return PSClient(ClientConfig(servers=tuple(f"127.0.0.1:{s.ports['grpc_port']}"
                                               for s in shards), rank=rank, world_size=world,
                                 partition_bytes=1024))


def _train(model, optimizer, scheduler, rank=0, *, clip=True, set_to_none=True):
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=set_to_none)
        if step and not set_to_none:  # zeroed in place, as torch's optimizers do
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        loss = _loss(model, step, rank)
        loss.backward()
        if clip:  # read at step() (overlap off): it counts
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("schedule", "set_to_none"), [(s, s == "cosine") for s in SCHEDULES])
def test_one_sync_worker_trains_as_torch_adamw(cluster, schedule, set_to_none):
    ref = _model()
    opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.01)
    ref_losses = _train(ref, opt, SCHEDULES[schedule](opt), set_to_none=set_to_none)

    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    model = _model()
    optimizer = bitps.Optimizer(_groups(model), _client(shards), lr=1e-2, weight_decay=0.01,
                                model=model)
    try:
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert len(optimizer.ps_model.keys) > 4  # the first weight is cut in two
        losses = _train(model, optimizer, SCHEDULES[schedule](optimizer),
                        set_to_none=set_to_none)
    finally:
        optimizer.close()
    assert optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (name, (got - want).abs().max())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6


def test_under_overlap_each_push_carries_its_own_steps_lr(cluster):
    """Overlap on: buckets go from backward's hooks and the rest after step() returned, when
    the scheduler may have moved the lr on; every push still carries its step's lr."""
    ref = _model()
    opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.01)
    ref_losses = _train(ref, opt, SCHEDULES["lambda_warmup"](opt), clip=False)
    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    model = _model()
    optimizer = bitps.Optimizer(_groups(model), _client(shards), lr=1e-2, weight_decay=0.01,
                                model=model,
                                overlap=bitps.OverlapConfig(mode="on", bucket_bytes=1024))
    try:
        losses = _train(model, optimizer, SCHEDULES["lambda_warmup"](optimizer), clip=False)
        optimizer.synchronize()
    finally:
        optimizer.close()
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_sync_workers_make_the_ddp_update(cluster, schedule):
    """Each rank's own batches; the reference averages both ranks' gradients (what DDP's
    all-reduce gives) and steps torch's AdamW once per step, over two param groups."""
    ref = _model()
    opt = torch.optim.AdamW(_groups(ref), lr=5e-3, weight_decay=0.02)
    sched = SCHEDULES[schedule](opt)
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            ref.zero_grad()
            _loss(ref, step, rank).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
        sched.step()

    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    models, errors = [_model(), _model()], []

    def rank(r):
        try:
            optimizer = bitps.Optimizer(_groups(models[r]), _client(shards, r, 2), lr=5e-3,
                                        weight_decay=0.02, model=models[r])
            try:
                scheduler = SCHEDULES[schedule](optimizer)
                for step in range(STEPS):
                    optimizer.zero_grad()
                    _loss(models[r], step, r).backward()
                    optimizer.step()
                    scheduler.step()
            finally:
                optimizer.close()
        except BaseException as err:  # noqa: BLE001 - raised by the test
            errors.append(err)

    run_ranks(rank)
    assert not errors, errors
    for model in models:
        for got, want in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()


def test_sync_ranks_whose_lr_disagree_are_refused_with_a_typed_error(cluster):
    shards = cluster(1, mode="sync", metrics_port=-1, optimizer=SHARD, pull_deadline_s=5.0)
    models, raised = [_model(), _model()], {}
    first_pushed = threading.Event()

    def rank(r):
        optimizer = bitps.Optimizer(models[r], _client(shards, r, 2), lr=(1e-3, 2e-3)[r])
        try:
            _loss(models[r], 0, r).backward()
            if r == 1:
                first_pushed.wait(10)
            else:
                threading.Timer(0.5, first_pushed.set).start()
            optimizer.step()
        except BaseException as err:  # noqa: BLE001 - what the test looks at
            raised[r] = err
        finally:
            try:
                optimizer.close()
            except BaseException:  # noqa: BLE001 - rank 0's pull may be the one that failed
                pass

    run_ranks(rank, timeout_s=60)
    err = raised.get(1)
    assert isinstance(err, PSError) and err.code == pb.BAD_HYPERPARAMETERS, raised
    assert "0.002" in str(err) and "0.001" in str(err), err


def test_what_the_shards_own_is_refused_in_a_param_group(cluster):
    shards = cluster(1, mode="sync", metrics_port=-1, optimizer=SHARD)
    model = _model()
    with pytest.raises(ValueError, match=r"sets \['betas'\].*--beta1"):
        bitps.Optimizer([{"params": list(model.parameters()), "betas": (0.8, 0.9)}],
                        _client(shards), model=model)
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got -1"):
        bitps.Optimizer(model, _client(shards), lr=-1)
    with pytest.raises(ValueError, match=r"missing \['2.bias'\]"):
        bitps.Optimizer(list(model.parameters())[:3], _client(shards), model=model)
    with pytest.raises(ValueError, match="overlap mode 'on' needs the module"):
        bitps.Optimizer(model.parameters(), _client(shards),
                        overlap=bitps.OverlapConfig(mode="on"))
    optimizer = bitps.Optimizer(model, _client(shards))
    try:
        with pytest.raises(RuntimeError, match="give every param group then"):
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        optimizer.param_groups[0]["lr"] = float("nan")  # as a broken scheduler might
        _loss(model, 0).backward()
        with pytest.raises(ValueError, match="lr must be a finite number > 0, got nan"):
            optimizer.step()
    finally:
        optimizer.close()


def test_momentum_with_a_schedule_and_groups_is_bit_identical_to_torch_sgd(cluster):
    """SGD-momentum's kernels match torch's to the bit (tests/test_update_rules.py), and the
    pushed lr keeps them so: every step's schedule and group values arrive exactly."""
    ref = _model()
    opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    _train(ref, opt, SCHEDULES["cosine"](opt))
    shards = cluster(2, mode="sync", metrics_port=-1,
                     optimizer=OptimizerConfig(name="momentum", lr=0.37, momentum=0.9))
    model = _model()
    optimizer = bitps.Optimizer(_groups(model), _client(shards), lr=0.1, weight_decay=0.01,
                                model=model)
    try:
        _train(model, optimizer, SCHEDULES["cosine"](optimizer))
    finally:
        optimizer.close()
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want), (got - want).abs().max()
