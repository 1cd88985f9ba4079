"""The generated stubs are exactly what ``make proto`` produces from ``proto/bitps.proto``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("bitps_pb2.py", "bitps_pb2.pyi", "bitps_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "bitps.proto", tmp_path / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", "proto/bitps.proto"],
                   cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (ROOT / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `make proto`"


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
