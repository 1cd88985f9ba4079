"""The generated stubs are exactly what ``make proto`` produces from ``proto/bitps.proto``, and
frame 0 is padded as ``proto.wire.encode_header`` promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PROTOCOL, ZMQ_BATCH_BYTES, encode_header, parse_header

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("bitps_pb2.py", "bitps_pb2.pyi", "bitps_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path):
    """The committed stubs are what ``make proto`` makes: compiled as ``bitps/proto/bitps.proto``
    so that they import through the namespace (``from bitps.proto import bitps_pb2``)."""
    pytest.importorskip("grpc_tools")
    (tmp_path / "bitps" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / "proto" / "bitps.proto", tmp_path / "bitps" / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", "bitps/proto/bitps.proto"],
                   cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "bitps" / "proto" / name).read_text()
        committed = (ROOT / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `make proto`"
    assert "from bitps.proto import bitps_pb2" in (ROOT / "proto" / "bitps_pb2_grpc.py").read_text()


def test_every_field_is_commented():
    """Every message field and enum value in bitps.proto carries a comment (the schema is the
    wire documentation)."""
    lines = (ROOT / "proto" / "bitps.proto").read_text().splitlines()
    in_message, missing = False, []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("message "):
            in_message = not s.endswith("{}")
        elif s == "}":
            in_message = False
        elif in_message and "=" in s and s.endswith(";") and not s.startswith("//"):
            above = lines[i - 1].strip()
            if "//" not in s and not above.startswith("//"):
                missing.append(s)
    assert not missing, f"uncommented fields: {missing}"


@pytest.mark.parametrize("message_len", [0, 200, 230, 260])
def test_header_padding_aligns_the_bulk_copy(message_len):
    """The kernel copies a zero-copy frame from ``bulk + 8192 - prefix`` (``proto.wire``): the
    padded header puts that address on a 64-byte boundary for every alignment of ``bulk`` and
    every header length, including headers near the 255-byte switch of frame 0's size field,
    and the padded bytes still parse to the same header."""
    header = pb.DataHeader(op=pb.PUSH_PULL, protocol=PROTOCOL, worker=3, request_id=77,
                           clock=5, keys=[1, 2], versions=[4, 4], message="x" * message_len)
    buf = np.zeros(1 << 20, np.uint8)
    for shift in range(64):
        bulk = buf[shift:shift + 300_000]
        data = encode_header(header, bulk)
        size_field = 1 if len(data) <= 255 else 8
        assert (bulk.ctypes.data + ZMQ_BATCH_BYTES - (1 + size_field + len(data)) - 9) % 64 == 0
        assert len(data) - len(header.SerializeToString()) in [0] + list(range(3, 3 + 128))
        parsed = parse_header(data)
        assert set(parsed.pad) <= {0}
        parsed.ClearField("pad")
        assert parsed == header


def test_header_padding_only_for_bulk_frames():
    header = pb.DataHeader(op=pb.REPLY, request_id=1)
    plain = header.SerializeToString()
    assert encode_header(header) == plain
    assert encode_header(header, np.zeros(ZMQ_BATCH_BYTES, np.uint8)) == plain  # one batch
    # a memoryview names its address too
    big = np.zeros(1 << 16, np.uint8)[5:]
    assert encode_header(header, memoryview(big)) == encode_header(header, big)


def test_the_rule_sections_stubs_are_fresh(tmp_path):
    """1-bit Adam's own wire section (``proto/onebit.proto``, messages only) is compiled by
    ``make proto`` too."""
    pytest.importorskip("grpc_tools")
    (tmp_path / "bitps" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / "proto" / "onebit.proto", tmp_path / "bitps" / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--pyi_out=.", "bitps/proto/onebit.proto"], cwd=tmp_path, check=True)
    for name in ("onebit_pb2.py", "onebit_pb2.pyi"):
        fresh = (tmp_path / "bitps" / "proto" / name).read_text()
        assert fresh == (ROOT / "proto" / name).read_text(), f"proto/{name} is stale: run " \
            "`make proto`"
