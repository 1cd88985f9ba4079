"""One reader for every program's settings: a command-line flag, its environment twin, a key of
a TOML config file and a default, each setting declared once, as a :class:`Setting`.

A value comes from the first source that has one::

    --grpc-port 50051  >  BITPS_GRPC_PORT=50051  >  grpc-port = 50051 in --config FILE  >  default

Every source is converted and checked the same way (type, then allowed values); a value that
cannot be read is a :class:`SettingError` naming its source (flag, environment variable or
config-file key), the value received and what was expected.

Where things are written:

- a setting bound to a dataclass field (:func:`from_field`) takes its default from the field and
  its allowed values from the field's ``metadata["choices"]`` (the tuple its ``__post_init__``
  checks), so the dataclass is the one place that states them;
- a setting of a program alone (:func:`option`: how long to train, where to log) states its
  default in its one declaration;
- help text, flag name and environment name are in each program's table
  (``ps/__main__.py``, ``worker/__main__.py``).

Allowed values may be a registry's live view (``proto.registry.Names``: ``--optimizer``,
``--mode``, ``--push-codec``, ``--algorithm``): a name registered later, by a plug-in, is
accepted, listed by ``--help`` and named in errors; the configuration reference lists the
names bitps registers itself. A program that takes plug-ins (``Program.plugins``) imports the
modules ``--plugin`` names (or ``BITPS_PLUGINS``, or the config file's ``plugins`` key: the
first of them that names any) before it reads any other setting (``proto.plugins``).

Booleans: ``1 true yes on`` and ``0 false no off``, in any case, for flags (``--nesterov``,
``--nesterov=false``, ``--no-nesterov``) and environment variables alike; a config file uses
TOML's ``true``/``false``.

The config file is flat: its keys are the flag names without the leading ``--``
(``grpc-port = 50051``), one spelling only. An unknown key or a value of the wrong type is an
error naming the key. The one exception is a group of settings a program declares as a table
(``Setting.table``): they are read from that table only, under their field names, the way the
Python dict of that group spells them (``[parallel_config]`` ``micro_batch_size = 8`` for
``--micro-batch-size``).

No torch, zmq or grpc here: shards and workers both read their settings through it, and
``bitps.proto`` may import neither ``bitps.ps`` nor ``bitps.worker``, so the programs hand their
tables in (:class:`Program`) and ``docs/gen_configuration.py`` renders them all (the Markdown
cells are ``proto.reference``'s).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitps import __version__
from bitps.proto.plugins import load_plugins, split_names
from bitps.proto.reference import cell, doc_choices, format_value, parser_markdown, prose
from bitps.proto.registry import Names

if sys.version_info >= (3, 11):
    import tomllib
else:  # 3.10: the same parser, from PyPI
    import tomli as tomllib

__all__ = ["BOOL_SPELLINGS", "CHOICES", "FALSE_WORDS", "PLUGINS_ENV", "PLUGINS_KEY",
           "TRUE_WORDS", "Program", "Resolved", "Setting", "SettingError", "config_plugins",
           "env_name", "format_value", "from_field", "option", "parse_bool", "parser_markdown",
           "read_config_file"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
BOOL_SPELLINGS = f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)} (any case)"
CHOICES = "choices"
"""The dataclass field metadata key listing a field's allowed values."""
ENV_PREFIX = "BITPS_"
PLUGINS_ENV = ENV_PREFIX + "PLUGINS"
"""The environment twin of ``--plugin``: comma-separated plug-ins."""
PLUGINS_KEY = "plugins"
"""The config-file key of ``--plugin``: a string (comma-separated) or an array of strings."""
_PLUGIN_HELP = ("import this plug-in (a module name on sys.path, or a .py file) before the other "
                "settings are read, so that the codecs, update rules, consistency modes and "
                "worker algorithms it registers are valid choices; repeatable, or several "
                "comma-separated (docs/plugins.md)")

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "text"}
_TOML_KINDS = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
               dict: "table"}
