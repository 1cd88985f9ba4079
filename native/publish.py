"""Fused update-and-publish kernels: a shard's 1-bit Adam update, its sign1 code with the shard's
error feedback, and the code's decode added to the parameters, in one pass over each chunk.

Unfused, one compressed update of a key is four or five passes over arrays of its length (the
update into a scratch ``delta``, ``u = delta + residual`` and its scales, the signs and the new
residual, zeros, the decode added to the parameters or to m), each streaming the key through
memory. Here every chunk of ``chunk`` elements (8 KiB at the default 2048) is updated, encoded
and applied while it is in L1, so each state array is read and written once.

The results are bit for bit those of the unfused sequence the rules ran before
(``tests/test_publish_kernels.py`` checks them against it over odd sizes, chunk boundaries,
NaN/Inf input and empty keys): every element sees the same float32 operations in the same
order, and the scales the same fixed-order sums (``sign1.chunk_scale``).

Payload written to ``scales``/``bits`` (views of the output buffer,
``sign1.payload_views``): the sign1 layout of ``native/sign1.py``. Buffer ownership: the caller
owns every array; the kernels never allocate beyond 64 float64 lanes (and, for the ``_code``
kernels, one block of float32 for the pushed codes' decode; for the sync ones, one chunk of
float32 for m). ``grad``/``direction`` and a
pushed code's scales and bits may be read-only views of a received frame.

The ``_code`` twins take a push still in its sign1 code (``ps.pushcode.PushCode``) and decode
it into L1 scratch, :data:`_DECODE_BLOCK` elements at a time, right before the update reads
them, bit for bit what decoding it into a key-long array first gives: one array's write and
read fewer per update. (Decoded a publish chunk at a time, 256 elements for 1-bit Adam, the
calls' overhead took most of that saving: sync 38.0 against 38.5 ms per 64 MiB decoded
first.) The sync one takes a step's several codes (``ps.pushcode.PushCodes``) and sums them
the same way: with W pushes, W - 1 reads and writes of a key-long sum fewer, besides the
decode's.
"""

from __future__ import annotations

import numba
import numpy as np

from bitps.native.sign1 import LANES, add_span, chunk_scale, decode_span, pack_signs
from bitps.native.update_rules import fma, onebit_adam_apply_den

__all__ = ["onebit_direction_publish", "onebit_direction_publish_code",
           "onebit_moments_publish", "onebit_moments_publish_code", "onebit_sync_publish",
           "onebit_sync_publish_code", "sign1_publish_delta"]

_DECODE_BLOCK = 2048  # elements of pushed codes decoded (and summed) per call: 8 KiB of L1
_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@_jit
def onebit_sync_publish(acc, grad_scale, residual, scales, bits, denominator, param, chunk,
                        mean_abs, weight_decay, neg_lr, ratio_clip):
    """sync 1-bit Adam's compressed step on the shard (``OneBitAdamSync``): with the step's
    sum of worker momenta ``acc`` and ``1/W`` in ``grad_scale``, encode ``u = acc * grad_scale
    + residual`` (the sign1 code, the new residual) and apply the code's decode, m, the
    averaged momentum every replica applies, with the frozen v's ``denominator``
    (``update_rules.onebit_denominator``): ``param += -lr * (clip(m / den) + wd * param)``,
    coordinates with ``v == 0`` left as they are (``update_rules.onebit_adam_apply_den``).
    m is the code's decode: it lives in one chunk of scratch, and the shard keeps the code
    (``ps.onebit.OneBitState``), not a key-long m written every step. Was: multiply, encode,
    ``m.fill(0)``, decode_add, apply."""
    n = acc.shape[0]
    lanes = np.zeros(LANES, np.float64)
    mom = np.empty(min(n, chunk), np.float32)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        _sync_chunk(acc[lo:lo + m], grad_scale, residual[lo:lo + m],
                    bits[lo >> 3:(lo + m + 7) >> 3], scales, c, lanes, mean_abs, mom[:m],
                    denominator[lo:lo + m], param[lo:lo + m], weight_decay, neg_lr,
                    ratio_clip)


