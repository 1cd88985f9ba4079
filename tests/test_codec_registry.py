"""A codec is one class in the registry: a new one, registered from outside ``proto/codecs.py``,
travels in headers, is accepted by ``CodecConfig``, checked, split and decoded, and gets error
feedback from ``Compressor`` without any other change."""

from __future__ import annotations

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto import codecs
from bitps.proto.codecs import Codec, CodecConfig, CodecKind, Compressor, register
from bitps.proto.wire import PSError

INT8_ID = 100  # far from the ids bitps.proto defines


class Int8Kind(CodecKind):
    """Per key: one float32 scale (max |u| / 127), then n int8 values rounded to nearest."""

    name, id = "int8", INT8_ID

    def max_bytes(self, codec, n):
        return 4 + n

    def decode_add(self, codec, payload, n, acc):
        buf = np.frombuffer(payload, np.uint8)
        scale = buf[:4].view(np.float32)[0]
        acc[:n] += buf[4:4 + n].view(np.int8).astype(np.float32) * scale

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        u = grad * np.float32(scale) + residual
        s = np.float32(np.abs(u).max() / 127) if u.size else np.float32(0)
        q = np.zeros(u.shape, np.int8) if s == 0 else np.rint(u / s).astype(np.int8)
        out[:4].view(np.float32)[0] = s
        out[4:4 + u.size].view(np.int8)[:] = q
        residual[:] = u - q.astype(np.float32) * s
        return 4 + u.size


@pytest.fixture
def int8(monkeypatch):
    """The registry with ``int8`` added, restored afterwards (other tests, and the generated
    configuration page, see the built-in codecs only)."""
    for name in ("CODECS", "_KINDS", "_BY_NAME"):
        monkeypatch.setattr(codecs, name, dict(getattr(codecs, name)))
    register(Int8Kind)
    return Codec.from_config(CodecConfig(name="int8"))


def test_a_registered_codec_round_trips_with_error_feedback(int8):
    n, steps = 1000, 6
    assert int8.name == "int8" and not int8.is_raw and int8.max_bytes(n) == n + 4
    header = pb.DataHeader()
    header.codec, header.codec_chunk, header.codec_flags = int8.wire_fields()
    received = Codec.from_header(header)
    assert received == int8

    rng = np.random.default_rng(0)
    comp, sent, total = Compressor(int8, n), np.zeros(n, np.float32), np.zeros(n, np.float32)
    codes = []
    for _ in range(steps):
        g = rng.standard_normal(n).astype(np.float32)
        total += g
        payload = bytes(comp.encode(g))
        assert received.check(payload, n) is None
        received.decode_add(payload, n, sent)
        codes.append(payload)
    # error feedback: what was sent plus what is still owed is every gradient
    np.testing.assert_allclose(sent + comp.residual, total, rtol=0, atol=1e-4)

    parts = received.split(b"".join(codes[:2]), n)
    assert [bytes(p) for p in parts] == codes[:2]
    assert "expected 1004" in received.check(codes[0][:-1], n)


def test_the_registry_refuses_a_duplicate_and_unknown_ids_stay_refused(int8):
    with pytest.raises(ValueError, match="already registered"):
        register(Int8Kind)
    with pytest.raises(PSError) as err:
        Codec.from_header(pb.DataHeader(codec=INT8_ID + 1))
    assert err.value.code == pb.BAD_DTYPE and "int8" in err.value.message
    with pytest.raises(ValueError, match="not registered"):
        Codec(INT8_ID + 1)


def test_without_registration_the_codec_is_unknown():
    assert "int8" not in codecs.CODECS
    with pytest.raises(ValueError, match="int8"):
        CodecConfig(name="int8")


def test_device_encoders_are_looked_up_by_codec_name():
    torch = pytest.importorskip("torch")
    from bitps.worker.training import codec_torch

    g = torch.randn(300)
    r1, r2 = torch.zeros(300), torch.zeros(300)
    sign1 = Codec.from_config(CodecConfig(name="sign1", chunk=128, scale="mean_abs"))
    by_name = codec_torch.encode(g, r1, sign1, 0.5)
    direct = codec_torch.sign1_encode(g, r2, chunk=128, mean_abs=True, scale=0.5)
    assert torch.equal(by_name, direct) and torch.equal(r1, r2)
    with pytest.raises(ValueError, match="no device encoder"):
        codec_torch.encode(g, r1, Codec.from_config(CodecConfig(name="sparse")))
