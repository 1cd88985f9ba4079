"""The worker side stays small enough to hold in one's head (issue 25): the data client's
public surface and size, every product module's size, and a transport that reads no
compression setting (those are the encoder's, ``worker.training.encoder``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("ps", "worker", "proto", "native")
COMPRESSION = {"push_codec", "pull_codec", "compress_min_bytes", "clip_norm", "codec_seed"}


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_data_client_has_at_most_15_public_members_and_400_lines():
    path = ROOT / "worker" / "transport" / "client.py"
    members = {f.name for f in _class(path, "PSClient").body
               if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
               and not f.name.startswith("_")}
    assert len(members) <= 15, sorted(members)
    assert len(path.read_text().splitlines()) <= 400


def test_no_product_module_is_over_600_lines():
    big = {str(p.relative_to(ROOT)): n for d in PRODUCT for p in (ROOT / d).rglob("*.py")
           if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > 600}
    assert not big, big


def _reads_config(node: ast.AST) -> bool:
    """``cfg.<setting>`` or ``<x>.cfg.<setting>``: a read of a ``ClientConfig`` field (the wire
    fields of a registration, which the encoder fills, are not settings)."""
    value = getattr(node, "value", None)
    return (isinstance(value, ast.Name) and value.id == "cfg") or (
        isinstance(value, ast.Attribute) and value.attr == "cfg")


def test_the_transport_reads_no_compression_setting():
    bad = [(str(p.relative_to(ROOT)), node.lineno, node.attr)
           for p in sorted((ROOT / "worker" / "transport").glob("*.py"))
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.Attribute) and node.attr in COMPRESSION
           and _reads_config(node)]
    assert not bad, bad