@_jit
def onebit_sync_publish_code(code_scales, code_bits, code_chunk, grad_scale, residual, scales,
                             bits, denominator, param, chunk, mean_abs, weight_decay, neg_lr,
                             ratio_clip):
    """:func:`onebit_sync_publish` of a step whose pushes came as sign1 codes, each code's
    scales and sign bits in the tuples ``code_scales`` and ``code_bits`` (rank order, one
    chunk ``code_chunk``; one array type per tuple): each block of the sum is decoded into L1
    scratch as in :func:`onebit_direction_publish_code`, the first code's values, then each
    next one's added in order: bit for bit the sum the shard's store made decoding the first
    and adding the others (``sign1.decode``, ``sign1.add_decoded``) into a key-long array,
    without writing and reading that array."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    per = max(1, _DECODE_BLOCK // chunk)  # publish chunks decoded at a time
    g = np.empty(min(n, per * chunk), np.float32)
    mom = np.empty(min(n, chunk), np.float32)
    for first in range(0, scales.shape[0], per):
        lo = first * chunk
        span = min(n, lo + per * chunk) - lo
        decode_span(code_scales[0], code_bits[0], code_chunk, lo, g[:span])
        for k in range(1, len(code_scales)):
            add_span(code_scales[k], code_bits[k], code_chunk, lo, g[:span])
        for c in range(first, min(first + per, scales.shape[0])):
            a = c * chunk
            m = min(n, a + chunk) - a
            _sync_chunk(g[a - lo:a - lo + m], grad_scale, residual[a:a + m],
                        bits[a >> 3:(a + m + 7) >> 3], scales, c, lanes, mean_abs, mom[:m],
                        denominator[a:a + m], param[a:a + m], weight_decay, neg_lr,
                        ratio_clip)


@_jit
def _sync_chunk(g, grad_scale, u, bits, scales, c, lanes, mean_abs, mom, dens, p, weight_decay,
                neg_lr, ratio_clip):
    """One chunk of :func:`onebit_sync_publish`: ``u`` the chunk's residual, ``g`` its sum of
    momenta; chunk ``c``'s scale and ``bits`` its sign bytes; ``mom`` scratch for m."""
    m = u.shape[0]
    for j in range(m):
        t = g[j] * grad_scale
        u[j] = t * np.float32(1.0) + u[j]
    s = chunk_scale(u, lanes, mean_abs)
    pack_signs(u, bits)
    neg_s = -s
    # one array written per loop: loops that write two arrays do not vectorize here
    for j in range(m):
        mom[j] = np.float32(0.0) + (neg_s if u[j] < 0 else s)
    for j in range(m):
        x = u[j]
        u[j] = x - (neg_s if x < 0 else s)
    onebit_adam_apply_den(p, mom, dens, weight_decay, neg_lr, ratio_clip)
    scales[c] = s


