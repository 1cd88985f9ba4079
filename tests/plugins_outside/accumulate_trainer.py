"""A worker-algorithm plug-in: ``accumulate``, which sums the gradients of ``--inner-steps``
backward passes and pushes their mean through ``PSModel`` once, so the shards see one push (and
the worker one clock) per ``--inner-steps`` steps. Load it on the workers::

    bitps-worker --plugin accumulate_trainer.py --algorithm accumulate --inner-steps 2 ...

torch is imported when the trainer is made, not when the plug-in is loaded: a shard given the
same plug-in list stays torch-free.
"""

from __future__ import annotations

import dataclasses

from bitps.worker.algorithms.trainers import register_trainer


class Accumulate:
    """Every ``every``-th :meth:`step`: the mean of the gradients summed since the last push
    goes to the shards (``PSModel.step``, which also zeroes them); the other steps only let
    ``backward()`` add to ``.grad``."""

    def __init__(self, ps_model, every: int) -> None:
        if every < 1:
            raise ValueError(f"accumulate: every is {every}; expected >= 1")
        self.ps, self.every, self.backwards = ps_model, every, 0

    @property
    def keys(self):
        return self.ps.keys

    @property
    def clock(self) -> int:
        return self.ps.clock

    @property
    def decision(self):
        return self.ps.decision

    def step(self) -> None:
        self.backwards += 1
        if self.backwards % self.every:
            return
        for _, p in self.ps.params:
            if p.grad is not None:
                p.grad.div_(self.every)
        self.ps.step()

    def close(self) -> None:
        self.ps.close()


@register_trainer("accumulate")
def accumulate(model, client, cfg):
    from bitps.worker.training.model import PSModel

    # backward hooks would push every backward: accumulation needs the exchange in step()
    overlap = dataclasses.replace(cfg.overlap, mode="off")
    return Accumulate(PSModel(model, client, overlap=overlap, encoder=cfg.encoder),
                      every=cfg.algorithm.inner_steps)
