"""A regular (not editable) install works from the repository's root: the folders there must not
shadow the installed ``bitps`` package, which Python finds first on ``sys.path`` (``''``, the
working directory, comes before site-packages for ``python -c`` and ``python -m``).

The dev environment cannot show it: its editable install's finder maps ``bitps.ps`` to ``ps/``
whatever the working directory holds. So the wheel goes into a fresh venv that has no such
finder; a ``.pth`` there names this environment's site-packages for the dependencies (numpy,
zmq, grpc...), and a ``.pth`` path line does not run that directory's own ``.pth`` files, so the
editable finder stays out.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Not sources of the wheel; a stale build/ would even put removed modules into it.
_NOT_COPIED = {".git", ".venv", "build", "dist", "runs", "results", "__pycache__",
               ".pytest_cache", ".ruff_cache"}


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> tuple[Path, Path]:
    """An interpreter with the wheel built from this checkout installed normally, and its
    site-packages."""
    tmp = tmp_path_factory.mktemp("install-root")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda _, names: [
        n for n in names if n in _NOT_COPIED or n.endswith(".egg-info")])
    # --no-build-isolation: this venv's setuptools builds it, nothing is downloaded for the build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp / "wheel")],
                   check=True, cwd=tmp)
    (wheel,) = (tmp / "wheel").glob("bitps-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    (purelib,) = (env_dir / "lib").glob("python*/site-packages")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", str(purelib), str(wheel)],
                   check=True, cwd=tmp)
    (purelib / "dev-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return env_dir / "bin" / "python", purelib


def _run(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**env, "PYTHONNOUSERSITE": "1"})


def test_the_installed_package_imports_from_the_repository_root(fresh_python):
    python, purelib = fresh_python
    done = _run(python, "-c", "import bitps.ps, bitps.worker; print(bitps.ps.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(purelib), done.stdout


def test_the_shard_program_runs_from_the_repository_root(fresh_python):
    python, _ = fresh_python
    done = _run(python, "-m", "bitps.ps", "--help")
    assert done.returncode == 0, done.stderr
    assert "bitps-server" in done.stdout, done.stdout
