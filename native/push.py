"""Fused worker kernels: 1-bit Adam's push (momentum or Adam direction, error feedback, sign1
code) and its pull (a published momentum decoded and applied), in one pass over each chunk.

Unfused, a worker's sync 1-bit Adam push is four passes over arrays of the key's length (three
numpy ops for ``lerp(m, g, 1 - beta1)`` into a scratch array, then the sign1 encode with error
feedback), its pull three (``m.fill(0)``, the decode added to m, the apply); with worker moments
the push is two (``adam_direction`` into a scratch array, the encode). Here each chunk of
``chunk`` elements is made, encoded and applied while it is in L1, so each state array is read
and written once and no scratch array is touched.

The results are bit for bit those of the unfused sequence (``tests/test_push_kernels.py`` checks
them against it over odd sizes, chunk boundaries, NaN/Inf input and empty keys): every element
sees the same float32 operations in the same order (``*``/``+`` where the numpy ops were,
``fma`` where ``adam_direction`` has it), and the scales the same fixed-order sums
(``sign1.chunk_scale``). Loops write one array each: loops that write two do not vectorize.

sync 1-bit Adam's m is, after the first compressed step, the decode of the last published code:
the worker keeps that code (1/32 of m's bytes) instead of m, and the ``_coded`` push and
:func:`onebit_code_apply` decode it chunk by chunk in L1. A step then reads the gradient, the
residual, v and the parameters and writes the residual and the parameters: two passes over the
key fewer than with m kept (m read by the push, written by the pull).

Payload written to ``scales``/``bits`` (views of the output buffer, ``sign1.payload_views``):
the sign1 layout of ``native/sign1.py``. Buffer ownership: the caller owns every array; the
kernels never allocate beyond 64 float64 lanes and one chunk of float32 scratch. ``grad`` and
the code may be read-only.
"""

from __future__ import annotations

import numba
import numpy as np

from bitps.native.sign1 import LANES, chunk_scale, decoded8, pack_signs, split
from bitps.native.update_rules import fma, onebit_adam_apply_den

__all__ = ["adam_direction_encode", "onebit_code_apply", "onebit_momentum_encode",
           "onebit_momentum_encode_coded"]

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")
# a kernel's per-chunk body, inlined in numba's IR (as a called function LLVM may not inline
# it, and the kernel slows: 6-18 % measured on a shard publish kernel so split)
_inline = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False,
                     error_model="numpy", inline="always")


@_jit
def onebit_momentum_encode(grad, exp_avg, grad_scale, one_minus_beta1, residual, scales, bits,
                           chunk, mean_abs):
    """sync 1-bit Adam's push after the warmup (``worker.algorithms.onebit.SyncMomenta``):
    this worker's momentum ``w = (g - m) * (1 - beta1) + m`` for ``g = grad * grad_scale``
    (``exp_avg`` is not changed: the published momentum replaces it), encoded as sign1 with the
    error-feedback ``residual``: ``u = w + residual``, the code of ``u``, ``residual = u -
    decode``. Was: multiply (when clipped), subtract, multiply, add into a scratch array, then
    ``sign1.encode``."""
    n = grad.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        _momentum_push_chunk(grad[lo:lo + m], exp_avg[lo:lo + m], grad_scale, one_minus_beta1,
                             residual[lo:lo + m], bits[lo >> 3:(lo + m + 7) >> 3], scales, c,
                             lanes, mean_abs)


def onebit_momentum_encode_coded(grad, code, grad_scale, one_minus_beta1, residual, scales,
                                 bits, chunk: int, mean_abs) -> None:
    """:func:`onebit_momentum_encode` with m the published momentum ``code`` (the sign1 payload
    :func:`onebit_code_apply` applied last, of the same ``chunk``: the caller checks), decoded
    chunk by chunk into an L1 scratch: bit for bit the same as with m decoded from it
    (``sign1.decode``, which gives the same values), without reading an array of the key's
    length."""
    m_scales, m_bits = split(code, grad.shape[0], chunk)
    _momentum_encode_coded(grad, m_scales, m_bits, grad_scale, one_minus_beta1, residual,
                           scales, bits, np.int64(chunk), mean_abs)


@_jit
def _momentum_encode_coded(grad, m_scales, m_bits, grad_scale, one_minus_beta1, residual,
                           scales, bits, chunk, mean_abs):
    n = grad.shape[0]
    lanes = np.zeros(LANES, np.float64)
    mom = np.empty(chunk, np.float32)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        _momentum_chunk(m_scales[c], m_bits, lo, m, mom)
        _momentum_push_chunk(grad[lo:lo + m], mom[:m], grad_scale, one_minus_beta1,
                             residual[lo:lo + m], bits[lo >> 3:(lo + m + 7) >> 3], scales, c,
                             lanes, mean_abs)


