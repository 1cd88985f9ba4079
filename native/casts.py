"""The ``bf16`` and ``fp16`` codecs: float32 values rounded to 16 bits, nearest-even, with optional
error feedback.

Payload of a key of ``n`` elements: ``n`` little-endian 16-bit values, ``2n`` bytes.

- bf16 keeps float32's exponent and the top 7 mantissa bits. Rounding on the float32 bits ``b``:
  ``q = (b + 0x7FFF + ((b >> 16) & 1)) >> 16`` (ties to even; overflow rounds to +-Inf as IEEE
  does); a NaN stays a quiet NaN of the same sign (the formula alone could carry it into the
  sign bit). Decoding is exact: ``bits = q << 16``.
- fp16 is IEEE binary16, nearest-even, as numpy's cast rounds (``npy_floatbits_to_halfbits``;
  out-of-range values become +-Inf, which the receiver rejects as non-finite). numba has no
  float16 on the CPU: the kernels convert with LLVM's ``fptrunc``/``fpext`` to half (the CPU's
  own instructions: F16C on x86, 4-5x faster than the bit arithmetic), checked once against
  the bit arithmetic (``_fp16_bits``) and numpy's float16, which they fall back to where the
  conversion does not compile or differs. The two agree bit for bit on every finite and
  infinite value; on a NaN both give a NaN, its payload bits may differ (the hardware quiets a
  signalling NaN); a non-finite push is refused before it is decoded.

With error feedback (``residual`` updated in place): ``u = grad * scale + residual`` (``scale``
is the clip factor, 1 by default), the payload encodes ``u``, and ``residual = u -
decode(payload)``. :func:`raw_encode` is the same wrapper around raw float32 values: nothing is
lost, so the residual only carries what clipping under overlap folds into it afterwards.

Buffer ownership: the caller owns every array; nothing here allocates. ``grad`` and payloads
may be read-only views of received frames. The error-feedback encoders cross each array's memory
once (one pass; the fp16 fallback in blocks of ``_BLOCK`` elements).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

__all__ = ["bf16_decode_add", "bf16_encode", "bf16_reference", "fp16_decode_add",
           "fp16_encode", "raw_encode"]

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


def _check(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray) -> None:
    n = grad.shape[0]
    if grad.dtype != np.float32 or (residual is not None and (residual.dtype != np.float32
                                                              or residual.shape != grad.shape)):
        raise ValueError(f"grad {grad.dtype}{grad.shape} and residual must be float32 of one "
                         f"length")
    if out.dtype != np.uint16 or out.shape[0] < n:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected uint16 of >= {n}")


def bf16_encode(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray, *,
                scale: float = 1.0) -> int:
    """Round ``grad * scale (+ residual)`` to bf16 into ``out`` (uint16); with a
    ``residual``, store the rounding error there. Returns the payload size in bytes (``2n``)."""
    _check(grad, residual, out)
    n = grad.shape[0]
    if residual is None:
        if scale != 1.0:
            raise ValueError(f"scale {scale} needs a residual (error feedback)")
        _bf16_cast(grad, out[:n])
    else:
        _bf16_encode_ef(grad, residual, out[:n], np.float32(scale))
    return 2 * n


def bf16_decode_add(payload, n: int, acc: np.ndarray) -> None:
    """``acc[:n] += decode(payload)`` for a payload of exactly ``2n`` bytes."""
    _bf16_decode_add(np.frombuffer(payload, np.uint16, count=n), acc[:n])


if numba.config.DISABLE_JIT:
    def _f32(bits):
        """Pure-Python twin for ``NUMBA_DISABLE_JIT=1``."""
        return np.array(int(bits) & 0xFFFFFFFF, np.uint32).view(np.float32)[()]

    def _u32(x):
        return np.array(x, np.float32).view(np.uint32)[()]
else:
    @intrinsic
    def _u32(typingctx, x):
        """The bits of the float32 ``x`` (a register bitcast)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return numba.types.uint32(numba.types.float32), codegen

    @intrinsic
    def _f32(typingctx, bits):
        """The float32 whose bit pattern is the low 32 bits of the integer ``bits`` (a register
        bitcast; numba widens shifted uint32 values to 64 bits)."""
        def codegen(context, builder, signature, args):
            value = args[0]
            if value.type.width != 32:
                value = builder.trunc(value, ir.IntType(32))
            return builder.bitcast(value, ir.FloatType())

        return numba.types.float32(bits), codegen


@_jit
def _bf16_bits(b):
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


@_jit
def _bf16_cast(x, out):
    bits = x.view(np.uint32)
    for j in range(x.shape[0]):
        out[j] = _bf16_bits(bits[j])


_BLOCK = 2048
"""Elements per block of the fp16 fallback's error-feedback encoder: 8 KiB of each array, so
the passes over a block after the first read it from L1 and each array crosses memory once."""


