"""``StepClip``: global-norm gradient clipping for pushes that leave before the norm is known.

Clipping multiplies every gradient of a step by ``s = min(1, c / (|g| + 1e-6))`` (torch's
``clip_grad_norm_``), where ``|g|`` is the L2 norm of all of the step's gradients. Under overlap
a bucket is pushed while backward is still producing later ones, so ``s`` is not known yet.

What bitps does instead (any codec, any consistency mode, nothing changes on the shards):

1. Bucket ``b`` is pushed as ``p_b * g_b`` plus its error-feedback residual, with a predicted
   factor ``p_b = min(1, s_prev, c / (|g_b| + 1e-6))``: ``s_prev`` is the last step's exact
   factor. ``|g_b|`` never exceeds ``|g|``, so ``c / |g_b|`` bounds ``s`` from above and no
   bucket's push exceeds ``c`` in norm: a gradient spike is cut in the very bucket where it
   shows. ``p_b`` depends on nothing but ``g_b`` and the past, not on which buckets happened
   to be pushed before it, so a sync run repeats bit for bit.
2. Once every bucket of the step is pushed, ``|g|`` and so ``s`` are known, and every bucket's
   residual gets ``(s - p_b) * g_b`` (``Encoder.clip_correct``), in the units its push
   carried, so the next push delivers what this one missed.

So error feedback stays in clipped units: what the shards receive over the run is the clipped
gradients exactly, less the last residuals, as with clipping before any push; a step applies
its clipped gradient up to the correction, which arrives one step late. Keys pushed raw get a
residual too (``proto.codecs.Compressor`` for raw values), which only the corrections fill.
When clipping is inactive (``|g| < c``) every ``p_b`` is 1 = ``s`` and nothing is corrected.
With overlap off the step is one payload holding every gradient, and a model whose gradients
fit one bucket pushes one such bucket: either is pushed with ``s`` exactly.

The correction one step late is not free: on the e2e MoE (clipped at 1.0 nearly every step) it
cost sync 1-bit Adam 3.7 % of final loss. So in sync jobs with compressed pushes
(``OverlapConfig.hold_when_clipping``) a step that follows a clipped step (or the first step,
whose predecessor is unknown) pushes nothing from backward's hooks: it is one payload with
``s`` exactly, as with overlap off (:attr:`StepClip.expects_clipping`); only a step that clips
after one that did not is pushed with predicted factors and corrected. Async runs and float32
pushes keep the predicted factors by default: on the e2e LM async 1-bit Adam did better
without the hold, and sync fp32 runs reached DDP's target sooner without it on the LM and the
MoE (the hold gives up overlap).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["StepClip"]


class StepClip:
    """The clip factors of one worker's pushes, bucket by bucket. Not thread-safe: the thread
    that prepares pushes calls it, one step's buckets before the next step's."""

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.max_norm = max_norm
        self.last_factor = 1.0
        """The exact factor of the last complete step (``s_prev``)."""
        self.steps = 0
        """Steps ended (:meth:`end`) since this object was made (not checkpointed)."""
        self._seen = 0.0

    @property
    def expects_clipping(self) -> bool:
        """Whether the next step is likely to clip: the last step did, or none has ended yet
        (a fresh or resumed worker cannot tell)."""
        return self.steps == 0 or self.last_factor < 1.0

    def _bound(self, sum_squares: float) -> float:
        # float32, as the kernels apply it; torch's clip_grad_norm_ formula
        return float(np.float32(min(1.0, self.max_norm / (math.sqrt(sum_squares) + 1e-6))))

    def factor(self, sum_squares: float, *, whole: bool = False) -> float:
        """The factor to push a payload with, given its gradients' sum of squares; ``whole``:
        the payload holds every gradient of the step (overlap off), so the factor is exact."""
        self._seen += sum_squares
        bound = self._bound(sum_squares)
        return bound if whole else min(bound, self.last_factor)

    def end(self) -> float:
        """Every payload of the step has had its factor: return the step's exact factor (the
        next step's ``s_prev``)."""
        exact, self._seen = self._bound(self._seen), 0.0
        self.last_factor = exact
        self.steps += 1
        return exact

    def reset(self) -> None:
        """Forget a step that was refused part way (its last bucket never came)."""
        self._seen = 0.0
