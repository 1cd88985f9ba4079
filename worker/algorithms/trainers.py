"""Worker algorithms: what ``bitps-worker --algorithm NAME`` trains with, one trainer factory
per name in the registry ``worker.config.TRAINERS``.

A factory is ``(model, client, cfg) -> trainer``: ``model`` the ``torch.nn.Module`` (on its
device), ``client`` the connected ``PSClient``, ``cfg`` the program's whole configuration
(``bitps.worker.__main__.WorkerConfig``: ``cfg.algorithm``, ``cfg.encoder``, ``cfg.overlap``,
...). The trainer registers the model's keys with the shards when it is made, and is a
:class:`Trainer`: the program runs ``loss.backward()`` then ``trainer.step()`` each step, and
``trainer.close()`` once at the end. ``ps`` (``PSModel``) and ``diloco`` (local SGD,
``worker.algorithms.local_sgd``) are registered here; a plug-in registers its own the same
way (docs/plugins.md)::

    from bitps.worker.algorithms.trainers import register_trainer

    @register_trainer("scaled")
    def scaled(model, client, cfg):
        return ScaledPS(PSModel(model, client, overlap=cfg.overlap, encoder=cfg.encoder))

This module imports no torch: the factories import their trainers when called, so importing
``bitps.worker`` (which registers them) stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from bitps.worker.config import ALGORITHMS, TRAINERS

__all__ = ["ALGORITHMS", "TRAINERS", "Trainer", "make_trainer", "register_trainer"]

F = TypeVar("F", bound=Callable[..., Any])


@runtime_checkable
class Trainer(Protocol):
    """What ``bitps-worker`` needs of a trainer. Optional, read when present: ``last_stats``
    (``PSModel``'s step statistics: ``utilization``) and ``decision`` (its overlap
    decision)."""

    keys: Sequence
    """The keys it registered (the ``start`` event counts them)."""

    @property
    def clock(self) -> int:
        """Steps completed through the shards (progress lines report it)."""

    def step(self) -> None:
        """After ``loss.backward()``: exchange with the shards as the algorithm does (push,
        pull, or only every so many steps) and leave the model's parameters updated."""

    def close(self) -> None:
        """Wait for what is in flight; the client is closed by its owner."""


def register_trainer(name: str) -> Callable[[F], F]:
    """A decorator: add ``factory`` to :data:`TRAINERS` under ``name`` (a name may be taken
    once), which makes ``name`` a valid ``--algorithm``."""

    def add(factory: F) -> F:
        if not callable(factory):
            raise TypeError(f"worker algorithm {name!r}: got {factory!r}; expected a "
                            f"callable (model, client, cfg) -> trainer")
        return TRAINERS.add(name, factory)

    return add


def make_trainer(name: str, model, client, cfg) -> Trainer:
    """The trainer of the registered algorithm ``name`` (a ``ValueError`` listing the
    registered ones when there is none)."""
    return TRAINERS.lookup(name)(model, client, cfg)


@register_trainer("ps")
def ps_model(model, client, cfg):
    """Push every step's gradients, pull the parameters the shards' rule made (``PSModel``)."""
    from bitps.worker.training.model import PSModel

    return PSModel(model, client, overlap=cfg.overlap, encoder=cfg.encoder)


@register_trainer("diloco")
def local_sgd(model, client, cfg):
    """Local SGD / DiLoCo (``LocalSGD``): ``inner_steps`` steps of AdamW, then one exchange
    of the pseudo-gradient."""
    import torch

    from bitps.worker.algorithms.local_sgd import LocalSGD

    a = cfg.algorithm
    inner = torch.optim.AdamW(model.parameters(), lr=a.inner_lr,
                              weight_decay=a.inner_weight_decay)
    return LocalSGD(model, client, inner, inner_steps=a.inner_steps, fragments=a.fragments,
                    overlap_steps=a.fragment_overlap_steps, encoder=cfg.encoder,
                    adaptive=a.inner_steps_adaptive)
