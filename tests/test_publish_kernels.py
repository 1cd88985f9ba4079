"""The fused update-and-publish kernels (``native.publish``) and sign1's one-pass decode against
the unfused sequences they replace, bit for bit: odd sizes, chunk boundaries, empty keys, both
scale rules, weight decay on and off, frozen-v zeros, NaN and Inf input."""

from __future__ import annotations

import numpy as np
import pytest

from bitps import native
from bitps.native import sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.ps.pushcode import PushCode, PushCodes

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


def _encode_ref(u_in, residual, chunk, mean_abs):
    """The unfused encode: sign1.encode of ``u_in`` (scale 1) onto ``residual``."""
    out = np.empty(sign1.payload_bytes(u_in.size, chunk), np.uint8)
    size = sign1.encode(u_in, residual, out, chunk=chunk, mean_abs=mean_abs)
    return out[:size]


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


CASES = [(n, c, mean_abs, wd, special) for n in SIZES for c in CHUNKS
         for mean_abs in (False, True) for wd in (0.0, 0.01) for special in (False, True)]


@pytest.mark.parametrize("n,chunk,mean_abs,wd,special", CASES)
def test_sync_publish_equals_multiply_encode_decode_apply(n, chunk, mean_abs, wd, special):
    d = _data(n, 0, special)
    eps, neg_lr, bc2, clip = F(1e-8), F(-1e-3), F(0.3), F(4.0)
    # before: multiply, encode, m = 0 + decode, onebit_adam_apply
    r0, m0, p0 = d["r"].copy(), d["m"].copy(), d["p"].copy()
    delta = d["g"] * F(0.5)
    code0 = _encode_ref(delta, r0, chunk, mean_abs)
    m0.fill(0)
    sign1.decode_add(code0, n, m0, chunk=chunk)
    native.onebit_adam_apply(p0, m0, d["v"], eps, F(wd), neg_lr, bc2, clip)
    # now
    r1, m1, p1 = d["r"].copy(), d["m"].copy(), d["p"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    den = np.empty(n, F)
    native.onebit_denominator(d["v"], bc2, eps, den)
    native.onebit_sync_publish(d["g"], F(0.5), r1, scales, bits, den, p1,
                               np.int64(chunk), mean_abs, F(wd), neg_lr, clip)
    _same(out[:size], code0)
    for a, b in ((r1, r0), (p1, p0)):
        _same(a, b)
    # m is the code's decode, which the kernel leaves to the shard's state (never written)
    _same(m1, d["m"])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wd", (0.0, 0.01))
@pytest.mark.parametrize("special", (False, True))
def test_the_frozen_denominator_applies_as_the_square_root_every_step(n, wd, special):
    """``onebit_adam_apply_den`` with ``onebit_denominator``'s once-made denominators gives the
    bits of ``onebit_adam_apply``, which takes ``sqrt(v)`` every step: v of 0 (left as they
    are), subnormal and huge v, NaN/Inf in m and in v."""
    d = _data(n, 3, special)
    v = d["v"].copy()
    if n > 8:
        v[3], v[4], v[5] = F(1e-45), F(3e38), F(-0.0)
        if special:
            v[6], v[7] = np.nan, np.inf
    eps, neg_lr, bc2, clip = F(1e-8), F(-1e-3), F(0.3), F(4.0)
    p0, p1, den = d["p"].copy(), d["p"].copy(), np.full(n, np.nan, F)
    with np.errstate(all="ignore"):
        native.onebit_adam_apply(p0, d["g"], v, eps, F(wd), neg_lr, bc2, clip)
        native.onebit_denominator(v, bc2, eps, den)
        native.onebit_adam_apply_den(p1, d["g"], den, F(wd), neg_lr, clip)
    _same(p1, p0)
    assert not den[v == 0].any()


@pytest.mark.parametrize("wd", (0.0, 0.01))
def test_a_masked_coordinate_keeps_its_parameter_bit_for_bit(wd):
    """Where v == 0 (den == 0) both applies add a step of -0.0 instead of selecting the old
    parameter (the select kept the loop from vectorizing): every parameter a mask leaves,
    +0.0, -0.0, NaN, Inf and subnormals among them, comes out with its own bits; a step of
    +0.0 would turn -0.0 into +0.0."""
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3e38, -1.5], F)
    n = 4 * specials.size + 3
    p = np.resize(specials, n)
    m = np.linspace(-3, 3, n).astype(F)
    v = np.zeros(n, F)
    v[-3:] = F(1e-4)  # three unmasked coordinates: the step still lands
    den = np.empty(n, F)
    native.onebit_denominator(v, F(0.3), F(1e-8), den)
    for apply in ("sqrt", "den"):
        got = p.copy()
        with np.errstate(all="ignore"):
            if apply == "sqrt":
                native.onebit_adam_apply(got, m, v, F(1e-8), F(wd), F(-1e-3), F(0.3), F(4.0))
            else:
                native.onebit_adam_apply_den(got, m, den, F(wd), F(-1e-3), F(4.0))
        _same(got[:-3], p[:-3])
        assert not np.array_equal(got[-3:], p[-3:])


