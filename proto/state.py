"""One state protocol for everything that is checkpointed: ``state_dict()`` and
``load_state_dict(state)``, as torch's modules and optimizers spell them.

A state dict is a plain ``dict``:

- ``"version"``: an ``int``, the number of its layout. Each layout is documented where the class
  is and in docs/checkpoints.md; a loader takes every version it documents (older checkpoints
  keep loading) and refuses another by name;
- every other entry: a numpy array (the loader's own copy is made on load; arrays a
  ``state_dict`` returns are copies too, safe to keep), a JSON-able scalar or list, or a nested
  dict of the same kinds (another object's state dict, with its own ``"version"``).

``load_state_dict`` checks the whole dict before it changes anything: a refused state leaves the
object as it was, and the error (a ``ValueError``; the shard's objects raise the typed
``PSError``) names the entry, what was found and what was expected. The
checkpoint writers compose these dicts (the shard's: ``ps.checkpoint``); :func:`split_state`
and :func:`join_state` lay one out as the arrays of a tensor file and the JSON values of a
manifest, and back (how a checkpoint keeps any rule's state). Nothing here reads files.

    state = obj.state_dict()          # {"version": 1, ...}
    other.load_state_dict(state)      # the same state, or an error and no change
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["SEP", "Stateful", "join_state", "split_state"]

SEP = "/"
"""Joins the names of nested entries in :func:`split_state`'s flat names (``"inner/m"``)."""
_SCALARS = (bool, int, float, str, type(None))


@runtime_checkable
class Stateful(Protocol):
    """Something whose state is saved and restored through a versioned state dict."""

    def state_dict(self) -> dict[str, Any]:
        """The state, ``"version"`` included (the module docstring)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``state`` (any documented version); refuse the whole of
        it, changing nothing, when it does not fit."""


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A state dict (its ``"version"`` included, if the caller leaves it in) as flat names:
    the numpy arrays (``{"inner/m": array}``, for a tensor file) and everything else, as JSON
    values (``{"step": 3, "inner/version": 1}``, for a manifest). Nested dicts are walked,
    their names joined with :data:`SEP`; an empty one is kept as ``{}``; numpy scalars become
    Python's and tuples lists. :func:`join_state` is the inverse (tuples come back as lists,
    numpy scalars as Python's). A name holding :data:`SEP`, or a value of another kind (bytes,
    an object), is a ``ValueError`` naming it and its type."""
    arrays: dict[str, np.ndarray] = {}
    values: dict[str, Any] = {}

    def walk(d: Mapping[str, Any], prefix: str) -> None:
        for name, value in d.items():
            if not isinstance(name, str) or not name or SEP in name:
                raise ValueError(f"state entry {prefix}{name!r}: names must be non-empty "
                                 f"strings without {SEP!r}")
            flat = prefix + name
            if isinstance(value, np.ndarray):
                arrays[flat] = value
            elif isinstance(value, Mapping):
                if value:
                    walk(value, flat + SEP)
                else:
                    values[flat] = {}
            else:
                values[flat] = _json_value(value, flat)

    walk(state, "")
    return arrays, values


def _json_value(value: Any, name: str) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, name) for v in value]
    raise ValueError(f"state entry {name!r} is a {type(value).__name__}; expected a numpy "
                     f"array, a nested dict, or a JSON scalar or list (bool, int, float, str, "
                     f"None)")


def join_state(arrays: Mapping[str, np.ndarray], values: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict :func:`split_state` split into ``arrays`` and ``values``."""
    out: dict[str, Any] = {}
    for flat, value in [*arrays.items(), *values.items()]:
        *parents, name = flat.split(SEP)
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[name] = value
    return out
