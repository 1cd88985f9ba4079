"""Policies are objects, not strings compared across layers: the shard core, its store, checks
and clock table hold no consistency-mode or update-rule branch (``ps.consistency`` and
``ps.rules`` / ``ps.onebit`` do), and the codec module dispatches on no codec id outside the
registered classes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from bitps.ps.config import MODES, OPTIMIZERS, ServerConfig
from bitps.ps.consistency import CONSISTENCY, Consistency, make_consistency

ROOT = Path(__file__).resolve().parents[1]


def _compared_strings(path: Path) -> list[tuple[int, str]]:
    """String constants that appear in a comparison (``==``, ``!=``, ``in``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    found.append((node.lineno, side.value))
    return found


@pytest.mark.parametrize("module", ["ps/shard.py", "ps/checks.py", "ps/clocks.py",
                                    "ps/store.py"])
def test_no_mode_name_is_compared_outside_the_consistency_objects(module):
    bad = [(line, s) for line, s in _compared_strings(ROOT / module) if s in MODES]
    assert not bad, f"{module} compares consistency-mode names: {bad}"


@pytest.mark.parametrize("module", ["ps/shard.py", "ps/checks.py", "ps/store.py",
                                    "ps/consistency.py"])
def test_no_rule_name_is_compared_and_no_algorithm_module_imported_by_the_core(module):
    bad = [(line, s) for line, s in _compared_strings(ROOT / module) if s in OPTIMIZERS]
    assert not bad, f"{module} compares update-rule names: {bad}"
    if module == "ps/shard.py":
        tree = ast.parse((ROOT / module).read_text())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for a in node.names} | {node.module for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom)}
        assert "onebit" not in imported and "bitps.ps.onebit" not in imported


def test_codec_ids_are_compared_only_in_the_registry():
    tree = ast.parse((ROOT / "proto" / "codecs.py").read_text())
    bad = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
           and any(isinstance(s, ast.Attribute) and s.attr.startswith("CODEC_")
                   for s in (node.left, *node.comparators))]
    assert not bad, f"proto/codecs.py compares codec ids at lines {bad}"


def test_every_mode_has_its_object():
    assert set(MODES) <= set(CONSISTENCY)
    for mode in MODES:
        policy = make_consistency(ServerConfig(mode=mode))
        assert isinstance(policy, Consistency) and policy.name == mode


def test_registries_refuse_a_taken_name_and_name_the_registered_ones():
    from bitps.ps.rules import RULES, SGD

    class Again(SGD):
        name = "sgd"

    with pytest.raises(ValueError, match="update rule 'sgd' is already registered"):
        RULES.register(Again)
    with pytest.raises(ValueError, match=r"consistency mode 'bsp'; expected one of \['async'"):
        CONSISTENCY.lookup("bsp")


