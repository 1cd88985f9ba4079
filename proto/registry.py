"""A registry of policy classes by name: update rules, consistency modes (the codecs, keyed by
wire id as well, keep their own in ``proto/codecs.py``).

Example::

    RULES = Registry("update rule")

    @RULES.register
    class SGD(UpdateRule):
        name = "sgd"

    RULES.lookup("sgd")   # SGD; an unknown name is a ValueError listing the registered ones
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Registry"]

T = TypeVar("T", bound=type)


class Registry(dict):
    """Classes by their ``name`` attribute; ``what`` names the kind in errors."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def register(self, cls: T) -> T:
        """Add ``cls`` under ``cls.name`` (a class decorator); a name may be taken once."""
        if cls.name in self:
            raise ValueError(f"{self.what} {cls.name!r} is already registered")
        self[cls.name] = cls
        return cls

    def lookup(self, name: str) -> type:
        """The class registered as ``name``."""
        cls = self.get(name)
        if cls is None:
            raise ValueError(f"{self.what} {name!r}; expected one of {sorted(self)}")
        return cls
