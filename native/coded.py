"""Optimizer steps of a gradient pushed as a sign1 code (``ps.pushcode.PushCode``): each block
of the code is decoded into L1 scratch right before the step reads it (``sign1.decode_span``),
bit for bit the step of the decoded gradient (``update_rules.adam_step`` on ``sign1.decode``),
without writing and reading a key-long decoded array. (1-bit Adam's own kernels do the same
in ``native.publish``.)

Buffer ownership: the caller owns every array; a kernel allocates one block of float32
scratch. ``code_scales``/``code_bits`` (``sign1.split`` of the pushed frame) may be read-only.
"""

from __future__ import annotations

import numba
import numpy as np

from bitps.native.sign1 import decode_span
from bitps.native.update_rules import adam_step

__all__ = ["BLOCK", "adam_step_code"]

BLOCK = 2048
"""Elements decoded at a time: 8 KiB of scratch, a multiple of 8 (``decode_span``)."""

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@_jit
def adam_step_code(param, code_scales, code_bits, code_chunk, exp_avg, exp_avg_sq, grad_scale,
                   one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decoupled, decay,
                   neg_step_size, bias_correction2_sqrt):
    """``update_rules.adam_step`` with the gradient a sign1 code of ``param``'s length, in
    chunks of ``code_chunk``; the other arguments as there."""
    n = param.shape[0]
    g = np.empty(min(n, BLOCK), np.float32)
    for lo in range(0, n, BLOCK):
        m = min(n, lo + BLOCK) - lo
        decode_span(code_scales, code_bits, code_chunk, lo, g[:m])
        adam_step(param[lo:lo + m], g[:m], exp_avg[lo:lo + m], exp_avg_sq[lo:lo + m],
                  grad_scale, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                  decoupled, decay, neg_step_size, bias_correction2_sqrt)