@_inline
def _momentum_push_chunk(g, mom, grad_scale, one_minus_beta1, u, bits, scales, c, lanes,
                         mean_abs):
    """One chunk of :func:`onebit_momentum_encode`."""
    for j in range(g.shape[0]):
        x = mom[j]
        u[j] = ((g[j] * grad_scale - x) * one_minus_beta1 + x) + u[j]
    _encode(u, bits, scales, c, lanes, mean_abs)


@_jit
def adam_direction_encode(grad, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2,
                          eps, inv_bias_correction1, bias_correction2_sqrt, grad_scale,
                          residual, scales, bits, chunk, mean_abs):
    """async/ssp 1-bit Adam's push after the warmup, with worker moments (``MomentsPush``):
    advance m and v with ``g = grad * grad_scale`` and encode Adam's direction with the
    error-feedback ``residual`` as sign1 (``update_rules.adam_direction``'s arithmetic, then
    ``sign1.encode``'s). Was: ``adam_direction`` into a scratch array, then the encode."""
    n = grad.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        g = grad[lo:lo + m]
        mom = exp_avg[lo:lo + m]
        sq = exp_avg_sq[lo:lo + m]
        u = residual[lo:lo + m]
        for j in range(m):
            mj = mom[j]
            mom[j] = fma(one_minus_beta1, g[j] * grad_scale - mj, mj)
        for j in range(m):
            gj = g[j] * grad_scale
            sq[j] = fma(one_minus_beta2 * gj, gj, sq[j] * beta2)
        for j in range(m):
            d = mom[j] * inv_bias_correction1 / (np.sqrt(sq[j]) / bias_correction2_sqrt + eps)
            u[j] = d + u[j]
        _encode(u, bits[lo >> 3:(lo + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def _encode(u, bits, scales, c, lanes, mean_abs):
    """``sign1.encode``'s tail for one chunk ``u`` (holding ``grad + residual``): its scale,
    its sign bits, and the residual left."""
    s = chunk_scale(u, lanes, mean_abs)
    pack_signs(u, bits)
    neg_s = -s
    for j in range(u.shape[0]):
        x = u[j]
        u[j] = x - (neg_s if x < 0 else s)
    scales[c] = s


def onebit_code_apply(code, denominator, param, chunk: int, weight_decay, neg_lr,
                      ratio_clip) -> None:
    """sync 1-bit Adam's pull after the warmup (``OneBitMomentum.apply``): apply the published
    momentum ``code`` (sign1, exactly ``payload_bytes(n, chunk)`` bytes: the caller checks the
    length) with the frozen v's ``denominator`` (``update_rules.onebit_denominator``) to
    ``param`` (``update_rules.onebit_adam_apply_den``), each chunk's momentum decoded into an L1
    scratch (m is not kept: the worker keeps the code, which
    :func:`onebit_momentum_encode_coded` reads). Was: ``m.fill(0)``, ``sign1.decode_add`` into
    m, the apply with ``sqrt(v)`` taken every step."""
    n = param.shape[0]
    scales, bits = split(code, n, chunk)
    _code_apply(scales, bits, denominator, param, np.int64(chunk), weight_decay, neg_lr,
                ratio_clip)


@_jit
def _code_apply(scales, bits, denominator, param, chunk, weight_decay, neg_lr, ratio_clip):
    n = param.shape[0]
    mom = np.empty(chunk, np.float32)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        _momentum_chunk(scales[c], bits, lo, m, mom)
        onebit_adam_apply_den(param[lo:lo + m], mom[:m], denominator[lo:lo + m], weight_decay,
                              neg_lr, ratio_clip)


@_inline
def _momentum_chunk(scale, bits, lo, m, mom):
    """``mom[:m]`` = one chunk (elements ``lo ..``) of a published momentum: 0.0 + the decoded
    value, what decode_add onto zeros gives (+0.0 for a zero scale)."""
    s = scale
    neg_s = -s
    b = bits[lo >> 3:(lo + m + 7) >> 3]
    full = m - m % 8
    # 0.0 + the selected value, for each of the two values once
    positive, negative = np.float32(0.0) + s, np.float32(0.0) + neg_s
    for i in range(full >> 3):
        decoded8(mom, 8 * i, b[i], positive, negative)
    for j in range(full, m):
        mom[j] = np.float32(0.0) + (neg_s if (b[j >> 3] >> (j & 7)) & 1 else s)
