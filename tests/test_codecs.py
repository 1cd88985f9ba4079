"""Tests for the sign1 and bf16/fp16 kernels against their numpy references (bit for bit over
error-feedback steps, also with ``NUMBA_DISABLE_JIT=1``), the sign1 wire size, and the codec
registry's handling of untrusted headers and frames. The sparse codec has tests/test_sparse.py."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from bitps.native import casts, sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, CodecConfig, Compressor
from bitps.proto.wire import PSError

SIZES = (1, 63, 64, 100, 2048, 2049, 5000, 100_003)
SPECIAL = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF,
                    0x7F800001, 0x00000001, 0x80000000, 0x3F808000, 0x3F818000, 0x3F80FFFF],
                   np.uint32).view(np.float32)


def _grads(seed: int, n: int, steps: int = 3) -> list[np.ndarray]:
    """Gradients whose magnitudes span six decades, so chunk scales and residuals differ."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
            for _ in range(steps)]


def _bf16_value(q: np.ndarray) -> np.ndarray:
    return (q.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [64, 2048])
@pytest.mark.parametrize("mean_abs", [False, True])
def test_sign1_kernel_equals_reference_over_ef_steps(n, chunk, mean_abs):
    residual, ref_residual = np.zeros(n, np.float32), np.zeros(n, np.float32)
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    for grad in _grads(n + chunk, n):
        size = sign1.encode(grad, residual, out, chunk=chunk, mean_abs=mean_abs)
        payload, ref_residual = sign1.encode_reference(grad, ref_residual, chunk=chunk,
                                                       mean_abs=mean_abs)
        assert out[:size].tobytes() == payload
        assert np.array_equal(residual, ref_residual)
        acc = np.full(n, 0.5, np.float32)
        sign1.decode_add(payload, n, acc, chunk=chunk)
        assert np.array_equal(acc, np.float32(0.5) + sign1.decode_reference(payload, n,
                                                                            chunk=chunk))


def test_sign1_layout_by_hand():
    """Scales first, then LSB-first sign bits with 1 = negative and zero encoded as +."""
    u = np.array([1.0, -3.0, 0.0, -0.0, 2.0, -1.0, 1.0, 1.0, -5.0], np.float32)
    residual = np.zeros_like(u)
    out = np.empty(sign1.payload_bytes(9, 64), np.uint8)
    assert sign1.encode(u, residual, out, chunk=64) == 2 + 4
    rms = np.float32(np.sqrt(np.sum(u.astype(np.float64) ** 2) / 9))
    assert np.frombuffer(out[:4].tobytes(), "<f4")[0] == rms
    assert out[4] == 0b0010_0010 and out[5] == 0b1
    assert np.array_equal(residual, u - np.where(u < 0, -rms, rms))


def test_sign1_zero_chunk_has_zero_scale_and_residual_stays():
    n = 200
    grad = np.zeros(n, np.float32)
    grad[130:] = 1.0
    residual = np.zeros(n, np.float32)
    out = np.empty(sign1.payload_bytes(n, 64), np.uint8)
    sign1.encode(grad, residual, out, chunk=64)
    scales = np.frombuffer(out[:16].tobytes(), "<f4")
    assert scales[0] == scales[1] == 0 and scales[2] > 0
    decoded = sign1.decode_reference(out.tobytes(), n, chunk=64)
    assert not decoded[:128].any()


