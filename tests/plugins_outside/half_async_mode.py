"""A consistency-mode plug-in: ``half_async``, async (every push applied on arrival, every pull
answered at once) at ``LR_FACTOR`` times the learning rate async would use.

It subclasses ``Async`` and changes one thing, the learning-rate scale of each push
(``Async.lr_scale``). Load it on the shards::

    bitps-server --plugin half_async_mode.py --mode half_async ...
"""

from __future__ import annotations

from bitps.ps.consistency import Async, register

LR_FACTOR = 0.5


@register
class HalfAsync(Async):
    """Async at half the learning rate."""

    name = "half_async"

    def lr_scale(self, clock, pushers, version_gap, *, lr=None):
        return super().lr_scale(clock, pushers, version_gap, lr=lr) * LR_FACTOR
