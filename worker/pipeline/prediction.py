"""Weight prediction for flush-free plans (``2bw``): compute on an extrapolated view of the
weights instead of the stale version.

In 2BW step ``k`` reads version ``k - 1``, pulled right after this stage's push of step
``k - 2``, and its gradient is applied at its push, one pull interval later than a flushing
schedule's would be (through async shards, another replica's pushes land in between too). The
stage sees how far the weights moved over the last interval: the difference of two consecutive
pulled versions, which is the shards' optimizer step (Adam's momentum-smoothed direction, every
replica's pushes) over one interval. So step ``k`` computes on

    w_pred = w_{k-1} + horizon * (w_{k-1} - w_{k-2})

with ``horizon`` in pull intervals (1: the version a flushing schedule would read; SpecTrain,
Chen et al. 2018, and PipeMare, Yang et al. 2019, predict from the smoothed update the same
way). Version 0 has no predecessor and is used as pulled.

The prediction is a **separate view**: :meth:`WeightPredictor.view` returns new tensors and
keeps its own copies of the exact versions; the module's parameters, which the ``PSModel``
pulls into (and whose exact values its compressed pulls and replicas rely on), are only read.
Every compute of a micro-batch (F and BW) uses the same view, so its gradient is that of one
weight vector. Flushing plans never stash versions and so never call it: with them the option
changes nothing.

    pred = WeightPredictor(horizon=1.0)
    v0 = pred.view(0, exact0)      # clones of exact0
    v1 = pred.view(1, exact1)      # exact1 + 1.0 * (exact1 - exact0), elementwise
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["WeightPredictor", "predict"]


def predict(exact: torch.Tensor, previous: torch.Tensor, horizon: float) -> torch.Tensor:
    """``exact + horizon * (exact - previous)``, in the tensors' dtype, each operation rounded
    once (subtract, multiply, add: no fused multiply-add), so a float32 NumPy reference computes
    the same bits. A new tensor; the inputs are only read."""
    return exact + (exact - previous) * horizon


class WeightPredictor:
    """Predicted views of consecutive weight versions (module docstring).

    ``horizon``: pull intervals to extrapolate by (> 0). :meth:`view` is called once per
    version in increasing order (again for the same version when its values are refreshed: the
    view is then recomputed from the fresh values and the same previous version). It holds two
    copies of the stage's parameters (the last two exact versions)."""

    def __init__(self, horizon: float = 1.0) -> None:
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 (pull intervals), got {horizon}")
        self.horizon = float(horizon)
        self._version: int | None = None
        self._exact: dict[str, torch.Tensor] = {}     # version self._version, as pulled
        self._previous: dict[str, torch.Tensor] = {}  # the version before it (empty: none)

    def view(self, version: int, exact: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors version ``version`` computes on: ``exact`` extrapolated from the last
        version seen before it (as pulled, for the first). ``exact`` maps parameter names to
        the pulled values; they are copied, never written."""
        if self._version is not None and version < self._version:
            raise ValueError(f"version {version} after version {self._version}: views are "
                             "made in increasing version order")
        if version != self._version:  # a new version: the last one becomes its predecessor
            self._previous = self._exact
            self._version = version
        self._exact = {n: t.detach().clone() for n, t in exact.items()}
        with torch.no_grad():
            return {n: predict(t, self._previous[n], self.horizon)
                    if n in self._previous and t.is_floating_point() else t.clone()
                    for n, t in self._exact.items()}
