"""Import layering: native <- proto <- ps, worker; ps and worker never import each other; no
torch in ps/ (checked statically over every module and at run time)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"native", "proto", "ps", "worker", "bench", "tests"}
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
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_layering(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if name in PROJECT and name != package and name not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if name in FORBIDDEN_THIRD_PARTY.get(package, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_nothing_imports_tests():
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            assert "tests" not in _imports(path), path


def test_shard_runs_without_torch():
    code = ("import sys, ps, ps.__main__, native, proto; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'worker' not in sys.modules, 'worker imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
