"""A consistency-mode plug-in: ``half_async``, async (every push applied on arrival, every pull
answered at once) at ``LR_FACTOR`` times the learning rate async would use.

It subclasses ``Async`` and changes one thing: the core it applies pushes through scales each
push's learning rate. Load it on the shards::

    bitps-server --plugin half_async_mode.py --mode half_async ...
"""

from __future__ import annotations

from bitps.ps.consistency import Async, register

LR_FACTOR = 0.5


class _ScaledCore:
    """The shard core as ``Async.push`` sees it, with every push's learning rate scaled."""

    def __init__(self, core, factor: float) -> None:
        self._core, self._factor = core, factor

    def __getattr__(self, name):
        return getattr(self._core, name)

    def apply_arrived(self, slot, grad, clock, lr_scale):
        self._core.apply_arrived(slot, grad, clock, lr_scale * self._factor)


@register
class HalfAsync(Async):
    """Async at half the learning rate."""

    name = "half_async"

    def push(self, core, header, slots, grads, live, min_clock):
        super().push(_ScaledCore(core, LR_FACTOR), header, slots, grads, live, min_clock)
