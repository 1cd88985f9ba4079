"""``StepClip``: global-norm gradient clipping for pushes that leave before the norm is known.

Clipping multiplies every gradient of a step by ``s = min(1, c / (|g| + 1e-6))`` (torch's
``clip_grad_norm_``), where ``|g|`` is the L2 norm of all of the step's gradients. Under overlap
a bucket is pushed while backward is still producing later ones, so ``s`` is not known yet.

What bitps does instead (any codec, any consistency mode, nothing changes on the shards):

1. Bucket ``b`` is pushed as ``p_b * g_b`` plus its error-feedback residual, with a predicted
   factor ``p_b = min(1, s_prev, c / (|g_seen| + 1e-6))``: ``s_prev`` is the last step's exact
   factor and ``g_seen`` the gradients pushed so far this step, ``b``'s included. ``|g_seen|``
   never exceeds ``|g|``, so ``c / |g_seen|`` bounds ``s`` from above and each bucket's push is
   at most ``c`` in norm: a gradient spike is cut in the very bucket where it shows.
2. The step's last bucket knows ``|g|``: it is pushed with the exact ``s``, and every earlier
   bucket's residual gets ``(s - p_b) * g_b`` (``PSClient.clip_correct``), in the units the
   push carried, so the next push delivers what this one missed.

So error feedback stays in clipped units: what the shards receive over the run is the clipped
gradients exactly, less the last residuals, as with clipping before any push; a step applies
its clipped gradient up to the correction, which arrives one step late. Keys pushed raw get a
residual too (``proto.codecs.Compressor`` for raw values), which only the corrections fill.
When clipping is inactive (``|g| < c``) every ``p_b`` is 1 = ``s`` and nothing is corrected.
With overlap off there is one payload: it is the last, and it is pushed with ``s`` exactly.
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
        self._seen = 0.0

    def factor(self, sum_squares: float, *, last: bool) -> float:
        """The factor to push a bucket with, given its gradients' sum of squares; ``last``: the
        step's last bucket, which gets the exact factor (the step then ends). Values are float32
        numbers, as the kernels apply them."""
        self._seen += sum_squares
        bound = float(np.float32(min(1.0, self.max_norm / (math.sqrt(self._seen) + 1e-6))))
        if last:
            self.last_factor, self._seen = bound, 0.0
            return bound
        return min(bound, self.last_factor)

    def reset(self) -> None:
        """Forget a step that was refused part way (its last bucket never came)."""
        self._seen = 0.0
