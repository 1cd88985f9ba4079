"""Import layering, checked statically over every module of the product (``ps/``, ``worker/``,
``proto/``, ``native/``, ``bench/`` and the public API package), with every import counted:
absolute and relative (``from . import x`` resolved to ``bitps.<...>.x``), function-local and
``if TYPE_CHECKING:`` ones alike.

- native <- proto <- ps, worker <- bench; ps and worker never import each other; no torch in
  ps/ (checked statically and at run time). Every project import goes through the one installed
  namespace, ``bitps.<subpackage>``; the product never imports the lazy public API.
- worker/ by concern (``WORKER_ALLOWED``), its root-level modules included.
- No program (a ``__main__`` module or a console-script target of setup.cfg) imports another
  program: what two programs share lives in a library module.
- No two product modules import each other, directly or through a loop (the strongly connected
  components of the module import graph), except the cycles listed in ``PENDING_CYCLES``.
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
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


# -- the module graph ----------------------------------------------------------------------------
def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _pairs(text: str) -> Iterator[tuple[str, str]]:
    """``a = b`` lines of a setup.cfg value, as ``(a, b)``."""
    for line in text.strip().splitlines():
        left, _, right = line.partition("=")
        yield left.strip(), right.strip()


@cache
def modules() -> dict[str, Path]:
    """Every installed module's dotted name -> its source file, from setup.cfg's
    ``package_dir`` (the one map of folders to ``bitps.*`` packages)."""
    found = {}
    for package, folder in _pairs(_setup_cfg()["options"]["package_dir"]):
        for path in sorted((ROOT / folder).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


@cache
def programs() -> frozenset[str]:
    """The modules a process starts in: every ``__main__`` and every console-script target."""
    scripts = _setup_cfg()["options.entry_points"]["console_scripts"]
    targets = {target.partition(":")[0] for _, target in _pairs(scripts)}
    assert targets <= modules().keys(), targets - modules().keys()
    return frozenset(targets | {m for m in modules() if m.endswith(".__main__")})


def _base(package: str, level: int) -> str:
    """The package a ``level``-dot relative import in a module of ``package`` starts from."""
    parts = package.split(".")
    if level - 1 >= len(parts):
        raise AssertionError(f"{package}: relative import beyond the top-level package")
    return ".".join(parts[:len(parts) - (level - 1)])


def imports_in(source: str, package: str) -> frozenset[str]:
    """What a module of ``package`` whose text is ``source`` imports, anywhere in it: project
    modules by dotted name (``bitps.ps.store``; ``from pkg import name`` is ``pkg.name`` when
    that is a module, else ``pkg``; relative imports resolved), ``bitps:<names>`` for the
    lazy public API (its ``__version__`` aside), ``bare:<name>`` for a project folder imported
    without ``bitps.``, and third-party packages by top-level name."""
    out = set()

    def add(dotted: str, names: tuple[str, ...] = ()) -> None:
        top = dotted.split(".")[0]
        if top in PROJECT or top == "tests":
            out.add(f"bare:{top}")
        elif top != "bitps":
            out.add(top)
        elif not names:
            out.add("bitps:*" if dotted == "bitps" else dotted)
        else:
            out.update(f"{dotted}.{n}" for n in names if f"{dotted}.{n}" in modules())
            rest = [n for n in names if f"{dotted}.{n}" not in modules()]
            if dotted == "bitps" and set(rest) - {"__version__"}:
                out.add("bitps:" + ",".join(rest))
            elif rest:
                out.add(dotted)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level:
                base = _base(package, node.level)
                add(f"{base}.{node.module}" if node.module else base, names)
            else:
                add(node.module, names)
    return frozenset(out)


@cache
def imports(module: str) -> frozenset[str]:
    """:func:`imports_in` of the installed module ``module``."""
    path = modules()[module]
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    return imports_in(path.read_text(), package)


def test_every_kind_of_import_is_seen_and_resolved():
    source = """
from typing import TYPE_CHECKING
from . import actions, not_a_module
from .simulate import check
from ..config import ClientConfig
from ... import __version__
import numpy.linalg
if TYPE_CHECKING:
    from bitps.ps import shard
def f():
    import torch
    from bitps import PSModel
    import bitps
"""
    assert imports_in(source, "bitps.worker.pipeline") == {
        "typing", "bitps.worker.pipeline.actions", "bitps.worker.pipeline",
        "bitps.worker.pipeline.simulate", "bitps.worker.config", "numpy", "bitps.ps.shard",
        "bitps", "torch", "bitps:PSModel", "bitps:*"}
    assert imports_in("from worker.config import ClientConfig", "bitps.ps") == {"bare:worker"}
    with pytest.raises(AssertionError, match="beyond the top-level package"):
        imports_in("from .... import x", "bitps.worker.pipeline")


def _layer(module: str) -> str:
    """``ps`` for ``bitps.ps.store``; ``bitps`` for the public API package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "bitps"


def _where(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))


# -- layering ------------------------------------------------------------------------------------
def test_every_folder_of_package_dir_is_seen():
    found = {_layer(m) for m in modules()}
    assert found == PROJECT | {"bitps"}, found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_layering(package):
    bad = []
    for module in (m for m in modules() if _layer(m) == package):
        for name in imports(module):
            if name.startswith("bitps.") and name in modules():
                layer = _layer(name)
                if layer != package and layer not in ALLOWED[package]:
                    bad.append(f"{_where(module)} imports {name}")
            elif name.startswith(("bare:", "bitps:")) or name.startswith("bitps."):
                bad.append(f"{_where(module)} imports {name} (use bitps.<subpackage>.<module>)")
            elif name in FORBIDDEN_THIRD_PARTY.get(package, ()):
                bad.append(f"{_where(module)} imports {name}")
    assert not bad, "\n".join(bad)