@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4097, 1 << 20])
@pytest.mark.parametrize("chunk", [64, 2048])
def test_sign1_wire_size(n, chunk):
    """A sign1 frame carries exactly ceil(n/8) + 4 ceil(n/C) bytes."""
    codec = Codec.from_config(CodecConfig(name="sign1", chunk=chunk))
    payload = Compressor(codec, n).encode(np.ones(n, np.float32))
    expected = -(-n // 8) + 4 * -(-n // chunk)
    assert len(payload) == expected == codec.max_bytes(n)
    assert codec.check(payload, n) is None
    assert "expected" in codec.check(bytes(payload)[:-1], n)


def test_bf16_rounding_matches_reference_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = np.concatenate([SPECIAL, rng.standard_normal(5000).astype(np.float32)])
    out = np.empty(x.size, np.uint16)
    assert casts.bf16_encode(x, None, out) == 2 * x.size
    assert np.array_equal(out, casts.bf16_reference(x))
    finite = np.isfinite(x)
    via_torch = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out[finite], via_torch[finite])
    assert np.isnan(_bf16_value(out[~np.isfinite(x) & np.isnan(x)])).all()
    assert np.isinf(_bf16_value(out[:2])).all(), "max finite rounds up to infinity"


@pytest.mark.parametrize("n", [1, 999, 65_537])
def test_bf16_and_fp16_error_feedback_steps(n):
    residual, ref = np.zeros(n, np.float32), np.zeros(n, np.float32)
    half_residual = np.zeros(n, np.float32)
    out = np.empty(n, np.uint16)
    for grad in _grads(n, n):
        casts.bf16_encode(grad, residual, out)
        u = grad + ref
        q = casts.bf16_reference(u)
        ref = u - _bf16_value(q)
        assert np.array_equal(out, q) and np.array_equal(residual, ref)
        acc = np.ones(n, np.float32)
        casts.bf16_decode_add(out.tobytes(), n, acc)
        assert np.array_equal(acc, np.float32(1) + _bf16_value(q))
        u16 = grad + half_residual
        casts.fp16_encode(grad, half_residual, out)
        assert np.array_equal(out.view(np.float16), u16.astype(np.float16))
        assert np.array_equal(half_residual, u16 - u16.astype(np.float16).astype(np.float32))


def test_registry_rejects_unknown_or_malformed_codec_headers():
    for fields, word in [({"codec": 9}, "unknown"),
                         ({"codec": pb.CODEC_SIGN1, "codec_chunk": 100}, "multiple of 64"),
                         ({"codec": pb.CODEC_SPARSE, "codec_chunk": 1 << 21}, "multiple of 64"),
                         ({"codec": pb.CODEC_SIGN1, "codec_chunk": 64, "codec_flags": 8},
                          "flags")]:
        with pytest.raises(PSError, match=word) as err:
            Codec.from_header(pb.DataHeader(**fields))
        assert err.value.code == pb.BAD_DTYPE
    codec = Codec.from_header(pb.DataHeader(codec=pb.CODEC_SIGN1, codec_chunk=128,
                                            codec_flags=1))
    assert (codec.name, codec.chunk, codec.flags) == ("sign1", 128, 1)
    assert Codec.from_header(pb.DataHeader()).is_raw
    with pytest.raises(ValueError, match="codec 'int4'"):
        CodecConfig(name="int4")
    with pytest.raises(ValueError, match="chunk 100"):
        CodecConfig(name="sign1", chunk=100)


def test_registry_decode_round_trips_every_codec():
    n = 3000
    grad = _grads(11, n, 1)[0]
    for name in ("bf16", "fp16", "sign1", "sparse"):
        codec = Codec.from_config(CodecConfig(name=name, chunk=256))
        comp = Compressor(codec, n)
        payload = bytes(comp.encode(grad, seed=5))
        assert codec.check(payload, n) is None, name
        decoded = codec.decode(payload, n, np.empty(n, np.float32))
        # error feedback: what was sent plus what was kept is the gradient, up to float32
        # rounding of sent values as large as the biggest element
        np.testing.assert_allclose(decoded + comp.residual, grad, rtol=0,
                                   atol=4e-7 * np.abs(grad).max(), err_msg=name)
    raw = Codec(pb.CODEC_RAW)
    assert np.array_equal(raw.decode(grad.tobytes(), n, np.empty(0, np.float32)), grad)