def test_the_channel_applies_published_codes_without_knowing_any_algorithm():
    """``worker/transport/channel.py`` moves bytes: it imports no torch and no algorithm module, and
    adds codes through the applier it is given (1-bit Adam's momenta are ``OneBitMomentum.add``)."""
    tree = ast.parse((ROOT / "worker" / "transport" / "channel.py").read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not {m for m in modules if m and (m.startswith("torch") or m.endswith(
        ("onebit", "local_sgd", "model")))}, modules
    assert "momentum" not in (ROOT / "worker" / "transport" / "channel.py").read_text()


def test_the_client_holds_no_algorithm_and_the_registration_picks_the_push_policy():
    """``PSClient`` imports no algorithm module; what pushes carry is the push policy the
    shards' registration replies call for (``worker.transport.push_policy``)."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.worker.algorithms.onebit import MomentsPush, SyncMomenta
    from bitps.worker.push_policy import for_registration

    tree = ast.parse((ROOT / "worker" / "transport" / "client.py").read_text())
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in modules if m and m.endswith(("onebit", "local_sgd", "model"))}
    from bitps.worker.algorithms.onebit import OneBitParams

    def reply(mode: str, params=None) -> pb.RegisterReply:
        out = pb.RegisterReply(mode=mode, rule="onebit_adam" if params else "adam")
        if params is not None:
            out.rule_params.Pack(params)
        return out

    params = OneBitParams(freeze_step=4, chunk=256, worker_moments=True)
    assert for_registration(reply("async")) is None
    assert type(for_registration(reply("sync", params))) is SyncMomenta
    assert type(for_registration(reply("ssp", params))) is MomentsPush


# -- no algorithm named in the core ---------------------------------------------------------------
# An algorithm is a plug-in: its rule module (ps/), its worker module (worker/algorithms/) and
# their registrations. The core modules below may mention one in comments and docstrings, never
# in a string constant, an identifier or an attribute name. The update rules of ps/rules.py
# (sgd, momentum, adam, adamw) are the core's own built-ins; the plug-in rules are those
# registered from other modules.
PS_CORE = ["ps/shard.py", "ps/registration.py", "ps/replies.py", "ps/dedup.py",  # the core, split
           "ps/store.py", "ps/consistency.py", "ps/checks.py", "ps/clocks.py", "ps/publish.py",
           "ps/data.py", "ps/control.py", "ps/metrics.py", "ps/config.py"]
WORKER_CORE = sorted(str(p.relative_to(ROOT)) for d in ("transport", "training")
                     for p in (ROOT / "worker" / d).glob("*.py")) + ["worker/metrics.py",
                                                                      "worker/push_policy.py"]
ALGORITHM_WORDS = ("onebit", "freezestep", "localsgd", "diloco")
"""Spelled lower case without underscores (``OneBit``, ``one_bit``, ``freeze_step``, ``LocalSGD``
all match): 1-bit Adam's and local SGD's identifiers."""


def _plugin_rule_names() -> set[str]:
    from bitps.ps.rules import RULES

    return {name for name, cls in RULES.items() if cls.__module__ != "bitps.ps.rules"}


def _plugin_module_words() -> set[str]:
    """The module names of the plug-in rules (``outer`` for ``ps/outer.py``), matched as whole
    words of an identifier (``router`` is not ``outer``)."""
    from bitps.ps.rules import RULES

    return {cls.__module__.rsplit(".", 1)[-1] for cls in RULES.values()
            if cls.__module__ != "bitps.ps.rules"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a string expression statement)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _names_and_strings(path: Path) -> list[tuple[int, str, str]]:
    """``(line, kind, text)`` of every identifier, attribute name, import name, keyword and
    non-docstring string constant in ``path``."""
    tree = ast.parse(path.read_text())
    docs, out = _docstrings(tree), []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs:
            out.append((line, "string", node.value))
        elif isinstance(node, ast.Name):
            out.append((line, "name", node.id))
        elif isinstance(node, ast.Attribute):
            out.append((line, "attribute", node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, "definition", node.name))
        elif isinstance(node, ast.arg):
            out.append((line, "argument", node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((line, "keyword", node.arg))
        elif isinstance(node, ast.alias):
            out.extend((line, "import", n) for n in (node.name, node.asname) if n)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((line, "import", node.module))
    return out


def _words(name: str) -> set[str]:
    """The words of an identifier or dotted name, lower case: ``bitps.ps.outer`` -> bitps, ps,
    outer; ``OuterRule`` -> outer, rule."""
    return {w.lower() for part in re.split(r"[._]", name)
            for w in [part, *re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", part)] if w}


def _algorithm_names(module: str) -> list[tuple[int, str, str]]:
    """What in ``module`` names an algorithm: an identifier or string holding one of
    :data:`ALGORITHM_WORDS`, an identifier with a plug-in rule module's name as a word, a
    string holding a plug-in rule's name."""
    rules, words = _plugin_rule_names(), _plugin_module_words()
    bad = []
    for line, kind, text in _names_and_strings(ROOT / module):
        flat = text.lower().replace("_", "")
        if any(w in flat for w in ALGORITHM_WORDS) \
                or (kind != "string" and _words(text) & words) \
                or (kind == "string" and any(r in text for r in rules)):
            bad.append((line, kind, text))
    return bad


@pytest.mark.parametrize("module", PS_CORE)
def test_the_shard_core_names_no_algorithm(module):
    bad = _algorithm_names(module)
    assert not bad, f"{module} names an algorithm (line, kind, text): {bad}"


@pytest.mark.parametrize("module", WORKER_CORE)
def test_the_worker_core_names_no_algorithm(module):
    bad = _algorithm_names(module)
    assert not bad, f"{module} names an algorithm (line, kind, text): {bad}"


def test_the_shard_modules_import_no_cycle():
    """``ps/`` imports form no cycle, type-checking imports included (the store knows no rule,
    the consistency modes see the core through ``ps.consistency.Core``)."""
    graph = {}
    for path in (ROOT / "ps").glob("*.py"):
        tree = ast.parse(path.read_text())
        found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module} | {a.name for node in ast.walk(tree)
                                     if isinstance(node, ast.Import) for a in node.names}
        found |= {f"bitps.ps.{a.name}" for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "bitps.ps"
                  for a in node.names}
        graph[path.stem] = {m.split(".")[2] for m in found
                            if m.startswith("bitps.ps.") and len(m.split(".")) > 2}
    cycles, done = [], set()

    def visit(node, stack):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, stack + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert not cycles, f"import cycles in ps/: {[' -> '.join(c) for c in cycles]}"