_TOML_EXPECTED = {bool: "a boolean", int: "an integer", float: "a number (integer or float)",
                  str: "a string"}
_METAVARS = {int: "INT", float: "NUM", str: "TEXT"}
_TYPE_NAMES = {"bool": bool, "int": int, "float": float, "str": str}
_AUTO: Any = object()  # env=_AUTO: BITPS_ + the flag name
_UNSET: Any = object()  # a flag not given on the command line
_BARE: Any = object()  # a boolean flag given without a value


class SettingError(ValueError):
    """A setting's value was refused. The message names where the value came from (a flag, an
    environment variable or a config-file key), the value received and what was expected."""


def parse_bool(text: str, *, source: str) -> bool:
    """``True`` for 1/true/yes/on, ``False`` for 0/false/no/off (any case, surrounding blanks
    ignored); anything else is a :class:`SettingError` naming ``source``. The one boolean
    reader of every flag and environment variable."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise SettingError(f"{source}: got {text!r}; expected a boolean, {BOOL_SPELLINGS}")


def env_name(name: str) -> str:
    """The environment twin of flag ``--<name>``: ``grpc-port`` -> ``BITPS_GRPC_PORT``."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def _toml_kind(value: Any) -> str:
    for kind, name in _TOML_KINDS.items():
        if isinstance(value, kind):
            return name
    return type(value).__name__


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One setting of a program: the flag ``--<name>``, the config-file key ``<name>``, the
    environment variable ``env`` (``None``: none), a type, a default and the allowed values.
    Build it with :func:`from_field` or :func:`option`, which take the default from where it
    is written."""

    name: str
    """The flag without its dashes, e.g. ``grpc-port``; also the config-file key (outside a
    :attr:`table`)."""
    help: str
    """One line for ``--help`` and the configuration reference."""
    type: type
    """``bool``, ``int``, ``float`` or ``str``."""
    default: Any
    choices: Collection[str] | None = None
    """The allowed values (strings only), or ``None`` for any value of the type. A registry's
    live view (``RULES.keys()``) stays live: a name registered after the program was built is
    accepted."""
    env: str | None = None
    """The environment variable read when the flag is not given; ``None``: none."""
    owner: type | None = None
    """The dataclass whose field this setting fills; ``None``: a setting of the program."""
    field: str = ""
    """That field's name."""
    metavar: str | None = None
    """How ``--help`` names the value (default: by type, ``INT``, ``NUM``, ``TEXT``)."""
    table: str = ""
    """The config-file table this setting is read from, under :attr:`file_key`; ``""``: the
    top level, under :attr:`name`."""

    def __post_init__(self) -> None:
        if self.type not in _KINDS:
            raise TypeError(f"setting {self.name!r}: type {self.type!r}; expected one of "
                            f"bool, int, float, str")
        if not self.name or not self.name.replace("-", "").isalnum() or self.name[0] == "-":
            raise TypeError(f"setting name {self.name!r}; expected letters, digits and inner "
                            f"dashes (the flag without its leading --)")
        if self.choices is not None and self.default not in self.choices:
            raise TypeError(f"setting {self.name!r}: default {self.default!r} is not one of "
                            f"{self.choices}")
        if self.choices is not None and self.type is not str:
            raise TypeError(f"setting {self.name!r}: choices need type str, got {self.type}")

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def dest(self) -> str:
        """The attribute name in the parsed namespace."""
        return self.name.replace("-", "_")

    @property
    def file_key(self) -> str:
        """Its key in a config file: the flag name, or in a table the dest name."""
        return self.dest if self.table else self.name

    @property
    def target(self) -> str:
        """``Owner.field`` it fills, or ``""``."""
        return f"{self.owner.__name__}.{self.field}" if self.owner is not None else ""

    @property
    def kind(self) -> str:
        """What a value must be, in words (for errors and the reference)."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        return _KINDS[self.type]

    def from_text(self, text: str, *, source: str) -> Any:
        """The value of a flag's or an environment variable's text."""
        if self.type is bool:
            return parse_bool(text, source=source)
        if self.type is str:
            return self.check(text, source=source)
        try:
            value = self.type(text.strip())
        except ValueError:
            raise SettingError(f"{source}: got {text!r}; expected {self.kind}") from None
        return self.check(value, source=source)

    def from_toml(self, value: Any, *, source: str) -> Any:
        """The value of a config-file entry: a TOML value of this setting's type (an integer
        is a number too); booleans are never numbers."""
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type)
        if not ok:
            raise SettingError(f"{source}: got {value!r} ({_toml_kind(value)}); expected "
                               f"{_TOML_EXPECTED[self.type]}"
                               + (f", one of {', '.join(self.choices)}" if self.choices else ""))
        return self.check(self.type(value), source=source)

    def check(self, value: Any, *, source: str) -> Any:
        if self.choices is not None and value not in self.choices:
            hint = (" (a plug-in's name is one once --plugin loads it)"
                    if isinstance(self.choices, Names) else "")
            raise SettingError(f"{source}: got {value!r}; expected {self.kind}{hint}")
        return value

    def help_line(self) -> str:
        """``help`` with the default and the environment twin, as ``--help`` shows it."""
        where = f"; env {self.env}" if self.env else ""
        return f"{self.help} (default: {format_value(self.default)}{where})"


def from_field(owner: type, field: str, *, help: str, name: str | None = None,
               env: str | None = _AUTO, metavar: str | None = None, table: str = "") -> Setting:
    """The setting that fills ``owner.field``: its type and default come from the dataclass
    field, its allowed values from the field's ``metadata["choices"]``. The flag is
    ``--<name>`` (default: the field name, ``_`` written ``-``); the environment twin is
    ``env`` (default: ``BITPS_`` + the flag name; ``None``: none); ``table``: the config-file
    table it is read from (``""``: the top level)."""
    fields = {f.name: f for f in dataclasses.fields(owner)}
    if field not in fields:
        raise TypeError(f"{owner.__name__} has no field {field!r}; its fields are "
                        f"{sorted(fields)}")
    f = fields[field]
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{owner.__name__}.{field} has no plain default to offer a flag")
    kind = f.type if isinstance(f.type, type) else _TYPE_NAMES.get(f.type)
    if kind is None:
        raise TypeError(f"{owner.__name__}.{field} is {f.type!r}; a setting needs bool, int, "
                        f"float or str")
    name = name or field.replace("_", "-")
    choices = f.metadata.get(CHOICES)
    return Setting(name=name, help=help, type=kind, default=f.default,
                   choices=_choices(choices),
                   env=env_name(name) if env is _AUTO else env, owner=owner, field=field,
                   metavar=metavar, table=table)


def option(name: str, *, default: bool | int | float | str, help: str,
           choices: Sequence[str] | None = None, env: str | None = _AUTO,
           metavar: str | None = None) -> Setting:
    """A setting of the program alone (no dataclass field), its default stated here."""
    return Setting(name=name, help=help, type=type(default), default=default,
                   choices=_choices(choices),
                   env=env_name(name) if env is _AUTO else env, metavar=metavar)


def _choices(choices: Collection[str] | None) -> Collection[str] | None:
    """A fixed list as a tuple; a set-like view (a registry's keys) as it is, so it stays
    live."""
    if choices is None or isinstance(choices, Set):
        return choices
    return tuple(choices)


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise SettingError(f"config file {str(path)!r}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingError(f"config file {str(path)!r} is not valid TOML: {err}") from None


def read_config_file(path: str | os.PathLike, settings: Sequence[Setting], *,
                     plugins: bool = False) -> dict[str, Any]:
    """The values a TOML config file sets, by setting name. Its keys are the flag names
    without ``--``, and the tables the settings declare (``Setting.table``) hold theirs under
    their dest names; an unknown key, an undeclared table or a value of the wrong type is a
    :class:`SettingError` naming the file and the key. ``plugins``: the file may hold
    :data:`PLUGINS_KEY` too (read by :func:`config_plugins`, skipped here)."""
    doc = _read_toml(path)
    where = f"config file {str(path)!r}"
    tables = {s.table for s in settings if s.table}
    values = {}
    for key, value in doc.items():
        if plugins and key == PLUGINS_KEY:
            continue
        if key in tables and isinstance(value, dict):
            values.update(_read_table(value, [s for s in settings if s.table == key],
                                      f"{where}: table [{key}]"))
        else:
            values.update(_read_table({key: value}, [s for s in settings if not s.table],
                                      where, tables, (PLUGINS_KEY,) if plugins else ()))
    return values


def config_plugins(path: str | os.PathLike) -> list[str]:
    """The plug-ins a TOML config file names under :data:`PLUGINS_KEY` (none when absent): a
    string of comma-separated names or an array of strings; anything else is a
    :class:`SettingError` naming the file and the key."""
    value = _read_toml(path).get(PLUGINS_KEY, [])
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise SettingError(f"config file {str(path)!r}: key {PLUGINS_KEY!r}: got {value!r} "
                           f"({_toml_kind(value)}); expected a string or an array of strings "
                           f"(module names or .py paths)")
    return split_names(items)


def _read_table(doc: dict[str, Any], settings: Sequence[Setting], where: str,
                tables: Collection[str] = (), others: Sequence[str] = ()) -> dict[str, Any]:
    """The values of one table's entries (the top level: ``tables`` names the tables the
    file may hold besides, ``others`` the keys read elsewhere: ``plugins``)."""
    by_key = {s.file_key: s for s in settings}
    in_table = bool(settings) and bool(settings[0].table)
    values = {}
    for key, value in doc.items():
        setting = by_key.get(key)
        if setting is None:
            spelled = key.replace("-", "_") if in_table else key.replace("_", "-")
            close = difflib.get_close_matches(spelled, [*by_key, *others], n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            keys = "the field names" if in_table else "the flag names without --"
            more = "".join(f", table [{t}]" for t in sorted(tables))
            raise SettingError(f"{where}: unknown key {key!r}{hint}; the keys are {keys}: "
                               f"{', '.join(sorted([*by_key, *others]))}{more}")
        values[setting.name] = setting.from_toml(value, source=f"{where}: key {key!r}")
    return values


@dataclass(frozen=True)
class Resolved:
    """Every setting's value, and where it came from."""

    settings: tuple[Setting, ...]
    values: dict[str, Any]
    """By setting name."""
    sources: dict[str, str]
    """By setting name: the flag, the environment variable, ``config file 'F'`` or
    ``default``."""
    config: Path | None
    """The ``--config`` file read, if any."""
    plugins: tuple[str, ...] = ()
    """The plug-ins loaded (``Program.load_plugins``), in order."""
    plugins_source: str = ""
    """Where they were named: ``--plugin``, the environment variable, the config file's key;
    ``""``: none."""

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def kwargs(self, owner: type) -> dict[str, Any]:
        """The keyword arguments of ``owner`` that settings fill (field name -> value)."""
        return {s.field: self.values[s.name] for s in self.settings if s.owner is owner}

    def namespace(self) -> argparse.Namespace:
        """The values under their flags' dest names, plus ``config`` and ``plugin`` (the
        plug-ins loaded, a list)."""
        return argparse.Namespace(**{s.dest: self.values[s.name] for s in self.settings},
                                  config=self.config, plugin=list(self.plugins))


