"""The fused worker kernels (``native.push``) and the blocked half-precision encoders
(``native.casts``) against the unfused sequences they replace, bit for bit: odd sizes, chunk
and block boundaries, empty keys, both scale rules, clip factors, weight decay on and off,
frozen-v zeros, NaN and Inf input; and the fused path through the worker's 1-bit Adam policies
equals the unfused one."""

from __future__ import annotations

import numpy as np
import pytest

from bitps import native
from bitps.native import casts, push, sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import MEAN_ABS, Codec, Compressor
from bitps.proto.onebit_pb2 import OneBitParams
from bitps.worker.algorithms.onebit import OneBitMomentum, WorkerMoments

SIZES = (0, 1, 63, 64, 2047, 2048, 2049, 3 * 2048 + 5)
CHUNKS = (64, 2048)
F = np.float32


def _data(n: int, seed: int, special: bool):
    rng = np.random.default_rng([n, seed])
    g = rng.standard_normal(n).astype(F)
    v = (rng.random(n) * 1e-4).astype(F)
    v[::7] = 0  # frozen-v zeros: masked coordinates
    if special and n > 3:
        g[1], g[2], g[n // 2] = np.nan, np.inf, -np.inf
    return {"g": g, "p": rng.standard_normal(n).astype(F), "m": (g * F(0.1)),
            "v": v, "r": (rng.standard_normal(n) * 1e-3).astype(F)}


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _encode_ref(u_in, residual, chunk, mean_abs):
    out = np.empty(sign1.payload_bytes(u_in.size, chunk), np.uint8)
    size = sign1.encode(u_in, residual, out, chunk=chunk, mean_abs=mean_abs)
    return out[:size]


CASES = [(n, c, mean_abs, scale, special) for n in SIZES for c in CHUNKS
         for mean_abs in (False, True) for scale in (1.0, 0.37) for special in (False, True)]


@pytest.mark.parametrize("n,chunk,mean_abs,scale,special", CASES)
def test_momentum_encode_equals_numpy_momentum_then_encode(n, chunk, mean_abs, scale, special):
    d = _data(n, 0, special)
    omb1 = F(0.1)
    # before: OneBitMomentum.momentum's numpy ops, then sign1.encode (scale 1)
    g = d["g"] * F(scale) if scale != 1.0 else d["g"]
    with np.errstate(invalid="ignore"):
        w = np.add(np.multiply(np.subtract(g, d["m"]), omb1), d["m"])
    r0 = d["r"].copy()
    code0 = _encode_ref(w, r0, chunk, mean_abs)
    # now
    r1, m1 = d["r"].copy(), d["m"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    push.onebit_momentum_encode(d["g"], m1, F(scale), omb1, r1, scales, bits, np.int64(chunk),
                                mean_abs)
    _same(out[:size], code0)
    _same(r1, r0)
    _same(m1, d["m"])  # m is the published momentum's: the push leaves it


@pytest.mark.parametrize("n,chunk,mean_abs,scale,special", CASES)
def test_direction_encode_equals_adam_direction_then_encode(n, chunk, mean_abs, scale, special):
    d = _data(n, 1, special)
    args = (F(0.1), F(0.999), F(0.001), F(1e-8), F(1.3), F(0.2), F(scale))
    m0, v0, r0, out0 = d["m"].copy(), d["v"].copy(), d["r"].copy(), np.empty(n, F)
    native.adam_direction(d["g"], m0, v0, out0, *args)
    code0 = _encode_ref(out0, r0, chunk, mean_abs)
    m1, v1, r1 = d["m"].copy(), d["v"].copy(), d["r"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    push.adam_direction_encode(d["g"], m1, v1, *args, r1, scales, bits, np.int64(chunk),
                               mean_abs)
    _same(out[:size], code0)
    for a, b in ((m1, m0), (v1, v0), (r1, r0)):
        _same(a, b)


@pytest.mark.parametrize("n,chunk,mean_abs,wd,special",
                         [(n, c, ma, wd, sp) for n, c, ma, _, sp in CASES if _ == 1.0
                          for wd in (0.0, 0.01)])
def test_the_code_kept_as_m_gives_the_same_apply_and_next_push(n, chunk, mean_abs, wd, special):
    """sync 1-bit Adam's worker keeps the published code instead of m: the apply that decodes
    it chunk by chunk, the decode, and the push that decodes m from the code give the bits of
    the unfused sequence (m zeroed, the code added, the apply; the push reading m), a
    zero-scale chunk included (it decodes to +0.0)."""
    d = _data(n, 5, special)
    g = d["g"].copy()
    g[:min(n, chunk)] = 0  # a chunk of zeros: scale 0
    code = _encode_ref(g, np.zeros(n, F), chunk, mean_abs).tobytes()
    eps, neg_lr, bc2, clip = F(1e-8), F(-1e-3), F(0.3), F(4.0)
    m0, p0, p1 = np.zeros(n, F), d["p"].copy(), d["p"].copy()
    sign1.decode_add(code, n, m0, chunk=chunk)
    native.onebit_adam_apply(p0, m0, d["v"], eps, F(wd), neg_lr, bc2, clip)
    den = np.empty(n, F)
    native.onebit_denominator(d["v"], bc2, eps, den)
    push.onebit_code_apply(code, den, p1, chunk, F(wd), neg_lr, clip)
    _same(p1, p0)
    m1 = np.full(n, np.nan, F)
    sign1.decode(code, n, m1, chunk=chunk)  # m as the worker decodes it from the kept code
    _same(m1, m0)
    for scale in (1.0, 0.37):
        r0, r1 = d["r"].copy(), d["r"].copy()
        out0, out1 = (np.empty(sign1.payload_bytes(n, chunk), np.uint8) for _ in range(2))
        s0, b0, size = sign1.payload_views(out0, n, chunk)
        s1, b1, _ = sign1.payload_views(out1, n, chunk)
        push.onebit_momentum_encode(d["g"], m0, F(scale), F(0.1), r0, s0, b0, np.int64(chunk),
                                    mean_abs)
        push.onebit_momentum_encode_coded(d["g"], code, F(scale), F(0.1), r1, s1, b1, chunk,
                                          mean_abs)
        _same(out1[:size], out0[:size])
        _same(r1, r0)


def test_policy_keeps_the_published_code_as_m_with_the_same_pushes_and_copies():
    """OneBitMomentum over three steps (the fetched m, then published codes) pushes and applies
    exactly what a worker that keeps m as an array does (the numpy sequence), and after the
    first published momentum it holds the code, not m."""
    n, key, chunk = 1000, 3, 64
    codec = Codec(pb.CODEC_SIGN1, chunk, 0)
    mom = OneBitMomentum(_params(chunk=chunk))
    d = _data(n, 6, False)
    mom.m[key], mom.denominator[key] = d["m"].copy(), np.empty(n, F)
    native.onebit_denominator(d["v"], F(0.5), F(1e-8), mom.denominator[key])
    m_ref, p_ref, p = d["m"].copy(), d["p"].copy(), d["p"].copy()
    a, b = Compressor(codec, n), Compressor(codec, n)
    shard = Compressor(codec, n)
    for step in range(3):
        g = d["g"] * F(step + 1)
        with np.errstate(invalid="ignore"):
            w = np.add(np.multiply(np.subtract(g, m_ref), F(0.1)), m_ref)
        assert bytes(mom.encode(key, g, a)) == bytes(b.encode(w))
        _same(a.residual, b.residual)
        published = bytes(shard.encode(w))  # the shard's mean of one worker's momentum
        version = mom.params.freeze_step + 1 + step
        mom.apply(key, published, p, chunk, version)
        m_ref.fill(0)
        sign1.decode_add(published, n, m_ref, chunk=chunk)
        neg_lr = F(-(mom.params.lr * mom._schedule.factor(version - 1)))
        native.onebit_adam_apply(p_ref, m_ref, d["v"], F(1e-8), F(0.01), neg_lr, F(0.5),
                                 F(4.0))
        _same(p, p_ref)
        assert key not in mom.m and key in mom.m_code and mom.loaded(key)
        _same(mom.momentum_of(key), m_ref)
    # a code of another chunk than the shard's (never sent by a shard of these params): m is
    # kept as an array, and the next push reads it
    other = Codec(pb.CODEC_SIGN1, 2 * chunk, 0)
    published = bytes(Compressor(other, n).encode(d["g"]))
    mom.apply(key, published, p, 2 * chunk, mom.params.freeze_step + 4)
    m_ref = np.zeros(n, F)
    sign1.decode_add(published, n, m_ref, chunk=2 * chunk)
    assert key not in mom.m_code
    _same(mom.m[key], m_ref)
    with np.errstate(invalid="ignore"):
        w = np.add(np.multiply(np.subtract(d["g"], m_ref), F(0.1)), m_ref)
    assert bytes(mom.encode(key, d["g"], a)) == bytes(b.encode(w))


def _params(**kw) -> OneBitParams:
    base = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, lr=1e-3, freeze_step=1,
                chunk=64, ratio_clip=4.0)
    return OneBitParams(**{**base, **kw})


@pytest.mark.parametrize("flags", (0, MEAN_ABS))
def test_policy_momentum_encode_equals_momentum_through_the_compressor(flags):
    n, key = 1000, 3
    codec = Codec(pb.CODEC_SIGN1, 64, flags)
    fused, unfused = OneBitMomentum(_params()), OneBitMomentum(_params())
    d = _data(n, 3, False)
    for mom in (fused, unfused):
        mom.m[key] = d["m"].copy()
    a, b = Compressor(codec, n), Compressor(codec, n)
    for step, scale in enumerate((1.0, 0.5, 1.0)):
        g = d["g"] * F(step + 1)
        got = bytes(fused.encode(key, g, a, scale))
        want = bytes(b.encode(unfused.momentum(key, g, scale)))
        assert got == want
        _same(a.residual, b.residual)


def test_policy_direction_encode_equals_direction_through_the_compressor():
    n, key = 777, 5
    codec = Codec(pb.CODEC_SIGN1, 64, 0)
    fused, unfused = WorkerMoments(_params()), WorkerMoments(_params())
    a, b = Compressor(codec, n), Compressor(codec, n)
    d = _data(n, 4, False)
    for step, scale in enumerate((1.0, 0.5, 1.0, 1.0)):
        g = d["g"] * F(step + 1)
        assert bytes(fused.encode(key, g, a, scale)) == bytes(b.encode(
            unfused.direction(key, g, scale)))
        _same(a.residual, b.residual)
    assert fused.steps == unfused.steps
    _same(fused.m[key], unfused.m[key])
    _same(fused.v[key], unfused.v[key])


# -- half precision ------------------------------------------------------------------------------

def _halves_ref(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's float16 of ``u`` (bits) and ``u - float32(half)``."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = u.astype(np.float16)
        return h.view(np.uint16), u - h.astype(F)


def _hard_values() -> np.ndarray:
    """Every rounding region of binary16: zeros, subnormal and normal ties, the largest finite
    half and the overflow edge, the underflow edge, Inf, and a sweep of float32 bit patterns."""
    edges = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.996, 65520.0, 65536.0, -65520.0,
                      6.1035156e-05, 6.097555e-05, 5.9604645e-08, 2.9802322e-08,
                      2.9802326e-08, 8.940697e-08, 1e-45, 3e-38, 1.0009766, 1.0004883,
                      1.0014648, np.inf, -np.inf], F)
    sweep = np.arange(0, 1 << 32, 65_537, dtype=np.uint64).astype(np.uint32).view(F)
    return np.concatenate([edges, sweep[np.isfinite(sweep)]])


def test_fp16_cast_rounds_every_region_as_numpy_does():
    x = _hard_values()
    out = np.empty(x.size, np.uint16)
    casts.fp16_encode(x, None, out)
    _same(out, _halves_ref(x)[0])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", (1.0, 0.37))
def test_fp16_hardware_conversion_equals_the_bit_arithmetic(n, scale):
    """The fp16 kernels convert with the CPU's half instructions where they compile and agree
    (``casts._hardware_halves``), else with the bit arithmetic: both give the same payload,
    residual and decoded sum, bit for bit, over every rounding region (overflow, ties,
    subnormal halves) and every binary16 value decoded."""
    if not casts._hardware_halves():
        pytest.skip("no hardware half conversion here: only the bit arithmetic runs")
    x = np.resize(_hard_values(), n) if n else np.empty(0, F)
    d = _data(n, 7, False)
    g = (d["g"] * F(1e4) + x * F(1e-3)).astype(F)
    outs = {}
    for name, cast, ef in (("hw", casts._fp16_cast_hw, casts._fp16_encode_ef_hw),
                           ("bits", casts._fp16_cast, casts._fp16_encode_ef)):
        plain, coded, r = np.empty(n, np.uint16), np.empty(n, np.uint16), d["r"].copy()
        cast(x, plain)
        ef(g, r, coded, F(scale))
        outs[name] = (plain, coded, r)
    for a, b in zip(outs["hw"], outs["bits"]):
        _same(a, b)
    halves = np.arange(1 << 16, dtype=np.uint16)
    halves = halves[np.isfinite(halves.view(np.float16)) | np.isinf(halves.view(np.float16))]
    acc, want = np.ones(halves.size, F), np.ones(halves.size, F)
    casts._fp16_decode_add_hw(halves, acc)
    np.add(want, halves.view(np.float16), out=want, casting="same_kind")
    _same(acc, want)


def test_fp16_falls_back_to_the_bit_arithmetic(monkeypatch):
    """Where the hardware conversion is missing, fp16_encode and fp16_decode_add take the bit
    arithmetic and numpy's float16, with the same results."""
    if not casts._hardware_halves():
        pytest.skip("no hardware half conversion here: the fallback is all that runs")
    x = _hard_values()
    d = _data(x.size, 8, False)
    runs = []
    for hardware in (True, False):
        monkeypatch.setattr(casts, "_hardware_halves", lambda hw=hardware: hw)
        plain, coded, r = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16), d["r"].copy()
        casts.fp16_encode(x, None, plain)
        casts.fp16_encode(d["g"], r, coded, scale=0.5)
        acc = np.ones(x.size, F)
        casts.fp16_decode_add(plain.tobytes(), x.size, acc)
        runs.append((plain, coded, r, acc))
    for a, b in zip(*runs):
        _same(a, b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", (1.0, 0.37))
@pytest.mark.parametrize("special", (False, True))
def test_fp16_error_feedback_equals_numpy(n, scale, special):
    d = _data(n, 5, special)
    x = np.resize(_hard_values(), n) if n else np.empty(0, F)
    g = (d["g"] * F(1e4) + x * F(1e-3)).astype(F)
    r = d["r"].copy()
    out = np.empty(n, np.uint16)
    casts.fp16_encode(g, r, out, scale=scale)
    u = (g * F(scale) if scale != 1.0 else g) + d["r"]
    bits, residual = _halves_ref(u)
    _same(out, bits)
    _same(r, residual)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", (1.0, 0.37))
def test_bf16_error_feedback_equals_the_reference(n, scale):
    d = _data(n, 6, True)
    r = d["r"].copy()
    out = np.empty(n, np.uint16)
    casts.bf16_encode(d["g"], r, out, scale=scale)
    with np.errstate(invalid="ignore"):
        u = d["g"] * F(scale) + d["r"]
    want = casts.bf16_reference(u)
    _same(out, want)
    with np.errstate(invalid="ignore"):
        _same(r, u - (want.astype(np.uint32) << 16).view(F))
