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
checkpoint writers compose these dicts (the shard's: ``ps.checkpoint``); nothing here reads
files.

    state = obj.state_dict()          # {"version": 1, ...}
    other.load_state_dict(state)      # the same state, or an error and no change
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Something whose state is saved and restored through a versioned state dict."""

    def state_dict(self) -> dict[str, Any]:
        """The state, ``"version"`` included (the module docstring)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``state`` (any documented version); refuse the whole of
        it, changing nothing, when it does not fit."""
