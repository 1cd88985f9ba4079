"""Policies are objects, not strings compared across layers: the shard core, its store, checks
and clock table hold no consistency-mode or update-rule branch (``ps.consistency`` and
``ps.rules`` / ``ps.onebit`` do), and the codec module dispatches on no codec id outside the
registered classes."""

from __future__ import annotations

import ast
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
    params = pb.OneBitParams(freeze_step=4, chunk=256, worker_moments=True)
    assert for_registration(pb.RegisterReply(mode="async")) is None
    assert type(for_registration(pb.RegisterReply(mode="sync", onebit=params))) is SyncMomenta
    assert type(for_registration(pb.RegisterReply(mode="ssp", onebit=params))) is MomentsPush
