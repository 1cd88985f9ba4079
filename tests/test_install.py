"""The wheel installs one top-level package, ``bitps``, and lives beside proto-plus (whose import
name is ``proto``) in one environment: a real wheel, a real fresh venv, a real pip."""

from __future__ import annotations

import csv
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: this venv's setuptools builds it, nothing is downloaded for the build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(ROOT), "-w", str(out)], check=True, cwd=out)
    (found,) = out.glob("bitps-*.whl")
    return found


def _top_level(record_rows: list[list[str]]) -> set[str]:
    """Top-level names a RECORD installs into site-packages (scripts under ``../bin`` aside)."""
    names = set()
    for row in record_rows:
        path = row[0]
        if path.startswith(".."):
            continue  # console scripts, relative to site-packages
        names.add(path.split("/")[0])
    return names


def test_wheel_installs_only_bitps_and_coexists_with_proto_plus(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel), "proto-plus"], check=True)

    # one interpreter: proto-plus's ``proto`` and bitps's wire schema, both importable
    code = ("import sys, proto, bitps, bitps.proto, bitps.ps.__main__; "
            "from bitps import ServerConfig, PSError, __version__; "
            "from bitps.proto import bitps_pb2; "
            "assert hasattr(proto, 'Message'), proto.__file__; "  # proto-plus's API
            "assert bitps.proto.__name__ == 'bitps.proto'; "
            "assert 'torch' not in sys.modules; "
            "print(__version__, proto.__file__, bitps_pb2.DESCRIPTOR.name)")
    # cwd outside the checkout: from its root, ``import proto`` would find the folder proto/
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    version, proto_file, descriptor = done.stdout.split()
    assert Path(proto_file).parent.name == "proto" and "site-packages" in proto_file
    assert descriptor == "bitps/proto/bitps.proto"

    help_run = subprocess.run([str(env_dir / "bin" / "bitps-server"), "--help"],
                              capture_output=True, text=True, cwd=tmp_path)
    assert help_run.returncode == 0, help_run.stderr
    assert "bitps-server" in help_run.stdout

    (site,) = (env_dir / "lib").glob("python*/site-packages")
    (record,) = site.glob(f"bitps-{version}.dist-info/RECORD")
    with record.open() as f:
        top = _top_level(list(csv.reader(f)))
    assert top == {"bitps", f"bitps-{version}.dist-info"}, top
