"""The configuration reference's Markdown: a settings table's cells (``proto.settings.Program.
markdown``) and :func:`parser_markdown`, a section rendered from a plain argparse parser
(``bitps-launch``, ``bitps-bench``). ``docs/gen_configuration.py`` puts them together.

Only what a page shows is decided here; which settings exist, their defaults and allowed values
are ``proto.settings``'.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Iterator
from typing import Any

from bitps.proto.registry import Names

__all__ = ["cell", "doc_choices", "parser_markdown", "prose"]


def format_value(value: Any) -> str:
    """A value as a config file writes it (``true``, ``0.001``, ``"127.0.0.1"`` is shown
    bare); byte-like powers of two get their size too: ``1048576 (1 MiB)``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value} ({value >> shift} {unit})"
        return str(value)
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return " ".join(format_value(v) for v in value)
    return str(value)


def doc_choices(choices: Collection[str]) -> str:
    """A setting's allowed values as the reference lists them: a registry's live view by the
    names bitps registers itself (the page must not depend on what was loaded when it was
    rendered), and that plug-ins may add more."""
    if isinstance(choices, Names):
        return ("one of " + ", ".join(f"`{c}`" for c in choices.builtin())
                + ", or one a plug-in registers")
    return "one of " + ", ".join(f"`{c}`" for c in choices)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def prose(text: str) -> str:
    """A table cell of plain text: ``<R>`` must not read as an HTML tag."""
    return cell(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def _invocation(a: argparse.Action) -> str:
    """``--sizes-mib SIZES_MIB [SIZES_MIB ...]``: spelled here, not by argparse's formatter,
    whose spelling changed in Python 3.13 (the page must not depend on the Python rendering
    it)."""
    if a.nargs == 0:
        return ", ".join(a.option_strings)
    m = a.metavar if isinstance(a.metavar, str) else (
        "{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
    value = {None: m, "?": f"[{m}]", "*": f"[{m} ...]", "+": f"{m} [{m} ...]"}.get(
        a.nargs, " ".join([m] * a.nargs) if isinstance(a.nargs, int) else m)
    if not a.option_strings:
        return value
    return ", ".join([f"{a.option_strings[0]} {value}", *a.option_strings[1:]])


def _action_rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for a in parser._actions:  # argparse offers no public walk of its actions
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = f"`{_invocation(a)}`"
        if (isinstance(a, argparse._VersionAction) or a.default is None
                or a.default is argparse.SUPPRESS or a.default == []):
            default = "—"
        else:
            default = f"`{format_value(a.default)}`"
        help_text = "" if a.help in (None, argparse.SUPPRESS) else a.help
        try:  # as argparse expands it
            help_text = help_text % dict(vars(a), prog=parser.prog)
        except (KeyError, TypeError, ValueError):
            pass
        yield "| " + " | ".join((cell(flag), cell(default), prose(help_text))) + " |"


def parser_markdown(parser: argparse.ArgumentParser, *, level: int = 2,
                    description: str | None = None) -> str:
    """A reference section rendered from an argparse parser (its sub-commands as
    sub-sections): every option with its default and help, for programs whose flags have no
    environment twin or config file."""
    heading = "#" * level
    out = [f"{heading} `{parser.prog}`", ""]
    if description := description or parser.description:
        out += [description, ""]
    rows = list(_action_rows(parser))
    if rows:
        out += ["| flag | default | meaning |", "|---|---|---|", *rows, ""]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, sub in a.choices.items():
                out.append(parser_markdown(sub, level=level + 1,
                                           description=helps.get(name) or "").rstrip("\n"))
                out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