@pytest.mark.parametrize("n,chunk,mean_abs,wd,special", CASES)
def test_direction_publish_equals_delta_encode_decode_add(n, chunk, mean_abs, wd, special):
    d = _data(n, 1, special)
    neg_lr, clip = F(-1e-3), F(4.0)
    r0, p0 = d["r"].copy(), d["p"].copy()
    delta = np.empty(n, F)
    native.onebit_direction_delta(p0, d["g"], delta, F(0.5), F(wd), neg_lr, clip)
    code0 = _encode_ref(delta, r0, chunk, mean_abs)
    sign1.decode_add(code0, n, p0, chunk=chunk)
    r1, p1 = d["r"].copy(), d["p"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    native.onebit_direction_publish(p1, d["g"], F(0.5), r1, scales, bits, np.int64(chunk),
                                    mean_abs, F(wd), neg_lr, clip)
    _same(out[:size], code0)
    _same(r1, r0)
    _same(p1, p0)


@pytest.mark.parametrize("n,chunk,mean_abs,wd,special", CASES)
def test_moments_publish_equals_delta_encode_decode_add(n, chunk, mean_abs, wd, special):
    d = _data(n, 2, special)
    eps, neg_lr, bc2, clip, omb1 = F(1e-8), F(-1e-3), F(0.3), F(4.0), F(0.1)
    r0, m0, p0 = d["r"].copy(), d["m"].copy(), d["p"].copy()
    delta = np.empty(n, F)
    native.onebit_adam_delta(p0, d["g"], m0, d["v"], delta, F(0.5), omb1, eps, F(wd), neg_lr,
                             bc2, clip)
    code0 = _encode_ref(delta, r0, chunk, mean_abs)
    sign1.decode_add(code0, n, p0, chunk=chunk)
    r1, m1, p1 = d["r"].copy(), d["m"].copy(), d["p"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    den = np.empty(n, F)
    native.onebit_denominator(d["v"], bc2, eps, den)
    native.onebit_moments_publish(p1, d["g"], m1, den, F(0.5), r1, scales, bits,
                                  np.int64(chunk), mean_abs, omb1, F(wd), neg_lr, clip)
    _same(out[:size], code0)
    for a, b in ((r1, r0), (m1, m0), (p1, p0)):
        _same(a, b)


CODE_CASES = [(n, push_chunk, chunk, wd, special) for n in SIZES
              for push_chunk in (64, 192, 2048) for chunk in CHUNKS for wd in (0.0, 0.01)
              for special in (False, True)]


def _pushed_code(n: int, push_chunk: int, special: bool) -> np.ndarray:
    """A worker's sign1 code of ``n`` elements: random signs and scales, with NaN/Inf in a
    scale and an all-zero chunk (scale 0, so both of its signs decode to +0.0) where
    ``special``."""
    g = _data(n, 3, special)["g"]
    if special and n > 2 * push_chunk:
        g[push_chunk:2 * push_chunk] = 0
    code = _encode_ref(g, np.zeros(n, F), push_chunk, False).copy()
    if special and n > 2 * push_chunk:  # half of the zero chunk's signs negative
        first = 4 * (-(-n // push_chunk)) + push_chunk // 8
        code[first:first + push_chunk // 8] = 0xAA
    return code


@pytest.mark.parametrize("n,push_chunk,chunk,wd,special", CODE_CASES)
@pytest.mark.parametrize("moments", ("worker", "shard", "sync"))
def test_publish_of_a_pushed_code_equals_decoding_it_first(n, push_chunk, chunk, wd, special,
                                                            moments):
    """The ``_code`` kernels decode the push chunk by chunk as they go; pushes cut in other
    chunks than the publish (64, 192, 2048 against 64, 2048) cross its chunk boundaries. With
    ``special``, a residual of -0.0 under the code's zero chunk makes the sign of that chunk's
    decoded zeros show in the new residual (without weight decay)."""
    d = _data(n, 4, special)
    code = _pushed_code(n, push_chunk, special)
    code_scales, code_bits = sign1.split(code, n, push_chunk)
    if special and n > 2 * push_chunk:
        d["r"][push_chunk:2 * push_chunk] = F(-0.0)
    neg_lr, clip, omb1 = F(-1e-3), F(4.0), F(0.1)
    den = np.empty(n, F)
    native.onebit_denominator(d["v"], F(0.3), F(1e-8), den)
    runs = []
    for undecoded in (False, True):
        r, m, p = d["r"].copy(), d["m"].copy(), d["p"].copy()
        out = np.zeros(sign1.payload_bytes(n, chunk), np.uint8)
        scales, bits, size = sign1.payload_views(out, n, chunk)
        pushed = ((code_scales, code_bits, np.int64(push_chunk)) if undecoded
                  else (sign1.decode(code, n, np.empty(n, F), chunk=push_chunk),))
        code_or = "_code" if undecoded else ""
        if moments == "worker":
            getattr(native, f"onebit_direction_publish{code_or}")(
                p, *pushed, F(0.5), r, scales, bits, np.int64(chunk), False, F(wd), neg_lr,
                clip)
        elif moments == "shard":
            getattr(native, f"onebit_moments_publish{code_or}")(
                p, *pushed, m, den, F(0.5), r, scales, bits, np.int64(chunk), False, omb1,
                F(wd), neg_lr, clip)
        else:  # the sync kernel takes a tuple of codes (tested with several below)
            if undecoded:
                pushed = ((code_scales,), (code_bits,), np.int64(push_chunk))
            getattr(native, f"onebit_sync_publish{code_or}")(
                *pushed, F(0.5), r, scales, bits, den, p, np.int64(chunk), False, F(wd),
                neg_lr, clip)
        runs.append((out[:size], r, m, p))
    for a, b in zip(*runs):
        _same(a, b)
    if special and n > 2 * push_chunk:
        assert not np.isfinite(code_scales).all() and code_scales[1] == 0
        assert code_bits[push_chunk // 8] == 0xAA


@pytest.mark.parametrize("n,push_chunk,chunk,wd,special",
                         [c for c in CODE_CASES if c[2] == 64 or c[0] == 3 * 2048 + 5])
@pytest.mark.parametrize("pushes", (2, 3))
def test_sync_publish_of_several_pushed_codes_equals_their_decoded_sum(n, push_chunk, chunk, wd,
                                                                        special, pushes):
    """sync 1-bit Adam's step of several pushed codes (``ps.pushcode.PushCodes``) summed
    chunk by chunk in the kernel: bit for bit the kernel of the sum the store made before,
    the first code decoded and the others added in rank order (``sign1.decode``,
    ``sign1.add_decoded``). The codes differ (one with NaN/Inf scales and a zero chunk where
    ``special``), their frames are a read-only bytes object and writable arrays."""
    d = _data(n, 4, special)
    codes = [_pushed_code(n, push_chunk, special and i == 1) for i in range(pushes)]
    for i, code in enumerate(codes):  # other scales, other signs for each push
        code[:4 * -(-n // push_chunk)].view(F)[:] *= F(1 + i)
        code[4 * -(-n // push_chunk):] ^= np.uint8(0x5A * i)
    frames = [codes[0].tobytes(), *codes[1:]]
    total = sign1.decode(frames[0], n, np.empty(n, F), chunk=push_chunk)
    for frame in frames[1:]:
        sign1.add_decoded(frame, n, total, chunk=push_chunk)
    summed = PushCodes(tuple(PushCode(Codec(pb.CODEC_SIGN1, push_chunk), f, n) for f in frames))
    _same(summed.decoded(np.empty(n, F)), total)
    den = np.empty(n, F)
    native.onebit_denominator(d["v"], F(0.3), F(1e-8), den)
    runs = []
    for pushed in ((total,), summed.sign1_sections()):
        r, m, p = d["r"].copy(), d["m"].copy(), d["p"].copy()
        out = np.zeros(sign1.payload_bytes(n, chunk), np.uint8)
        scales, bits, size = sign1.payload_views(out, n, chunk)
        kernel = native.onebit_sync_publish if len(pushed) == 1 else \
            native.onebit_sync_publish_code
        kernel(*pushed, F(1 / pushes), r, scales, bits, den, p, np.int64(chunk), False,
               F(wd), F(-1e-3), F(4.0))
        runs.append((out[:size], r, m, p))
    for a, b in zip(*runs):
        _same(a, b)


@pytest.mark.parametrize("n,push_chunk,wd,special", sorted({
    (n, push_chunk, wd, special) for n, push_chunk, _, wd, special in CODE_CASES}))
@pytest.mark.parametrize("decoupled", (False, True))
def test_adam_step_of_a_pushed_code_equals_decoding_it_first(n, push_chunk, wd, special,
                                                             decoupled):
    """``native.adam_step_code`` decodes the push block by block (2048 elements, across the
    code's chunks) inside the step: the same bits as ``adam_step`` of the decoded array."""
    d = _data(n, 6, special)
    code = _pushed_code(n, push_chunk, special)
    scales, bits = sign1.split(code, n, push_chunk)
    args = (F(0.5), F(0.1), F(0.999), F(0.001), F(1e-8), F(wd), decoupled, F(1 - 1e-3 * wd),
            F(-1e-3), F(0.3))
    runs = []
    for undecoded in (False, True):
        p, m, v = d["p"].copy(), d["m"].copy(), d["v"].copy()
        if undecoded:
            native.adam_step_code(p, scales, bits, np.int64(push_chunk), m, v, *args)
        else:
            native.adam_step(p, sign1.decode(code, n, np.empty(n, F), chunk=push_chunk), m, v,
                             *args)
        runs.append((p, m, v))
    for a, b in zip(*runs):
        _same(a, b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", (64, 192))
def test_add_decoded_adds_what_decode_writes(n, chunk):
    """``sign1.add_decoded``: ``acc += decode(code)`` bit for bit, -0.0 in ``acc`` under a
    zero-scale chunk with set bits included (``decode_add`` gives -0.0 there, decode +0.0),
    and a -0.0 scale read as zero; NaN and Inf scales."""
    code = _pushed_code(n, chunk, True)
    scales, bits = sign1.split(code, n, chunk)
    acc = _data(n, 5, True)["p"]
    if n > 2 * chunk:
        acc[chunk:2 * chunk] = F(-0.0)
        code[4 * 2:4 * 3] = np.frombuffer(F(-0.0).tobytes(), np.uint8)  # scale 2: -0.0
    want = acc + sign1.decode(code, n, np.empty(n, F), chunk=chunk)
    got = acc.copy()
    sign1.add_decoded(code, n, got, chunk=chunk)
    _same(got, want)
    if n > 2 * chunk:
        plain = acc.copy()
        sign1.decode_add(code, n, plain, chunk=chunk)
        assert np.signbit(plain[chunk:2 * chunk]).any()  # where the two differ
        assert not np.signbit(got[chunk:2 * chunk]).any()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("special", (False, True))
def test_one_pass_decode_equals_zeros_plus_decode_add(n, chunk, special):
    rng = np.random.default_rng(n)
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    sign1.encode(rng.standard_normal(n).astype(F), np.zeros(n, F), out, chunk=chunk)
    payload = bytearray(out.tobytes())
    scales = np.frombuffer(payload, F, count=(n + chunk - 1) // chunk)
    if special:  # scales of +0 and -0 (+0.0 either way, as 0.0 + -0.0), NaN and +-Inf
        values = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.5], F)
        scales[:] = values[np.arange(scales.size) % values.size]
    payload = bytes(payload)
    before = np.zeros(n, F)
    sign1.decode_add(payload, n, before, chunk=chunk)
    got = sign1.decode(payload, n, np.full(n, 7.0, F), chunk=chunk)
    _same(got, before)
    assert sign1.scales_finite(payload, n, chunk=chunk) is bool(np.isfinite(before).all())


def test_sign1_zero_scales_decode_to_positive_zero():
    n, chunk = 256, 64
    out = np.zeros(sign1.payload_bytes(n, chunk), np.uint8)
    out[:16] = np.array([0.0, -0.0, 0.0, -0.0], F).view(np.uint8)
    out[16:] = 0xAA  # alternate signs
    before = np.zeros(n, F)
    sign1.decode_add(out.tobytes(), n, before, chunk=chunk)
    got = sign1.decode(out.tobytes(), n, np.empty(n, F), chunk=chunk)
    _same(got, before)
    assert not np.signbit(got).any()


@pytest.mark.parametrize("n,chunk,mean_abs,wd,special", [c for c in CASES if c[3] == 0.0])
def test_sign1_publish_delta_equals_subtract_encode_decode_add(n, chunk, mean_abs, wd, special):
    d = _data(n, 3, special)
    new = d["p"] + d["g"] * F(1e-3)
    r0, p0, x0 = d["r"].copy(), d["p"].copy(), new.copy()
    np.subtract(x0, p0, out=x0)
    code0 = _encode_ref(x0, r0, chunk, mean_abs)
    sign1.decode_add(code0, n, p0, chunk=chunk)
    r1, p1 = d["r"].copy(), d["p"].copy()
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    scales, bits, size = sign1.payload_views(out, n, chunk)
    native.sign1_publish_delta(new, p1, r1, scales, bits, np.int64(chunk), mean_abs)
    _same(out[:size], code0)
    _same(r1, r0)
    _same(p1, p0)


@pytest.mark.parametrize("name", ["sign1", "bf16", "sparse"])
def test_compressor_publish_equals_subtract_encode_decode_add(name):
    from bitps.proto.codecs import Codec, CodecConfig, Compressor

    codec = Codec.from_config(CodecConfig(name=name, chunk=64))
    n = 5000
    d = _data(n, 4, False)
    a, b = Compressor(codec, n), Compressor(codec, n)
    pa, pb_ = d["p"].copy(), d["p"].copy()
    for step in range(3):
        new = pa + d["g"] * F(1e-3 * (step + 1))
        delta = new - pa
        code0 = bytes(a.encode(delta, seed=step))
        codec.decode_add(code0, n, pa)
        code1 = bytes(b.publish(pb_ + d["g"] * F(1e-3 * (step + 1)), pb_, seed=step))
        assert code1 == code0
        _same(pb_, pa)
        _same(b.residual, a.residual)