@_jit
def _bf16_encode_ef(grad, residual, out, gscale):
    # one pass, u kept in a register and read as bits by a bitcast: 5.7 ms per 64 MiB against
    # 7.9 for three passes over 2048-element blocks through a uint32 view of the residual
    for j in range(grad.shape[0]):
        u = grad[j] * gscale + residual[j]
        q = _bf16_bits(_u32(u))
        out[j] = q
        residual[j] = u - _f32(np.uint32(q) << np.uint32(16))


@_jit
def _bf16_decode_add(q, acc):
    for j in range(q.shape[0]):
        acc[j] = acc[j] + _f32(np.uint32(q[j]) << np.uint32(16))


def fp16_encode(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray, *,
                scale: float = 1.0) -> int:
    """Round ``grad * scale (+ residual)`` to IEEE half into ``out`` (uint16); with a
    ``residual``, store the rounding error there. Returns ``2n``."""
    _check(grad, residual, out)
    n = grad.shape[0]
    hw = _hardware_halves()
    if residual is None:
        if scale != 1.0:
            raise ValueError(f"scale {scale} needs a residual (error feedback)")
        (_fp16_cast_hw if hw else _fp16_cast)(grad, out[:n])
    else:
        (_fp16_encode_ef_hw if hw else _fp16_encode_ef)(grad, residual, out[:n],
                                                        np.float32(scale))
    return 2 * n


@_jit
def _fp16_bits(f):
    """IEEE binary16 bits of the float32 with bits ``f``, nearest-even: numpy's
    ``npy_floatbits_to_halfbits`` (out of range: +-Inf; a NaN stays a NaN). Every case is
    computed and one selected."""
    u32 = np.uint32
    sgn = (f >> u32(16)) & u32(0x8000)
    fe = f & u32(0x7F800000)
    sig = f & u32(0x007FFFFF)
    # normal halves: a carry out of the significand moves into the exponent, up to +-Inf
    up = sig + (u32(0x1000) if (sig & u32(0x3FFF)) != u32(0x1000) else u32(0))
    normal = ((fe - u32(0x38000000)) >> u32(13)) + (up >> u32(13))
    # subnormal halves: the significand with its implicit bit, shifted by 1 to 11 (clamped so
    # that the shift stays defined where this case is not selected)
    shift = min(max(u32(113) - min(fe >> u32(23), u32(113)), u32(1)), u32(24))
    sub = (u32(0x00800000) + sig) >> shift
    sub = sub + (u32(0x1000) if (sub & u32(0x3FFF)) != u32(0x1000)
                 or (f & u32(0x7FF)) != 0 else u32(0))
    sub = sub >> u32(13)
    nan = u32(0x7C00) + (sig >> u32(13))
    nan = nan + (u32(1) if nan == u32(0x7C00) else u32(0))
    big = nan if fe == u32(0x7F800000) and sig != 0 else u32(0x7C00)
    mag = big if fe >= u32(0x47800000) else (
        normal if fe > u32(0x38000000) else (sub if fe >= u32(0x33000000) else u32(0)))
    return np.uint16(sgn + mag)


@_jit
def _fp16_value(h):
    """The float32 of the binary16 bits ``h`` (exact); every case computed, one selected."""
    u32 = np.uint32
    h = u32(h)
    sgn = (h & u32(0x8000)) << u32(16)
    e = h & u32(0x7C00)
    sig = h & u32(0x03FF)
    normal = _f32(sgn | (((h & u32(0x7FFF)) + u32(0x1C000)) << u32(13)))
    special = _f32(sgn | u32(0x7F800000) | (sig << u32(13)))
    sub = np.float32(sig) * np.float32(2.0 ** -24)  # subnormal or zero: exact in float32
    sub = -sub if sgn else sub
    return special if e == u32(0x7C00) else (sub if e == 0 else normal)


@_jit
def _fp16_cast(x, out):
    bits = x.view(np.uint32)
    for j in range(x.shape[0]):
        out[j] = _fp16_bits(bits[j])


if numba.config.DISABLE_JIT:
    def _to_half(x):
        """Pure-Python twin for ``NUMBA_DISABLE_JIT=1``."""
        return np.array(x, np.float32).astype(np.float16).view(np.uint16)[()]

    def _from_half(h):
        return np.array(h, np.uint16).view(np.float16).astype(np.float32)[()]
else:
    @intrinsic
    def _to_half(typingctx, x):
        """The IEEE binary16 bits of the float32 ``x``: LLVM's ``fptrunc`` to half, which the
        CPU does in hardware where it can (x86 F16C ``vcvtps2ph``, arm64 ``fcvt``), vectorized,
        in the default rounding mode (nearest-even)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return numba.types.uint16(numba.types.float32), codegen

    @intrinsic
    def _from_half(typingctx, h):
        """The float32 of the binary16 bits ``h`` (``fpext``: exact)."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return numba.types.float32(numba.types.uint16), codegen


