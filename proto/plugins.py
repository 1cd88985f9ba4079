"""Loading plug-ins: modules, outside bitps, that register codecs, update rules, consistency
modes or worker algorithms when imported (docs/plugins.md).

A program that takes plug-ins (``bitps-server``, ``bitps-worker``, ``bitps-pipeline``) imports
them before it reads any other setting (``proto.settings.Program.load_plugins``), so the names
they register are valid choices of ``--push-codec``, ``--optimizer``, ``--mode`` and
``--algorithm``. Each is named as one of:

- a module name importable on ``sys.path`` (``mycompany.bitps_codecs``; add its folder to
  ``PYTHONPATH``), imported as ``importlib.import_module`` does;
- a path to a ``.py`` file (``plugins/int8_codec.py``, relative to the working directory),
  imported as a module of its own named ``bitps_plugin_<stem>``.

Loading is idempotent: a module already imported (the same name, or the same resolved file) is
not run again, so a program that reads its settings twice registers nothing twice. A plug-in
that cannot be imported (missing, a syntax error, an exception while it runs, a name it
registers that is taken) is a :class:`PluginError` naming it and the error; the programs exit
with status 2, as for any refused setting.

Plug-ins are never found implicitly (no entry-point scan): code runs in a shard only when its
command line, environment or config file names it.

    load_plugins(["plugins/int8_codec.py", "mycompany.rules"], source="--plugin")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

__all__ = ["PluginError", "load_plugin", "load_plugins", "split_names"]

_BY_PATH: dict[Path, ModuleType] = {}
"""The plug-in files loaded in this process, by resolved path."""


class PluginError(ValueError):
    """A plug-in could not be loaded; the message names it, where it was named (a flag, an
    environment variable or a config-file key) and what went wrong."""


def split_names(values: Iterable[str]) -> list[str]:
    """The plug-in names in ``values``, each of which may list several separated by commas
    (``--plugin a,b --plugin c``), blanks around them dropped, empty ones skipped, each name
    once (in first-seen order)."""
    out: list[str] = []
    for value in values:
        for name in value.split(","):
            if (name := name.strip()) and name not in out:
                out.append(name)
    return out


def _is_path(name: str) -> bool:
    return name.endswith(".py") or os.sep in name or (os.altsep or os.sep) in name


def _load_file(path: Path) -> ModuleType:
    resolved = path.resolve()
    if resolved in _BY_PATH:
        return _BY_PATH[resolved]
    if not resolved.is_file():
        raise FileNotFoundError(f"no such file {str(path)!r}")
    stem = "".join(c if c.isalnum() else "_" for c in resolved.stem)
    name = f"bitps_plugin_{stem}"
    if name in sys.modules:
        raise ImportError(f"module name {name!r} is taken by {sys.modules[name]!r}; rename "
                          f"the file")
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import would: dataclasses and pickling look it up
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _BY_PATH[resolved] = module
    return module


def load_plugin(name: str, *, source: str = "plug-in") -> ModuleType:
    """Import the plug-in ``name`` (a module name or a ``.py`` path, the module docstring)
    once; :class:`PluginError` naming it and ``source`` when it cannot be."""
    what = "file" if _is_path(name) else "module"
    try:
        if _is_path(name):
            return _load_file(Path(name))
        return importlib.import_module(name)
    except Exception as err:  # whatever the plug-in raised: refused as a setting, with it
        hint = ("; a module name must be importable on sys.path (PYTHONPATH), or give the path "
                "of its .py file" if isinstance(err, ModuleNotFoundError) and err.name == name
                else "")
        raise PluginError(f"{source}: plug-in {what} {name!r} could not be loaded: "
                          f"{type(err).__name__}: {err}{hint}") from err


def load_plugins(names: Iterable[str], *, source: str = "plug-in") -> list[ModuleType]:
    """:func:`load_plugin` each of ``names`` in order (a failure stops at that one; the ones
    before it stay loaded)."""
    return [load_plugin(name, source=source) for name in names]