_NOJIT_SCRIPT = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    assert numba.config.DISABLE_JIT
    from bitps.native import casts, sign1

    data = np.load(sys.argv[1])
    out = {}
    for chunk, mean_abs in ((64, False), (128, True)):
        residual = np.zeros(data["g0"].size, np.float32)
        buf = np.empty(sign1.payload_bytes(residual.size, chunk), np.uint8)
        for step in range(3):
            size = sign1.encode(data[f"g{step}"], residual, buf, chunk=chunk, mean_abs=mean_abs)
            out[f"sign1_{chunk}_{step}"] = buf[:size].copy()
            n = residual.size
            out[f"sign1_{chunk}_{step}_decoded"] = sign1.decode(
                buf[:size], n, np.empty(n, np.float32), chunk=chunk).copy()
            acc = np.ones(n, np.float32)
            sign1.decode_add(buf[:size], n, acc, chunk=chunk)
            out[f"sign1_{chunk}_{step}_added"] = acc
        out[f"sign1_{chunk}_residual"] = residual
    residual = np.zeros(data["g0"].size, np.float32)
    q = np.empty(residual.size, np.uint16)
    for step in range(3):
        casts.bf16_encode(data[f"g{step}"], residual, q)
        out[f"bf16_{step}"] = q.copy()
    out["bf16_residual"] = residual
    residual = np.zeros(data["g0"].size, np.float32)
    for step in range(3):
        casts.fp16_encode(data[f"g{step}"], residual, q)
        out[f"fp16_{step}"] = q.copy()
    out["fp16_residual"] = residual
    np.savez(sys.argv[2], **out)
""")


def test_pure_python_kernels_equal_reference(run_without_jit):
    n = 301
    grads = _grads(9, n)
    got = run_without_jit(_NOJIT_SCRIPT, **{f"g{i}": g for i, g in enumerate(grads)})
    for chunk, mean_abs in ((64, False), (128, True)):
        residual = np.zeros(n, np.float32)
        for step, grad in enumerate(grads):
            payload, residual = sign1.encode_reference(grad, residual, chunk=chunk,
                                                       mean_abs=mean_abs)
            assert got[f"sign1_{chunk}_{step}"].tobytes() == payload
            decoded = sign1.decode_reference(payload, n, chunk=chunk)
            assert np.array_equal(got[f"sign1_{chunk}_{step}_decoded"], decoded)
            assert np.array_equal(got[f"sign1_{chunk}_{step}_added"], np.float32(1) + decoded)
        assert np.array_equal(got[f"sign1_{chunk}_residual"], residual)
    residual = np.zeros(n, np.float32)
    for step, grad in enumerate(grads):
        u = grad + residual
        q = casts.bf16_reference(u)
        residual = u - _bf16_value(q)
        assert np.array_equal(got[f"bf16_{step}"], q)
    assert np.array_equal(got["bf16_residual"], residual)
    residual = np.zeros(n, np.float32)
    for step, grad in enumerate(grads):
        u = grad + residual
        h = u.astype(np.float16)
        residual = u - h.astype(np.float32)
        assert np.array_equal(got[f"fp16_{step}"], h.view(np.uint16))
    assert np.array_equal(got["fp16_residual"], residual)


def test_sign1_decodes_refuse_a_strided_or_wrongly_typed_output():
    """The decodes write 8 elements at a time from the output's data pointer: a strided or
    non-float32 output is refused with a ValueError naming it, before anything is written."""
    n = 100
    out = np.empty(sign1.payload_bytes(n), np.uint8)
    size = sign1.encode(np.linspace(-1, 1, n, dtype=np.float32), np.zeros(n, np.float32), out)
    strided = np.zeros(2 * n, np.float32)
    for call in (sign1.decode, sign1.decode_add):
        with pytest.raises(ValueError, match="C-contiguous float32"):
            call(out[:size], n, strided[::2])
        with pytest.raises(ValueError, match="C-contiguous float32"):
            call(out[:size], n, np.zeros(n, np.float64))
    assert not strided.any()
