"""Import layering: native <- proto <- ps, worker; ps and worker never import each other; no
torch in ps/ (checked statically over every module and at run time). Every project import goes
through the one installed namespace, ``bitps.<subpackage>``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"native", "proto", "ps", "worker", "bench"}
ALLOWED = {
    "native": set(),
    "proto": {"native"},
    "ps": {"native", "proto"},
    "worker": {"native", "proto"},
    "bench": {"native", "proto", "ps", "worker"},
}
FORBIDDEN_THIRD_PARTY = {"ps": {"torch", "transformers"}, "native": {"torch", "zmq", "grpc"},
                         "proto": {"torch"}}


def _imports(path: Path) -> set[str]:
    """The project subpackages (``ps`` for ``bitps.ps...``) and third-party top-level names that
    ``path`` imports; a bare project name (``import ps``) shows as ``bare:ps``, the public API
    (``import bitps``, ``from bitps import PSModel``) as ``bitps``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()

    def add(dotted: str, imported: tuple[str, ...] = ()) -> None:
        parts = dotted.split(".")
        if parts[0] in PROJECT or parts[0] == "tests":
            names.add(f"bare:{parts[0]}")
        elif parts[0] != "bitps":
            names.add(parts[0])
        elif len(parts) > 1:
            names.add(parts[1])
        else:
            sub = {n for n in imported if n in PROJECT}
            names.update(sub)
            if set(imported) - sub - {"__version__"}:  # the version is not the lazy API
                names.add("bitps")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            add(node.module, tuple(a.name for a in node.names))
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_layering(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if name in PROJECT and name != package and name not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if name.startswith("bare:") or name == "bitps":
                bad.append(f"{path.relative_to(ROOT)} imports {name} (use bitps.<subpackage>)")
            if name in FORBIDDEN_THIRD_PARTY.get(package, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_nothing_imports_tests():
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            assert "bare:tests" not in _imports(path), path


def test_shard_runs_without_torch():
    code = ("import sys, bitps, bitps.ps, bitps.ps.__main__, bitps.native, bitps.proto; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'bitps.worker' not in sys.modules, 'worker imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