class _BoolFlag(argparse.Action):
    """``--x`` or ``--x=BOOL`` (any spelling :func:`parse_bool` reads) sets it; ``--no-x``
    clears it and takes no value."""

    def __init__(self, option_strings, dest, *, setting: Setting, **kwargs) -> None:
        kwargs.update(nargs="?", const=_BARE, metavar="BOOL",
                      type=lambda text: _flag_value(setting, text))
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        negative = option_string is not None and option_string.startswith("--no-")
        if negative and values is not _BARE:
            parser.error(f"{option_string} takes no value; write {option_string} alone or "
                         f"{self.option_strings[0]}=BOOL")
        setattr(namespace, self.dest, not negative if values is _BARE else values)


def _flag_value(setting: Setting, text: str) -> Any:
    try:
        return setting.from_text(text, source=setting.flag)
    except SettingError as err:
        # argparse prefixes "argument --flag: " itself
        raise argparse.ArgumentTypeError(str(err).removeprefix(setting.flag + ": ")) from None


class _Formatter(argparse.HelpFormatter):
    def _format_action_invocation(self, action) -> str:
        if isinstance(action, _BoolFlag):
            return f"{action.option_strings[0]} [BOOL], {action.option_strings[1]}"
        return super()._format_action_invocation(action)


@dataclass(frozen=True)
class Program:
    """One program's settings, in ``--help`` order, and how to read them."""

    prog: str
    description: str
    settings: tuple[Setting, ...]
    epilog: str = ""
    plugins: bool = False
    """Whether the program takes plug-ins: ``--plugin MODULE`` (repeatable, or several
    comma-separated), :data:`PLUGINS_ENV` and the config file's :data:`PLUGINS_KEY`, loaded
    by :meth:`load_plugins` before any other setting is read."""

    def __post_init__(self) -> None:
        for attr in ("name", "dest", "env"):
            seen = [getattr(s, attr) for s in self.settings if getattr(s, attr)]
            if dup := sorted({v for v in seen if seen.count(v) > 1}):
                raise TypeError(f"{self.prog}: settings share the {attr} {dup}")
        if {"config", "version", "help", "plugin", PLUGINS_KEY} & {s.name for s in self.settings}:
            raise TypeError(f"{self.prog}: config, version, help and plugin are not settings")
        if PLUGINS_ENV in {s.env for s in self.settings}:
            raise TypeError(f"{self.prog}: {PLUGINS_ENV} is --plugin's")

    def parser(self) -> argparse.ArgumentParser:
        """The parser of the whole command line: every setting's flag, ``--config`` and
        ``--version``. A flag not given parses to the setting's default; neither the
        environment nor a config file is read (that is :meth:`parse`), so it parses any
        command line the same way wherever it runs."""
        p = argparse.ArgumentParser(prog=self.prog, description=self.description,
                                    epilog=self.epilog or None, formatter_class=_Formatter)
        p.add_argument("--version", action="version", version=f"bitps {__version__}",
                       help="print 'bitps <version>' and exit")
        p.add_argument("--config", metavar="FILE", type=Path, default=None,
                       help="TOML file of settings: keys are the flag names without --; "
                            "flags and environment variables win over it")
        if self.plugins:
            p.add_argument("--plugin", metavar="MODULE", action="append", default=[],
                           help=_PLUGIN_HELP + f" (env {PLUGINS_ENV}; config file key "
                           f"{PLUGINS_KEY})")
        for s in self.settings:
            # argparse %-formats help strings
            kw = dict(dest=s.dest, default=s.default, help=s.help_line().replace("%", "%%"))
            if s.type is bool:
                p.add_argument(s.flag, f"--no-{s.name}", action=_BoolFlag, setting=s, **kw)
            else:
                metavar = s.metavar or (_METAVARS[s.type] if s.choices is None else None)
                p.add_argument(s.flag, choices=s.choices, metavar=metavar,
                               type=lambda text, s=s: _flag_value(s, text), **kw)
        return p

    def load_plugins(self, argv: Sequence[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], str]:
        """Import the plug-ins named by the first source that names any: ``--plugin`` in
        ``argv`` (default ``sys.argv[1:]``), else :data:`PLUGINS_ENV` in ``environ`` (default
        ``os.environ``), else the ``--config`` file's :data:`PLUGINS_KEY`; returns their names
        and that source (``()``, ``""``: none, or the program takes none). Importing is
        idempotent (``proto.plugins``); one that fails is a ``proto.plugins.PluginError``
        naming it and the source. :meth:`parse` calls it first; a program whose settings
        depend on what plug-ins register (a rule's own flags) calls it before building them."""
        if not self.plugins:
            return (), ""
        pre = argparse.ArgumentParser(prog=self.prog, add_help=False)
        pre.add_argument("--config", type=Path, default=None)
        pre.add_argument("--plugin", action="append", default=[])
        ns, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
        environ = os.environ if environ is None else environ
        names, source = split_names(ns.plugin), "--plugin"
        if not names and environ.get(PLUGINS_ENV):
            names, source = split_names([environ[PLUGINS_ENV]]), \
                f"environment variable {PLUGINS_ENV}"
        if not names and ns.config is not None:
            names = config_plugins(ns.config)
            source = f"config file {str(ns.config)!r}: key {PLUGINS_KEY!r}"
        load_plugins(names, source=source)
        return tuple(names), source if names else ""

    def parse(self, argv: Sequence[str] | None = None,
              environ: Mapping[str, str] | None = None) -> Resolved:
        """Every setting's value: its flag in ``argv`` (default ``sys.argv[1:]``), else its
        variable in ``environ`` (default ``os.environ``), else its key in the ``--config``
        file, else its default. An empty variable counts as unset, except for a text setting,
        where it is the empty text. A bad flag exits through argparse (status 2); a bad
        variable or file is a :class:`SettingError`; a plug-in that cannot be loaded
        (:meth:`load_plugins`, first) a ``proto.plugins.PluginError``."""
        plugins, plugins_source = self.load_plugins(argv, environ)
        parser = self.parser()
        # Flags not given parse to _UNSET, so that a flag given with the default's value still
        # wins over the environment and the file.
        parser.set_defaults(**{s.dest: _UNSET for s in self.settings})
        ns = parser.parse_args(argv)
        environ = os.environ if environ is None else environ
        in_file = read_config_file(ns.config, self.settings, plugins=self.plugins) \
            if ns.config is not None else {}
        values, sources = {}, {}
        for s in self.settings:
            value = getattr(ns, s.dest)
            text = environ.get(s.env) if s.env else None
            if text == "" and s.type is not str:
                text = None
            if value is not _UNSET:
                values[s.name], sources[s.name] = value, s.flag
            elif text is not None:
                source = f"environment variable {s.env}"
                values[s.name], sources[s.name] = s.from_text(text, source=source), s.env
            elif s.name in in_file:
                values[s.name], sources[s.name] = in_file[s.name], f"config file {ns.config!s}"
            else:
                values[s.name], sources[s.name] = s.default, "default"
        return Resolved(self.settings, values, sources, ns.config, plugins, plugins_source)

    def markdown(self) -> str:
        """This program's section of the configuration reference: one row per setting."""
        rows = [f"## `{self.prog}`", "", self.description, "",
                "| flag | environment | file key | value | default | sets | meaning |",
                "|---|---|---|---|---|---|---|"]
        for s in self.settings:
            flag = f"`{s.flag}`, `--no-{s.name}`" if s.type is bool else f"`{s.flag}`"
            kind = doc_choices(s.choices) if s.choices else _KINDS[s.type]
            key = f"`[{s.table}]` `{s.file_key}`" if s.table else f"`{s.name}`"
            cells = [flag, f"`{s.env}`" if s.env else "—", key, kind,
                     f"`{format_value(s.default)}`", f"`{s.target}`" if s.target else "—",
                     ]
            rows.append("| " + " | ".join(cell(c) for c in cells) + f" | {prose(s.help)} |")
        if self.plugins:
            rows.append(f"| `--plugin MODULE` (repeatable) | `{PLUGINS_ENV}` | `{PLUGINS_KEY}` "
                        f"| module names or `.py` paths, comma-separated | `\"\"` | — | "
                        f"{prose(_PLUGIN_HELP)} |")
        if self.epilog:
            rows += ["", self.epilog]
        return "\n".join(rows) + "\n"
