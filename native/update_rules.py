"""Server-side optimizer kernels: numba loops over flat float32 numpy arrays.

Every kernel mirrors the arithmetic of the matching ``torch.optim`` CPU kernel operation by
operation in float32 (an explicit fused multiply-add exactly where torch's vector code uses
``fmadd``), so a one-worker ``sync`` run ends bit-identical to local torch training: SGD and
momentum against the default implementation, Adam/AdamW against ``fused=True`` (the default
single-tensor Adam takes sqrt from MKL, which is not correctly rounded). Scalars arrive as
``np.float32`` so that numba does not promote the loops to float64.

Buffer ownership: the caller owns every array; kernels never allocate. ``grad`` is read only and
may be a read-only view of a received ZeroMQ frame. Parameters and optimizer state are updated in
place; ``param`` must not overlap ``grad`` or the state (a shard whose parameters are still being
sent copies them to a spare buffer first and updates that: ``ps.store``).

Speed: the loops vectorize (AVX/AVX-512 lanes of ``sqrt``, ``fma``, ``/``) because (a) numba
runs with ``error_model="numpy"``: IEEE results for division by zero instead of a
``ZeroDivisionError`` branch per element, which blocked vectorization and made Adam 7x slower; and
(b) each kernel writes the array it reads, so LLVM's runtime overlap checks pass (a kernel taking
a separate ``dst`` that happened to equal ``param`` fell back to scalar code, 3x slower).
Vector ``sqrt``/``/``/``fma`` round exactly like their scalar forms, so results do not change.

The gradient a kernel applies is ``grad * grad_scale``: sync aggregation passes the sum of the
pushes and ``1/n``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import intrinsic

__all__ = ["accumulate", "adam_direction", "adam_direction_correct", "adam_step", "add_into",
           "add_scaled", "all_finite", "delayed_nesterov_step", "extrapolate", "fma", "look_ahead",
           "momentum_step", "onebit_adam_apply", "onebit_adam_apply_den", "onebit_adam_delta",
           "onebit_denominator", "onebit_direction_delta",
           "sgd_step", "sum_squares"]

_LANES = 64  # 16 or 32 float64 lanes do not vectorize here: 60 us per MiB against 14.5

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@intrinsic
def _llvm_fma(typingctx, a, b, c):
    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


if numba.config.DISABLE_JIT:
    def fma(a, b, c):
        """Pure-Python twin for ``NUMBA_DISABLE_JIT=1``: float32 products are exact in float64,
        so this rounds once except in rare double-rounding ties of the final sum."""
        return np.float32(float(a) * float(b) + float(c))
else:
    fma = _llvm_fma
    """``a * b + c`` rounded once (``llvm.fma``), used exactly where torch's vector kernels use
    ``fmadd`` (``add`` with ``alpha``, ``lerp``, ``addcmul``); plain ``*``/``+`` everywhere else, so
    rounding matches torch op for op."""


@_jit
def sgd_step(param, grad, grad_scale, lr, weight_decay):
    """``param -= lr * (grad * grad_scale + weight_decay * param)`` (torch SGD, momentum 0)."""
    neg_lr = -lr
    for i in range(param.shape[0]):
        g = grad[i] * grad_scale
        p = param[i]
        if weight_decay != 0:
            g = fma(p, weight_decay, g)
        p = fma(g, neg_lr, p)
        param[i] = p


@_jit
def momentum_step(param, grad, buf, grad_scale, lr, momentum, keep, weight_decay,
                  nesterov, first):
    """torch.optim.SGD with momentum: ``buf = momentum*buf + keep*g`` with ``keep = 1 - dampening``
    (``buf = g`` on the first step), ``param -= lr * (g + momentum*buf if nesterov else buf)``."""
    neg_lr = -lr
    for i in range(param.shape[0]):
        g = grad[i] * grad_scale
        p = param[i]
        if weight_decay != 0:
            g = fma(p, weight_decay, g)
        if first:
            b = g
        else:
            b = fma(g, keep, buf[i] * momentum)
        buf[i] = b
        d = fma(b, momentum, g) if nesterov else b
        p = fma(d, neg_lr, p)
        param[i] = p


@_jit
def delayed_nesterov_step(param, grad, buf, pending, grad_scale, lr, momentum, inv_n,
                          boosted_momentum, due):
    """Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
    Modeling"), one arrival of the pseudo-gradient ``g = grad * grad_scale``: a plain step
    ``param -= lr * g``; ``pending`` (float32, same length, owned by the key) sums the arrivals
    since the momentum was last updated. On the N-th arrival (``due``): ``buf = momentum * buf +
    (pending + g) * inv_n`` (the mean of the N arrivals; ``inv_n = 1/N``), ``pending = 0``, and
    the step also carries the momentum: ``param -= lr * (g + boosted_momentum * buf)`` with
    ``boosted_momentum = N * momentum`` (with lr split over N workers, that term is taken at
    the whole learning rate, as one Nesterov step on the mean would). All in place."""
    neg_lr = -lr
    for i in range(param.shape[0]):
        g = grad[i] * grad_scale
        if due:
            b = fma(pending[i] + g, inv_n, buf[i] * momentum)
            buf[i] = b
            pending[i] = 0.0
            d = fma(b, boosted_momentum, g)
        else:
            pending[i] = pending[i] + g
            d = g
        param[i] = fma(d, neg_lr, param[i])


@_jit
def adam_step(param, grad, exp_avg, exp_avg_sq, grad_scale, one_minus_beta1, beta2,
              one_minus_beta2, eps, weight_decay, decoupled, decay, neg_step_size,
              bias_correction2_sqrt):
    """torch.optim.Adam / AdamW (amsgrad off). ``neg_step_size = -lr / (1 - beta1**t)`` and
    ``bias_correction2_sqrt = (1 - beta2**t) ** 0.5``, the AdamW factor ``decay = 1 - lr*wd`` and
    ``one_minus_beta1/2`` are computed by the caller in float64 as torch does, then passed as
    float32 (``1 - float32(0.999)`` is off by 1.3e-5 relative)."""
    for i in range(param.shape[0]):
        g = grad[i] * grad_scale
        p = param[i]
        if weight_decay != 0:
            if decoupled:
                p = p * decay
            else:
                g = fma(p, weight_decay, g)
        m = exp_avg[i]
        m = fma(one_minus_beta1, g - m, m)
        v = fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        denom = np.sqrt(v) / bias_correction2_sqrt + eps
        p = p + neg_step_size * m / denom
        param[i] = p


@_jit
def onebit_adam_delta(param, grad, exp_avg, exp_avg_sq, delta, grad_scale, one_minus_beta1,
                      eps, weight_decay, neg_lr, bias_correction2_sqrt, ratio_clip):
    """1-bit Adam's compression stage: ``m = lerp(m, g, 1 - beta1)`` with the frozen ``v``,
    ``delta = -lr * (m / (sqrt(v) / bias_correction2_sqrt + eps) + weight_decay * param)``
    (decoupled decay, as DeepSpeed adds it to the update). Writes ``delta`` (its own array);
    ``param`` and ``exp_avg_sq`` are only read.

    Coordinates whose frozen ``v`` is exactly 0 (no gradient at all during warmup: embedding and
    output rows of tokens never seen, say) are masked: ``m`` stays 0 and ``delta`` is 0. Without
    the mask the compression noise a 1-bit code puts on them is divided by ``sqrt(v) + eps ~
    eps`` and blows up; DeepSpeed asks users for this mask (``exp_avg_mask``), the frozen ``v``
    already knows it.

    ``|m / (sqrt(v)/bc2 + eps)|`` is clipped to ``ratio_clip``, the most Adam itself can reach
    (``(1-beta1) / (sqrt(1-beta2) * (1 - beta1/sqrt(beta2)))``): a coordinate that was rare
    during warmup (a rarely routed expert, a rare token's embedding) has a tiny frozen v, and
    its first real gradients after the freeze would otherwise step it hundreds of learning rates
    at once; Adam's moving v would have grown instead."""
    for i in range(param.shape[0]):
        if exp_avg_sq[i] == 0:
            exp_avg[i] = 0
            delta[i] = 0
            continue
        g = grad[i] * grad_scale
        m = exp_avg[i]
        m = fma(one_minus_beta1, g - m, m)
        exp_avg[i] = m
        d = min(max(m / (np.sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps), -ratio_clip),
                ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, param[i], d)
        delta[i] = neg_lr * d


@_jit
def adam_direction(grad, exp_avg, exp_avg_sq, out, one_minus_beta1, beta2, one_minus_beta2,
                   eps, inv_bias_correction1, bias_correction2_sqrt, grad_scale):
    """A worker's Adam step without the learning rate (1-bit Adam with worker moments): with
    ``g = grad * grad_scale`` (the clip factor; 1 leaves ``grad`` as it is), update
    ``m = lerp(m, g, 1 - beta1)`` and ``v = beta2 * v + (1 - beta2) * g * g`` in place (the
    arithmetic of :func:`adam_step`) and write the direction
    ``out = m * inv_bias_correction1 / (sqrt(v) / bias_correction2_sqrt + eps)`` (its own
    array). Adam's update is ``-lr * out``; the shard applies it (:func:`onebit_direction_delta`)
    from the sign1 code of ``out`` the worker pushes."""
    for i in range(grad.shape[0]):
        g = grad[i] * grad_scale
        m = exp_avg[i]
        m = fma(one_minus_beta1, g - m, m)
        v = fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        out[i] = m * inv_bias_correction1 / (np.sqrt(v) / bias_correction2_sqrt + eps)


@_jit
def adam_direction_correct(grad, exp_avg, exp_avg_sq, residual, alpha_m, alpha_v, alpha_g,
                           eps, inv_bias_correction1, bias_correction2_sqrt, directions):
    """Clipping under overlap (``worker.training.clip``): :func:`adam_direction` ran with a
    predicted clip factor ``p`` and the step's exact factor ``s`` is known now. Correct the moments
    to what ``s`` gives, ``m += alpha_m * g`` (``alpha_m = (1 - beta1) * (s - p)``) and ``v +=
    alpha_v * g * g`` (``alpha_v = (1 - beta2) * (s*s - p*p)``, kept >= 0), and fold what the push
    missed into its error-feedback ``residual``: the direction's change when ``directions`` (it was
    pushed), else ``alpha_g * g`` (``alpha_g = s - p``: the gradient was pushed, warmup)."""
    for i in range(grad.shape[0]):
        g = grad[i]
        m = exp_avg[i]
        v = exp_avg_sq[i]
        m2 = m + alpha_m * g
        v2 = max(v + alpha_v * g * g, np.float32(0))
        exp_avg[i] = m2
        exp_avg_sq[i] = v2
        if directions:
            old = m * inv_bias_correction1 / (np.sqrt(v) / bias_correction2_sqrt + eps)
            new = m2 * inv_bias_correction1 / (np.sqrt(v2) / bias_correction2_sqrt + eps)
            residual[i] = residual[i] + (new - old)
        else:
            residual[i] = residual[i] + g * alpha_g


@_jit
def onebit_direction_delta(param, direction, delta, grad_scale, weight_decay, neg_lr,
                           ratio_clip):
    """1-bit Adam with worker moments, on the shard: ``delta = -lr * (clip(direction *
    grad_scale) + weight_decay * param)`` (decoupled decay), ``direction`` being a worker's
    decoded Adam direction (:func:`adam_direction`), clipped to ``ratio_clip`` as
    :func:`onebit_adam_delta` clips its ratio. Writes ``delta`` (its own array)."""
    for i in range(param.shape[0]):
        d = min(max(direction[i] * grad_scale, -ratio_clip), ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, param[i], d)
        delta[i] = neg_lr * d


@_jit
def onebit_adam_apply(param, exp_avg, exp_avg_sq, eps, weight_decay, neg_lr,
                      bias_correction2_sqrt, ratio_clip):
    """sync 1-bit Adam's apply once ``exp_avg`` holds the published momentum: ``param += -lr *
    (m / (sqrt(v)/bc2 + eps) + weight_decay * param)``, with the mask and the ratio clip of
    :func:`onebit_adam_delta`. The reference: the shard and the workers run
    :func:`onebit_adam_apply_den` on the denominators made once, which gives these bits
    (``tests/test_publish_kernels.py``)."""
    # v == 0 selects a step of -0.0, not the old parameter: see onebit_adam_apply_den
    for i in range(param.shape[0]):
        v = exp_avg_sq[i]
        p = param[i]
        d = min(max(exp_avg[i] / (np.sqrt(v) / bias_correction2_sqrt + eps), -ratio_clip),
                ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, p, d)
        step = np.float32(-0.0) if v == 0 else neg_lr * d
        param[i] = p + step


@_jit
def onebit_denominator(exp_avg_sq, bias_correction2_sqrt, eps, out):
    """1-bit Adam's frozen denominators: ``out = sqrt(v)/bc2 + eps``, and 0 where ``v == 0``
    (those coordinates are left as they are: :func:`onebit_adam_apply_den`'s mask). v and bc2
    are frozen after the switch, so the square root is taken once, not every step (it cost
    more than the rest of the apply: 6.1 against 1.9 ms per 16 M elements in L1 here); the
    same float32 operations as :func:`onebit_adam_apply`'s, so the same bits."""
    for i in range(out.shape[0]):
        v = exp_avg_sq[i]
        den = np.sqrt(v) / bias_correction2_sqrt + eps
        out[i] = np.float32(0.0) if v == 0 else den


@_jit
def onebit_adam_apply_den(param, exp_avg, denominator, weight_decay, neg_lr, ratio_clip):
    """:func:`onebit_adam_apply` with the frozen denominators of :func:`onebit_denominator`:
    ``param += -lr * (clip(m / den) + weight_decay * param)``, coordinates with ``den == 0``
    (``v == 0``) left as they are; bit for bit the same."""
    # The mask selects the step, -0.0 where den == 0, and adds it: ``p + -0.0`` is ``p`` for
    # every float32 p (+0.0, -0.0, NaN and Inf included), so the bits are those of selecting
    # ``p`` itself, but LLVM keeps that select as a branch around the division and the loop
    # does not vectorize (9.9 against 3.6 ms per 16 M elements in L1 on this machine's EPYC).
    for i in range(param.shape[0]):
        den = denominator[i]
        p = param[i]
        d = min(max(exp_avg[i] / den, -ratio_clip), ratio_clip)
        if weight_decay != 0:
            d = fma(weight_decay, p, d)
        step = np.float32(-0.0) if den == 0 else neg_lr * d
        param[i] = p + step


@_jit
def all_finite(x):
    """True when no element of the float32 array ``x`` is NaN or +-Inf: a float is not finite
    exactly when its bits without the sign are >= ``0x7F800000`` (exponent all ones), so one
    unsigned max over the bits decides. Every value is cast back to ``uint32`` and the max is a
    compare-and-select: numba otherwise widens ``uint32 & uint32`` to 64 bits, which AVX2 has
    no unsigned max for, and the loop ran 3x slower (51 vs 16 us per MiB on this machine's
    EPYC; ``np.isfinite(x).all()`` takes 28-37 us and allocates a bool array)."""
    bits = x.view(np.uint32)
    mask = np.uint32(0x7FFFFFFF)
    top = np.uint32(0)
    for i in range(bits.shape[0]):
        b = np.uint32(bits[i] & mask)
        top = b if b > top else top
    return top < np.uint32(0x7F800000)


@_jit
def sum_squares(x):
    """The sum of the squares of the float32 array ``x`` in float64: NaN or +-Inf exactly when
    an element is (no finite float32 square can overflow a float64 sum), so one read gives a
    clip norm's share and the finiteness check. Summed in 64 lanes (lane ``l`` takes elements
    ``l, l+64, ...`` in order), then the lanes in order: a fixed order that vectorizes."""
    lanes = np.zeros(_LANES, np.float64)
    n = x.shape[0]
    full = n - n % _LANES
    for base in range(0, full, _LANES):
        chunk = x[base:base + _LANES]
        for lane in range(_LANES):
            v = np.float64(chunk[lane])
            lanes[lane] += v * v
    for lane in range(n - full):
        v = np.float64(x[full + lane])
        lanes[lane] += v * v
    total = 0.0
    for lane in range(_LANES):
        total += lanes[lane]
    return total


@_jit
def add_scaled(acc, x, alpha):
    """``acc += x * alpha`` (float32, two roundings): what clipping under overlap adds to an
    error-feedback residual once the step's exact clip factor is known
    (``worker.training.clip``)."""
    for i in range(acc.shape[0]):
        acc[i] = acc[i] + x[i] * alpha


@_jit
def add_into(out, a, b):
    """``out = a + b`` (float32): a sync step's first two pushes summed in one pass
    (``ps.store``). ``out`` must not overlap ``a`` or ``b``."""
    for i in range(out.shape[0]):
        out[i] = a[i] + b[i]


@_jit
def accumulate(acc, grad, first):
    """``acc = grad`` when ``first`` else ``acc += grad`` (sync aggregation of pushes)."""
    if first:
        for i in range(acc.shape[0]):
            acc[i] = grad[i]
    else:
        for i in range(acc.shape[0]):
            acc[i] = acc[i] + grad[i]


@_jit
def look_ahead(x, previous, out, steps):
    """``out = x + (x - previous) * steps`` (float32, three roundings, as adding ``steps``
    times the stored difference ``x - previous`` would): a lookahead pull's parameters from
    the key and its parameters before the last update. ``out`` must not overlap the others."""
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = v + (v - previous[i]) * steps


@_jit
def extrapolate(exact, previous, shown, steps):
    """``shown = exact + steps * (exact - previous)``, then ``previous = exact`` (float32, one
    pass, three roundings): weight prediction's copy of the parameters moved on by ``steps``
    more updates like those since ``previous`` (``worker.training.prediction``); ``steps`` is
    the lookahead divided by the updates between the two copies. ``shown`` must not overlap
    the others."""
    for i in range(exact.shape[0]):
        x = exact[i]
        shown[i] = x + steps * (x - previous[i])
        previous[i] = x
