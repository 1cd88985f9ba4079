"""``bitps-bench``'s one reader of flags: a scenario's flags are its config dataclass's fields
(``bench/config.py``), and the parsed flags build that dataclass back.

Field ``sizes_mib: tuple[float, ...] = (1, 16, 64)`` with its docstring becomes
``--sizes-mib NUM [NUM ...]``: the flag is the field name with ``-`` for ``_``, the help its
docstring, the type, count and default its annotation and default, the allowed values its
``metadata["choices"]`` (``bitps.proto.settings.CHOICES``, as the programs' dataclasses write
them), ``metadata["metavar"]`` how ``--help`` names the values. A ``bool`` field is a switch
(``--quick``). ``--help`` shows every default the way the configuration reference writes it
(``bitps.proto.settings.format_value``).

Unlike ``bitps-server`` and ``bitps-worker`` (``bitps.proto.settings.Program``), the bench reads
flags only: no environment variable or config file, and options that take several values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any

from bitps.proto.settings import CHOICES, format_value

__all__ = ["HelpFormatter", "add_options", "field_docs", "from_args", "shown_default"]

_METAVARS = {int: "INT", float: "NUM", str: "TEXT"}


@functools.cache
def field_docs(config: type) -> dict[str, str]:
    """Each field of dataclass ``config`` -> its docstring (the string under it), blanks folded
    to one space: its flag's help. A field without one is a :class:`TypeError`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    missing = [f.name for f in dataclasses.fields(config) if f.name not in docs]
    if missing:
        raise TypeError(f"{config.__name__}: fields {missing} have no docstring; a field's "
                        f"docstring is its flag's --help line")
    return docs


def _kind(config: type, f: dataclasses.Field) -> tuple[type, Any]:
    """The type of one value of field ``f`` and argparse's ``nargs`` (``None``: one value)."""
    hint = typing.get_type_hints(config)[f.name]
    if hint in (bool, int, float, str):
        return hint, None
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and args and args[0] in (int, float, str):
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0], "+"
        if all(a is args[0] for a in args):
            return args[0], len(args)
    raise TypeError(f"{config.__name__}.{f.name} is {hint}; an option needs bool, int, float, "
                    f"str or a tuple of one of them")


def add_options(parser: argparse.ArgumentParser, config: type) -> None:
    """Add a flag to ``parser`` for every field of ``config``, in field order."""
    docs = field_docs(config)
    for f in dataclasses.fields(config):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{config.__name__}.{f.name} has no plain default to offer a flag")
        kind, nargs = _kind(config, f)
        flag = "--" + f.name.replace("_", "-")
        help_text = docs[f.name].replace("%", "%%")  # argparse %-formats help strings
        if kind is bool:
            if f.default is not False:
                raise TypeError(f"{config.__name__}.{f.name}: a switch defaults to False, "
                                f"got {f.default!r}")
            parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            continue
        choices = f.metadata.get(CHOICES)
        metavar = f.metadata.get("metavar", None if choices else _METAVARS[kind])
        # a list default: argparse gives lists, and the reference shows an empty one as "—"
        default = list(f.default) if nargs else f.default
        parser.add_argument(flag, dest=f.name, type=kind, nargs=nargs, choices=choices,
                            metavar=metavar, default=default, help=help_text)


def from_args(config: type, args: argparse.Namespace):
    """The ``config`` instance the parsed flags in ``args`` describe."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config)}
    return config(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def shown_default(value: Any) -> str:
    """A default as ``--help`` shows it: as the configuration reference writes it, an empty
    list as ``none``."""
    return format_value(value) or "none"


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with every option's default after its help: ``(default: 1 16 64)``. The
    help strings stay bare, so the reference (``parser_markdown``) gives the default its own
    column."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown = (action.option_strings and action.help is not None
                 and action.default is not argparse.SUPPRESS
                 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)))
        if not shown:
            return action.help
        return f"{action.help} (default: {shown_default(action.default).replace('%', '%%')})"
