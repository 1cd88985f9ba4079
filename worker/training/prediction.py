"""Weight prediction: in async/ssp, gradients taken where they will land, not where they were
pulled.

With ``W`` workers pushing a key, a gradient this worker computes from the parameters it pulled
is applied after the ``W - 1`` others have pushed about once each: it is one round of updates
stale. For float32 pulls the shard hands out the parameters moved that far ahead
(``ServerConfig.lookahead``). A shard whose pull replies are exact (published codes, which this
worker adds to a copy bit-identical to the shard's, and the float32 parameters of keys that
publish none) says so at registration (``RegisterReply.worker_lookahead``), and the worker
predicts itself. After each pull of a key, with ``x`` the exact copy at version ``v`` and ``x0``
the copy at the previous pull, at version ``v0``::

    shown = x + (W - 1) / (v - v0) * (x - x0)

the parameters moved on by ``W - 1`` more updates of the mean size of those since the last
pull (``native.extrapolate``: one pass that also makes ``x`` the next ``x0``). ``shown`` is what
the model computes with; the exact copy stays what the codes apply to, so replicas stay
bit-identical. A key whose version did not move keeps its prediction; one whose version went
back (a shard restored from an older checkpoint) or that has no earlier copy is shown exact.

This is SpecTrain's and the shard's lookahead's prediction (docs/algorithms.md, Staleness);
nothing is checkpointed (the first pull after a restart shows the exact copy).

Memory: one more float32 copy of the predicted keys (``x0``), and on CPU the exact copy beside
the model's parameters (on CUDA the pinned host buffer already is one; the prediction is made
in a second pinned buffer and uploaded).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from bitps import native

__all__ = ["WeightPrediction"]


class WeightPrediction:
    """Per key: ``exact`` (the copy pulls write), ``shown`` (the copy the model computes
    with, same length), ``ahead`` (``W - 1``; 0: shown exact, for keys whose shard moves
    them ahead itself), and the ``versions`` the client holds."""

    def __init__(self, exact: Mapping[int, np.ndarray], shown: Mapping[int, np.ndarray], *,
                 ahead: Mapping[int, int], versions: Mapping[int, int]) -> None:
        missing = set(exact) ^ set(shown) | set(exact) ^ set(ahead)
        if missing:
            raise ValueError(f"keys {sorted(missing)[:8]} lack an exact copy, a shown copy or "
                             f"a lookahead")
        bad = {k: a for k, a in ahead.items() if a < 0}
        if bad:
            raise ValueError(f"lookahead {bad}; expected >= 0 (W - 1 other workers, or 0)")
        self.exact, self.shown, self.ahead, self.versions = exact, shown, ahead, versions
        self._previous: dict[int, np.ndarray] = {}
        self._at: dict[int, int] = {}

    def update(self, keys: Iterable[int]) -> None:
        """The pulls of ``keys`` are in: move each key's shown copy ahead of its exact one."""
        for key in keys:
            x, shown, version = self.exact[key], self.shown[key], self.versions.get(key)
            previous, at = self._previous.get(key), self._at.get(key)
            if not self.ahead[key]:
                shown[:] = x
            elif version is None or previous is None or at is None or version < at:
                if previous is None:
                    previous = self._previous[key] = np.empty_like(x)
                previous[:] = x
                shown[:] = x
            elif version > at:
                native.extrapolate(x, previous, shown,
                                   np.float32(self.ahead[key] / (version - at)))
            if version is not None:
                self._at[key] = version

    def reset(self) -> None:
        """Forget every earlier copy: the next :meth:`update` of each key shows it exact."""
        self._previous.clear()
        self._at.clear()