@_jit
def onebit_direction_publish(param, direction, grad_scale, residual, scales, bits, chunk,
                             mean_abs, weight_decay, neg_lr, ratio_clip):
    """async/ssp 1-bit Adam with the moments on the workers (``OneBitAdamWorkerMoments``):
    the update ``delta = -lr * (clip(direction * grad_scale) + wd * param)``
    (``update_rules.onebit_direction_delta``), encoded with the residual, its decode added to
    ``param``. Was: delta into a scratch array, encode, decode_add."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        p = param[lo:lo + m]
        u = residual[lo:lo + m]
        _direction_delta(direction[lo:lo + m], p, u, grad_scale, weight_decay, neg_lr,
                         ratio_clip)
        _encode_apply(u, p, bits[lo >> 3:(lo + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def onebit_direction_publish_code(param, code_scales, code_bits, code_chunk, grad_scale,
                                  residual, scales, bits, chunk, mean_abs, weight_decay, neg_lr,
                                  ratio_clip):
    """:func:`onebit_direction_publish` of a direction pushed as a sign1 code (its scales and
    sign bits, ``sign1.split``, in chunks of ``code_chunk``), decoded block by block into L1
    scratch: the bits of decoding it into a key-long array first (``sign1.decode``), without
    writing and reading that array."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    per = max(1, _DECODE_BLOCK // chunk)
    g = np.empty(min(n, per * chunk), np.float32)
    for first in range(0, scales.shape[0], per):
        lo = first * chunk
        decode_span(code_scales, code_bits, code_chunk, lo, g[:min(n, lo + per * chunk) - lo])
        for c in range(first, min(first + per, scales.shape[0])):
            a = c * chunk
            m = min(n, a + chunk) - a
            p = param[a:a + m]
            u = residual[a:a + m]
            _direction_delta(g[a - lo:a - lo + m], p, u, grad_scale, weight_decay, neg_lr,
                             ratio_clip)
            _encode_apply(u, p, bits[a >> 3:(a + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def onebit_moments_publish(param, grad, exp_avg, denominator, grad_scale, residual, scales,
                           bits, chunk, mean_abs, one_minus_beta1, weight_decay, neg_lr,
                           ratio_clip):
    """async/ssp 1-bit Adam with the moments on the shard (``OneBitAdamShardMoments``):
    ``m = lerp(m, grad * grad_scale, 1 - beta1)`` and the update ``-lr * (clip(m / den) + wd *
    param)`` with the frozen v's ``denominator`` (``update_rules.onebit_denominator``; as
    ``update_rules.onebit_adam_delta``: m and the update 0 where v, so den, is 0), encoded with
    the residual, its decode added to ``param``. Was: delta into a scratch array, encode,
    decode_add."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        p = param[lo:lo + m]
        u = residual[lo:lo + m]
        _moments_delta(grad[lo:lo + m], exp_avg[lo:lo + m], denominator[lo:lo + m], p, u,
                       grad_scale, one_minus_beta1, weight_decay, neg_lr, ratio_clip)
        _encode_apply(u, p, bits[lo >> 3:(lo + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def onebit_moments_publish_code(param, code_scales, code_bits, code_chunk, exp_avg,
                                denominator, grad_scale, residual, scales, bits, chunk,
                                mean_abs, one_minus_beta1, weight_decay, neg_lr, ratio_clip):
    """:func:`onebit_moments_publish` of a gradient pushed as a sign1 code, decoded block by
    block as in :func:`onebit_direction_publish_code`."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    per = max(1, _DECODE_BLOCK // chunk)
    g = np.empty(min(n, per * chunk), np.float32)
    for first in range(0, scales.shape[0], per):
        lo = first * chunk
        decode_span(code_scales, code_bits, code_chunk, lo, g[:min(n, lo + per * chunk) - lo])
        for c in range(first, min(first + per, scales.shape[0])):
            a = c * chunk
            m = min(n, a + chunk) - a
            p = param[a:a + m]
            u = residual[a:a + m]
            _moments_delta(g[a - lo:a - lo + m], exp_avg[a:a + m], denominator[a:a + m], p,
                           u, grad_scale, one_minus_beta1, weight_decay, neg_lr, ratio_clip)
            _encode_apply(u, p, bits[a >> 3:(a + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def _direction_delta(g, p, u, grad_scale, weight_decay, neg_lr, ratio_clip):
    """``u += -lr * (clip(g * grad_scale) + wd * p)`` over one chunk."""
    for j in range(u.shape[0]):
        d = min(max(g[j] * grad_scale, -ratio_clip), ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, p[j], d)
        u[j] = (neg_lr * d) * np.float32(1.0) + u[j]


@_jit
def _moments_delta(g, mom, dens, p, u, grad_scale, one_minus_beta1, weight_decay, neg_lr,
                   ratio_clip):
    """m and the update of one chunk (:func:`onebit_moments_publish`), the update added to
    ``u``."""
    m = u.shape[0]
    # selects, not branches, mask den == 0, and each loop writes one array: both keep the
    # loops vectorized
    for j in range(m):
        mj = mom[j]
        mj = fma(one_minus_beta1, g[j] * grad_scale - mj, mj)
        mom[j] = np.float32(0.0) if dens[j] == 0 else mj
    for j in range(m):
        den = dens[j]
        d = min(max(mom[j] / den, -ratio_clip), ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, p[j], d)
        delta = np.float32(0.0) if den == 0 else neg_lr * d
        u[j] = delta * np.float32(1.0) + u[j]


@_jit
def sign1_publish_delta(new, param, residual, scales, bits, chunk, mean_abs):
    """Any rule's update published as sign1 (``ps.rules.publish_update``): ``new`` holds the
    parameters the rule gives (read only); encode ``u = (new - param) + residual``, keep the
    new residual, add the code's decode to ``param``. Was: subtract into ``new``, encode,
    decode_add."""
    n = param.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        x = new[lo:lo + m]
        p = param[lo:lo + m]
        u = residual[lo:lo + m]
        for j in range(m):
            u[j] = (x[j] - p[j]) * np.float32(1.0) + u[j]
        _encode_apply(u, p, bits[lo >> 3:(lo + m + 7) >> 3], scales, c, lanes, mean_abs)


@_jit
def _encode_apply(u, p, bits, scales, c, lanes, mean_abs):
    """The rest of one chunk's publish: its scale, signs and new residual ``u``, and the
    decode added to ``p`` (``sign1`` encode, then decode_add, on one chunk)."""
    s = chunk_scale(u, lanes, mean_abs)
    pack_signs(u, bits)
    neg_s = -s
    # one array written per loop: a loop that writes both does not vectorize (2.6 against
    # 1.7 ms per MiB-element key here)
    for j in range(u.shape[0]):
        p[j] = p[j] + (neg_s if u[j] < 0 else s)
    for j in range(u.shape[0]):
        x = u[j]
        u[j] = x - (neg_s if x < 0 else s)
    scales[c] = s