@_jit
def _fp16_cast_hw(x, out):
    for j in range(x.shape[0]):
        out[j] = _to_half(x[j])


@_jit
def _fp16_encode_ef_hw(grad, residual, out, gscale):
    # one pass: the conversions are single instructions both ways, so the loop vectorizes
    for j in range(grad.shape[0]):
        u = grad[j] * gscale + residual[j]
        q = _to_half(u)
        out[j] = q
        residual[j] = u - _from_half(q)


@_jit
def _fp16_decode_add_hw(q, acc):
    for j in range(q.shape[0]):
        acc[j] = acc[j] + _from_half(q[j])


@functools.cache
def _hardware_halves() -> bool:
    """Whether the hardware conversions (``_to_half``, ``_from_half``) compile here and agree
    with the bit arithmetic (``_fp16_bits``, numpy's float16) on every region of finite and
    infinite values: where LLVM has no instruction for them it calls a runtime helper that
    numba may not link. Checked once, at the first fp16 encode or decode; ``False`` keeps the
    bit-arithmetic kernels (4-5x slower on 64 MiB)."""
    x = np.concatenate([_PROBE, np.arange(1 << 16, dtype=np.uint16).view(np.float16)
                        .astype(np.float32)])
    x = x[np.isfinite(x) | np.isinf(x)]
    want, got = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    try:
        _fp16_cast(x, want)
        _fp16_cast_hw(x, got)
        back = np.zeros(x.size, np.float32)
        _fp16_decode_add_hw(want, back)
    except Exception:  # noqa: BLE001 - numba's lowering or linking errors: no hardware path
        return False
    exact = np.zeros(x.size, np.float32)  # numpy's decode, as fp16_decode_add falls back to
    np.add(exact, want.view(np.float16), out=exact, casting="same_kind")
    return bool(np.array_equal(want, got) and np.array_equal(back.view(np.uint32),
                                                             exact.view(np.uint32)))


_PROBE = np.array([0.0, -0.0, 1.0, 65504.0, 65519.996, 65520.0, -65520.0, 6.1035156e-05,
                   6.097555e-05, 5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 8.940697e-08,
                   1e-45, 3e-38, 1.0009766, 1.0004883, 1.0014648, 3e38, np.inf, -np.inf],
                  np.float32)
"""Rounding edges of float32 -> binary16: overflow, ties, subnormal halves, underflow."""


@_jit
def _fp16_encode_ef(grad, residual, out, gscale):
    # the bit arithmetic's branches do not vectorize in one loop: three passes over blocks
    ubits = residual.view(np.uint32)
    n = grad.shape[0]
    for lo in range(0, n, _BLOCK):
        m = min(n, lo + _BLOCK) - lo
        g, u, ub, q = grad[lo:lo + m], residual[lo:lo + m], ubits[lo:lo + m], out[lo:lo + m]
        for j in range(m):
            u[j] = g[j] * gscale + u[j]
        for j in range(m):
            q[j] = _fp16_bits(ub[j])
        for j in range(m):
            u[j] = u[j] - _fp16_value(q[j])


def fp16_decode_add(payload, n: int, acc: np.ndarray) -> None:
    """``acc[:n] += decode(payload)`` for a payload of exactly ``2n`` bytes."""
    if _hardware_halves():
        _fp16_decode_add_hw(np.frombuffer(payload, np.uint16, count=n), acc[:n])
    else:
        np.add(acc[:n], np.frombuffer(payload, np.float16, count=n), out=acc[:n],
               casting="same_kind")


def bf16_reference(u: np.ndarray) -> np.ndarray:
    """The bf16 bits (uint16) of float32 ``u``, in plain numpy (the spec check)."""
    b = u.astype(np.float32).view(np.uint32).astype(np.uint64)
    q = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    q[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint32)
    return (q & 0xFFFF).astype(np.uint16)


def raw_encode(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, *,
               scale: float = 1.0) -> int:
    """Raw float32 values with error feedback: ``out = grad * scale + residual``, then
    ``residual = 0`` (a raw payload carries everything). Returns ``4n``."""
    n = grad.shape[0]
    if grad.dtype != np.float32 or residual.dtype != np.float32 or residual.shape != grad.shape:
        raise ValueError(f"grad {grad.dtype}{grad.shape} and residual must be float32 of one "
                         f"length")
    if out.dtype != np.float32 or out.shape[0] < n:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected float32 of >= {n}")
    _raw_encode_ef(grad, residual, out[:n], np.float32(scale))
    return 4 * n


@_jit
def _raw_encode_ef(grad, residual, out, gscale):
    for j in range(grad.shape[0]):
        out[j] = grad[j] * gscale + residual[j]
        residual[j] = 0.0
