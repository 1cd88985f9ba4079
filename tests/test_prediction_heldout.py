"""Weight prediction on models and data the benches do not contain (issue 26, acceptance 7):
an exact single-process simulation of asynchronous Adam on a parameter server with W = 2
workers taking turns (every push one update stale, as ``bench/staleness.py`` simulates the
demo model), each worker computing its gradient at its pulled copy, or at the copy moved ahead
by the real :class:`~bitps.worker.training.prediction.WeightPrediction`; each variant at its
best learning rate of a sweep, against the same pushes applied without staleness (each
gradient taken at the shard's current parameters: what staleness costs is the gap to it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitps.worker.training.prediction import WeightPrediction

W = 2
CLOCKS = 100
LRS = (1e-2, 3e-2, 1e-1)


def _regression(seed: int):
    """Noisy least squares, 32 features (an ill-conditioned design: feature scales 0.1..3)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 0.5, 32)
    truth = torch.randn(32, generator=gen)

    def batch(worker: int, clock: int):
        g = torch.Generator().manual_seed(seed * 10_000 + clock * W + worker)
        x = torch.randn(16, 32, generator=g) * scale
        return x, x @ truth + 0.1 * torch.randn(16, generator=g)

    model = torch.nn.Linear(32, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model, batch, lambda m, x, y: (m(x).squeeze(-1) - y).square().mean()


def _blobs(seed: int):
    """A 2-layer tanh MLP classifying 4 Gaussian blobs in 8 dimensions."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 8, generator=gen) * 1.5

    def batch(worker: int, clock: int):
        g = torch.Generator().manual_seed(seed * 10_000 + clock * W + worker)
        y = torch.randint(0, 4, (32,), generator=g)
        return centres[y] + torch.randn(32, 8, generator=g), y

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, batch, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)


def _flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _load(model, flat: np.ndarray) -> None:
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(flat[i:i + p.numel()]).reshape(p.shape))
            i += p.numel()


def _train(make, seed: int, lr: float, how: str) -> float:
    """Final loss (mean of the last 15 clocks) of ``how``: ``fresh`` (no staleness), ``async``
    or ``predicted`` (async with weight prediction)."""
    shard, batch, loss_fn = make(seed)
    opt = torch.optim.Adam(shard.parameters(), lr=lr / W)
    worker = [make(seed)[0] for _ in range(W)]
    version, versions = 0, [{0: 0} for _ in range(W)]
    exact = [{0: _flat(shard)} for _ in range(W)]
    shown = [{0: _flat(shard)} for _ in range(W)]
    predict = [WeightPrediction(exact[w], shown[w], ahead={0: W - 1}, versions=versions[w])
               for w in range(W)]
    losses = []

    def gradient(w, clock):
        _load(worker[w], shown[w][0] if how == "predicted" else exact[w][0])
        worker[w].zero_grad()
        x, y = batch(w, clock)
        loss = loss_fn(worker[w], x, y)
        loss.backward()
        return [p.grad.clone() for p in worker[w].parameters()], loss.item()

    for clock in range(CLOCKS):
        step = []
        for w in range(W):  # turns: each push lands after the other's, one update stale
            if how == "fresh":
                exact[w][0][:] = _flat(shard)
            grads, loss = gradient(w, clock)
            for p, g in zip(shard.parameters(), grads):
                p.grad = g
            opt.step()
            version += 1
            exact[w][0][:] = _flat(shard)  # the pull after its push
            versions[w][0] = version
            predict[w].update([0])
            step.append(loss)
        losses.append(np.mean(step))
    return float(np.mean(losses[-15:]))


@pytest.mark.parametrize("make", [_regression, _blobs], ids=["least squares", "blobs MLP"])
def test_prediction_closes_most_of_the_async_gap_on_models_the_benches_lack(make):
    best = {how: np.mean([min(_train(make, seed, lr, how) for lr in LRS) for seed in (0, 1)])
            for how in ("fresh", "async", "predicted")}
    print(make.__name__, best)
    assert best["async"] > best["fresh"]  # staleness costs something here
    assert best["predicted"] - best["fresh"] <= 0.5 * (best["async"] - best["fresh"])
