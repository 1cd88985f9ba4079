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


# worker/ by concern: the transport moves bytes (no torch, no algorithm, no training code); the
# algorithms plug into it; nothing below the launcher imports the launcher.
WORKER_ALLOWED = {
    "transport": set(),
    "memory": set(),
    "training": {"transport", "memory"},
    "algorithms": {"transport", "training"},
    "pipeline": {"transport", "training", "algorithms", "memory"},
    "launch": {"transport", "training", "algorithms", "memory", "pipeline"},
}


def _worker_imports(path: Path) -> set[str]:
    """The ``bitps.worker`` subpackages (``transport`` for ``bitps.worker.transport...``) that
    ``path`` imports, and its third-party top-level names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        dotted = []
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            dotted = [node.module]
            if node.module == "bitps.worker":
                dotted = [f"bitps.worker.{a.name}" for a in node.names]
        for name in dotted:
            parts = name.split(".")
            if parts[:2] == ["bitps", "worker"] and len(parts) > 2:
                names.add(parts[2])
            elif parts[0] != "bitps":
                names.add(parts[0])
    return names


@pytest.mark.parametrize("sub", sorted(WORKER_ALLOWED))
def test_worker_subpackages_follow_their_layering(sub):
    modules = sorted((ROOT / "worker" / sub).rglob("*.py"))
    assert modules, f"worker/{sub} is empty"
    bad = []
    for path in modules:
        for name in _worker_imports(path):
            if name in WORKER_ALLOWED and name != sub and name not in WORKER_ALLOWED[sub]:
                bad.append(f"{path.relative_to(ROOT)} imports worker.{name}")
            if sub == "transport" and name in {"torch", "transformers"}:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_the_transport_runs_without_torch_or_algorithms():
    """Importing the transport alone loads no torch and no training code (the package's
    ``__init__`` registers the algorithms' push policies, which are torch-free too)."""
    code = ("import sys, bitps.worker.transport.client, bitps.worker.transport.channel; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not [m for m in sys.modules if m.startswith('bitps.worker.training')]")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


PIPELINE_PURE = ("actions", "errors", "schedules", "simulate", "partition", "microbatch",
                 "config")


def test_the_pipeline_plan_is_checked_without_torch():
    """Schedules, the simulator, the partitioner, the tuner and ParallelConfig import no torch
    (statically and in a fresh interpreter): a launcher refuses a bad plan before it loads
    torch or starts anything."""
    bad = [f"worker/pipeline/{mod}.py imports torch" for mod in PIPELINE_PURE
           if "torch" in _worker_imports(ROOT / "worker" / "pipeline" / f"{mod}.py")]
    assert not bad, bad
    code = ("import sys; " + "; ".join(f"import bitps.worker.pipeline.{m}" for m in PIPELINE_PURE)
            + "; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
