"""Per-layer forward + backward time of a pipelined model, measured: the costs that
``partition.balance`` cuts into stages (by time, not parameter counts).

    costs = profile_layers(model, inputs, targets, repeats=5, loss_fn=spec.loss)
    ranges = balance(costs, parts=4)

In a pipeline every stage must run the same partition, and measurements differ from process to
process, so one process measures and the others adopt its answer: :func:`broadcast_partition`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["broadcast_partition", "profile_layers"]


def profile_layers(model: nn.Sequential, sample_input: torch.Tensor, target: torch.Tensor,
                   repeats: int = 5, *, loss_fn: Callable | None = None,
                   warmup: int = 2) -> list[float]:
    """Seconds of forward + backward of each child of ``model`` on ``sample_input`` (one
    micro-batch), the median of ``repeats`` timed runs after ``warmup`` untimed ones.

    Each layer runs alone on the input the layers before it produce (computed once, detached),
    and its backward starts from a gradient of ones; the last layer's time includes
    ``loss_fn(output, target)`` and its backward (without ``loss_fn``: the output's sum). On
    CUDA the device is synchronised before and after each timed run. The timed runs go
    round robin over the layers (see the comment inside). The model's gradients are
    cleared afterwards; its parameters are not changed.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if len(model) == 0:
        raise ValueError("the model has no layers to profile")
    inputs = _layer_inputs(model, sample_input)
    last = len(model) - 1

    def run(i: int) -> None:
        x = inputs[i]
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = model[i](x)
        if i == last:
            (loss_fn(y, target) if loss_fn is not None else y.sum()).backward()
        else:
            y.backward(torch.ones_like(y))

    cuda = sample_input.device.type == "cuda"
    for _ in range(warmup):
        for i in range(len(model)):
            run(i)
    # Round robin over the layers, not one layer's repeats after another: a burst of load
    # from elsewhere on the host then lands on every layer's samples alike, and the median
    # drops it, instead of inflating the one layer it hit.
    times: list[list[float]] = [[] for _ in model]
    for _ in range(repeats):
        for i in range(len(model)):
            if cuda:
                torch.cuda.synchronize(sample_input.device)
            t0 = time.perf_counter()
            run(i)
            if cuda:
                torch.cuda.synchronize(sample_input.device)
            times[i].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def _layer_inputs(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    inputs = []
    with torch.no_grad():
        for layer in model:
            inputs.append(x)
            x = layer(x)
    return inputs


def broadcast_partition(ranges: Sequence[range] | None, *, src: int = 0,
                        group=None) -> list[range]:
    """Every process's copy of the partition global rank ``src`` holds (``ranges`` is read on
    ``src`` only; others pass ``None``). Collective over ``group`` (default: the world), so
    every rank must call it."""
    import torch.distributed as dist

    bounds = [[(r.start, r.stop) for r in ranges] if ranges is not None else None]
    dist.broadcast_object_list(bounds, src=src, group=group)
    if bounds[0] is None:
        raise ValueError(f"rank {src} broadcast no partition")
    return [range(a, b) for a, b in bounds[0]]
