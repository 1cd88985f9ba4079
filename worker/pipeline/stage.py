"""The compute of one pipeline stage over its module: forward, input-backward, weight-backward.

    compute = StageCompute(module, first=False, last=True, loss_fn=F.mse_loss)
    compute.forward(mb, x, target=y, m=4)    # keeps the graph; returns the loss here
    gx = compute.backward_input(mb)          # B: the input's gradient only (sent to s - 1)
    compute.backward_weight(mb)              # W: accumulates the weights' gradients in .grad

**Segments.** A stage module that is an ``nn.Sequential`` is run child by child; each child's
input is its own leaf (the previous child's output, detached, requiring grad), so the graph is
cut at every child boundary. B walks the children backwards with ``torch.autograd.grad(output,
inputs=[input], grad_outputs, retain_graph=True)`` and keeps the gradient that reached each
child's output; W then differentiates each child's output with respect to that child's
parameters only, from the kept gradient (``torch.autograd.backward(..., inputs=params)``, which
accumulates into ``param.grad`` and fires post-accumulate-grad hooks). So W runs only the
weight-gradient kernels, not the input-gradient chain again, and B then W computes exactly the
kernels BW does (``BW`` is one ``backward`` per child with its input and parameters). A module
that is not a Sequential is one segment (correct, but W repeats the input-gradient work inside
it). Children must not modify their input in place (``nn.ReLU(inplace=True)``): it is a leaf
that requires grad.

**The loss.** The last stage computes ``loss_fn(output, target) / m`` so that the gradients
summed over ``m`` micro-batches are those of the mean loss, as single-process gradient
accumulation computes them; its B starts from that loss.

**The first stage's input** requires grad when it is floating point, so its B runs the same
kernels as every other stage's (the gradient is dropped): the schedule's timing assumes it.

**Weight versions** (flush-free schedules): :meth:`forward` takes ``params``, a mapping of the
module's parameter names to the tensors of the version the micro-batch uses
(``torch.func.functional_call``); its B and W then use the same tensors, and W accumulates into
their ``.grad``. Without ``params`` the module's own parameters are used.

Each micro-batch's graph and saved state are freed after its last backward action.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["StageCompute"]


@dataclass
class _InFlight:
    """One micro-batch between its F and its last backward."""

    inputs: list[torch.Tensor]        # each segment's input leaf
    outputs: list[torch.Tensor]       # each segment's output (the last: the loss on the last stage)
    params: list[list[torch.Tensor]]  # each segment's parameters this micro-batch used
    grads: list[torch.Tensor | None] = field(default_factory=list)  # at each output, after B
    input_grad: torch.Tensor | None = None


class StageCompute:
    """F, B, W and BW of one stage's ``module`` for micro-batches in flight (by index)."""

    def __init__(self, module: nn.Module, *, first: bool, last: bool,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        if last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn (loss_fn(output, target))")
        self.module = module
        self.first, self.last, self.loss_fn = first, last, loss_fn
        children = list(module.named_children()) if isinstance(module, nn.Sequential) else []
        self.segments: list[tuple[str, nn.Module]] = children or [("", module)]
        self._inflight: dict[int, _InFlight] = {}

    @property
    def inflight(self) -> int:
        """Micro-batches whose graph is held now."""
        return len(self._inflight)

    def forward(self, mb: int, x: torch.Tensor, *, target: torch.Tensor | None = None,
                m: int = 1, params: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Run ``mb`` forward from input ``x``; returns the output (the last stage: the loss,
        divided by ``m``). The graph is kept until the micro-batch's last backward."""
        if mb in self._inflight:
            raise ValueError(f"micro-batch {mb} is already in flight on this stage")
        if self.last and target is None:
            raise ValueError(f"the last stage's forward of micro-batch {mb} needs its target")
        state = _InFlight(inputs=[], outputs=[], params=[])
        h = x
        for name, seg in self.segments:
            leaf = h.detach()
            if leaf.is_floating_point():
                leaf.requires_grad_(True)
            seg_params = self._segment_params(name, seg, params)
            if params is None:
                out = seg(leaf)
            else:
                out = functional_call(seg, {n: t for n, t in seg_params}, (leaf,))
            state.inputs.append(leaf)
            state.params.append([t for _, t in seg_params if t.requires_grad])
            state.outputs.append(out)
            h = out
        if self.last:
            state.outputs[-1] = self.loss_fn(h, target) / m
        self._inflight[mb] = state
        return state.outputs[-1]

    def backward_input(self, mb: int, grad_output: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
        """B: the gradient of ``mb``'s input (None when the input is not differentiable), from
        ``grad_output`` (the last stage: from its loss). Keeps the gradient at every segment
        output for :meth:`backward_weight`."""
        state = self._state(mb)
        if state.grads:
            raise ValueError(f"micro-batch {mb}'s B already ran")
        g = self._start_grad(mb, state, grad_output)
        grads: list[torch.Tensor | None] = [None] * len(self.segments)
        for i in reversed(range(len(self.segments))):
            grads[i] = g
            leaf = state.inputs[i]
            if not leaf.requires_grad or g is None:
                g = None
                continue
            (g,) = torch.autograd.grad(state.outputs[i], inputs=[leaf], grad_outputs=g,
                                       retain_graph=True, allow_unused=True)
        state.grads, state.input_grad = grads, g
        return g

    def backward_weight(self, mb: int) -> None:
        """W: accumulate ``mb``'s weight gradients into ``.grad`` (after its B); frees the
        micro-batch."""
        state = self._state(mb)
        if not state.grads:
            raise ValueError(f"micro-batch {mb}'s W needs its B first")
        for i in range(len(self.segments)):
            if state.params[i] and state.grads[i] is not None:
                torch.autograd.backward(state.outputs[i], grad_tensors=state.grads[i],
                                        inputs=state.params[i])
        del self._inflight[mb]

    def backward(self, mb: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """BW: B and W fused, one backward per segment; returns the input's gradient and frees
        the micro-batch."""
        state = self._state(mb)
        g = self._start_grad(mb, state, grad_output)
        for i in reversed(range(len(self.segments))):
            leaf = state.inputs[i]
            inputs = ([leaf] if leaf.requires_grad else []) + state.params[i]
            if g is None or not inputs:
                g = None
                continue
            leaf.grad = None
            torch.autograd.backward(state.outputs[i], grad_tensors=g, inputs=inputs)
            g = leaf.grad if leaf.requires_grad else None
        del self._inflight[mb]
        return g

    def drop(self) -> None:
        """Forget every micro-batch in flight (after a failed step)."""
        self._inflight.clear()

    # -- internals ----------------------------------------------------------------------------
    def _state(self, mb: int) -> _InFlight:
        try:
            return self._inflight[mb]
        except KeyError:
            raise ValueError(f"micro-batch {mb} is not in flight on this stage (in flight: "
                             f"{sorted(self._inflight)})") from None

    def _start_grad(self, mb: int, state: _InFlight, grad_output: torch.Tensor | None
                    ) -> torch.Tensor:
        if self.last:
            return torch.ones_like(state.outputs[-1])
        if grad_output is None:
            raise ValueError(f"micro-batch {mb}'s backward needs the gradient of its output")
        return grad_output

    @staticmethod
    def _segment_params(name: str, seg: nn.Module, params: Mapping[str, torch.Tensor] | None
                        ) -> list[tuple[str, torch.Tensor]]:
        """The segment's parameters, by their names inside the segment: the module's own, or
        those of ``params`` (keyed by the stage module's names)."""
        own = list(seg.named_parameters())
        if params is None:
            return own
        prefix = name + "." if name else ""
        return [(n, params[prefix + n]) for n, _ in own]