def test_nothing_imports_tests():
    bad = [_where(m) for m in modules() if "bare:tests" in imports(m)]
    assert not bad, "\n".join(bad)


def test_shard_runs_without_torch():
    code = ("import sys, bitps, bitps.ps, bitps.ps.__main__, bitps.native, bitps.proto; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'bitps.worker' not in sys.modules, 'worker imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# worker/ by concern: the transport moves bytes (no torch, no algorithm, no training code); the
# algorithms plug into it; nothing below the launcher imports the launcher. The root-level
# modules are units too: config and metrics sit under everything, demo (the demo model and
# corpus) under the pipeline, __main__ (bitps-worker) over everything.
_BASE = {"config", "metrics"}
WORKER_ALLOWED = {
    "config": set(),
    "metrics": set(),
    "demo": set(),
    # the push-policy interface and registry: the encoder holds a policy, the algorithms
    # register theirs; it adds published codes through the transport's CodeApplier
    "push_policy": {"transport"},
    "transport": _BASE,
    "memory": _BASE,
    "training": {"transport", "memory", "push_policy"} | _BASE,
    "algorithms": {"transport", "training", "push_policy"} | _BASE,
    # the loops people already have (Trainer, Lightning): on top of the training layer
    "integrations": {"transport", "training"} | _BASE,
    "pipeline": {"transport", "training", "algorithms", "memory", "demo"} | _BASE,
    "launch": {"transport", "training", "algorithms", "memory", "pipeline", "demo"} | _BASE,
    "__main__": {"transport", "training", "algorithms", "memory", "pipeline", "launch",
                 "demo"} | _BASE,
    "__init__": {"transport", "training", "algorithms"} | _BASE,
}


def _worker_unit(module: str) -> str:
    """``transport`` for ``bitps.worker.transport.client``, ``config`` for
    ``bitps.worker.config``, ``__init__`` for ``bitps.worker`` itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_every_worker_module_has_a_unit():
    units = {_worker_unit(m) for m in modules() if _layer(m) == "worker"}
    assert units <= WORKER_ALLOWED.keys(), units - WORKER_ALLOWED.keys()


@pytest.mark.parametrize("unit", sorted(WORKER_ALLOWED))
def test_worker_modules_follow_their_layering(unit):
    mine = [m for m in modules() if _layer(m) == "worker" and _worker_unit(m) == unit]
    assert mine, f"worker unit {unit} has no module"
    bad = []
    for module in mine:
        for name in imports(module):
            if name in modules() and _layer(name) == "worker":
                other = _worker_unit(name)
                if other != unit and other not in WORKER_ALLOWED[unit]:
                    bad.append(f"{_where(module)} imports {name}")
            if unit in {"transport", "config", "metrics"} and name in {"torch", "transformers"}:
                bad.append(f"{_where(module)} imports {name}")
    assert not bad, "\n".join(bad)


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
    torch or starts anything. The stage's settings module loads torch only once a model is
    needed (on first use of its registry)."""
    bad = [f"worker/pipeline/{mod}.py imports torch" for mod in PIPELINE_PURE
           if "torch" in imports(f"bitps.worker.pipeline.{mod}")]
    assert not bad, "\n".join(bad)
    code = ("import sys; " + "; ".join(f"import bitps.worker.pipeline.{m}"
                                       for m in (*PIPELINE_PURE, "settings"))
            + "; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# -- programs ------------------------------------------------------------------------------------
def test_no_program_imports_another_program():
    """A program parses flags, sets signal handlers and logging for its own process; what two
    programs share (a parser, a check, a diagnosis, a model) belongs in a library module."""
    bad = [f"{_where(p)} ({p}) imports the program {q}"
           for p in sorted(programs()) for q in sorted(imports(p) & programs()) if q != p]
    assert not bad, "\n".join(bad)


# -- cycles --------------------------------------------------------------------------------------
# Cycles that other work in progress (issue 25) removes. Whoever breaks one deletes its entry:
# the test fails while a listed cycle no longer exists, and for any cycle not listed.
PENDING_CYCLES: set[frozenset[str]] = set()
"""Cycles known and being removed (each must still exist; none is left since issue 25)."""


def _short(module: str) -> str:
    return module.removeprefix("bitps.")


def _graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports (the API package left out: it imports
    nothing, its exports resolve on first use)."""
    product = {m for m in modules() if _layer(m) in PROJECT}
    return {m: {n for n in imports(m) if n in product and n != m} for m in product}


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_strongly_connected_finds_loops_and_only_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert set(strongly_connected(graph)) == {frozenset("abc"), frozenset("de")}
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other():
    graph = _graph()
    cycles = {frozenset(map(_short, c)) for c in strongly_connected(graph)}

    def words(c: frozenset[str]) -> str:
        edges = sorted(f"{_short(a)} -> {_short(b)}" for a in c for b in graph[f"bitps.{a}"]
                       if _short(b) in c)
        return "{" + ", ".join(sorted(c)) + "}: " + "; ".join(edges)

    new = sorted(map(words, cycles - PENDING_CYCLES))
    gone = sorted("{" + ", ".join(sorted(c)) + "}" for c in PENDING_CYCLES - cycles)
    assert not new and not gone, "\n".join(
        [f"import cycle {c}" for c in new]
        + [f"PENDING_CYCLES lists {c}, which is no longer a cycle: remove it" for c in gone])
