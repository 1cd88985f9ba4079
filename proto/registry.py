"""A registry of policies by name: update rules, consistency modes, worker algorithms (the
codecs, keyed by wire id as well, keep their own in ``proto/codecs.py``), and :class:`Names`,
the live view of a registry's names that a config field lists as its allowed values.

Example::

    RULES = Registry("update rule")

    @RULES.register
    class SGD(UpdateRule):
        name = "sgd"

    RULES.lookup("sgd")   # SGD; an unknown name is a ValueError listing the registered ones
    OPTIMIZERS = RULES.names()   # "sgd" in OPTIMIZERS; so is any name registered later

A plug-in (``--plugin MODULE``, ``proto.plugins``) registers its own the same way; the names
bitps registers itself are :meth:`Names.builtin`, which the generated configuration reference
lists, so that the page does not depend on what was loaded when it was rendered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set
from typing import Any, TypeVar

__all__ = ["BUILTIN_PACKAGE", "Names", "Registry", "is_builtin"]

T = TypeVar("T", bound=type)
BUILTIN_PACKAGE = "bitps"
"""Objects defined in a module of this package are bitps's own (:func:`is_builtin`)."""


def is_builtin(obj: Any) -> bool:
    """Whether ``obj`` (a class, a function, or an instance of a class) is defined in a module
    of bitps itself rather than in a plug-in."""
    module = getattr(obj, "__module__", None) or ""
    return module == BUILTIN_PACKAGE or module.startswith(BUILTIN_PACKAGE + ".")


class Names(Set):
    """The names ``mapping`` holds, live and read-only, in registration order, after the
    fixed ``first`` names (such as ``pull-codec``'s ``push``, which is no registered object):
    a name registered after this view was made is in it. ``proto.settings`` takes such a view
    from a field's ``metadata["choices"]`` as it is, so flags, ``--help`` and errors see every
    registered name."""

    def __init__(self, mapping: Mapping[str, Any], *, first: tuple[str, ...] = ()) -> None:
        self._mapping, self._first = mapping, first

    def __contains__(self, name: object) -> bool:
        return name in self._first or name in self._mapping

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (n for n in self._mapping if n not in self._first)

    def __len__(self) -> int:
        return len(self._first) + sum(1 for n in self._mapping if n not in self._first)

    def __repr__(self) -> str:
        return f"Names({list(self)!r})"

    def plus(self, *first: str) -> Names:
        """This view with the fixed names ``first`` before the others."""
        return Names(self._mapping, first=(*first, *self._first))

    def builtin(self) -> tuple[str, ...]:
        """The names bitps registers itself (and ``first``), in order: what the
        configuration reference lists, whatever plug-ins are loaded."""
        return (*self._first, *(n for n, obj in self._mapping.items()
                                if n not in self._first and is_builtin(obj)))


class Registry(dict):
    """Objects by name; ``what`` names the kind in errors. Classes register under their
    ``name`` attribute (:meth:`register`), anything else under a name given (:meth:`add`)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, name: str, obj: Any) -> Any:
        """Add ``obj`` under ``name``, a non-empty string that may be taken once; returns
        ``obj``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name {name!r}; expected a non-empty string")
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered (by "
                             f"{getattr(self[name], '__module__', '?')})")
        self[name] = obj
        return obj

    def register(self, cls: T) -> T:
        """Add ``cls`` under ``cls.name`` (a class decorator); a name may be taken once."""
        return self.add(cls.name, cls)

    def lookup(self, name: str) -> Any:
        """The object registered as ``name``."""
        obj = self.get(name)
        if obj is None:
            raise ValueError(f"{self.what} {name!r}; expected one of {sorted(self)}")
        return obj

    def names(self, *, first: tuple[str, ...] = ()) -> Names:
        """A live view of the registered names (:class:`Names`), after ``first``."""
        return Names(self, first=first)
