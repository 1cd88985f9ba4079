"""Lightning through bitps: a ``Strategy`` under which an unchanged ``LightningModule`` trains
with the shards as its data parallelism and its optimizer.

    trainer = lightning.pytorch.Trainer(strategy=BitPSStrategy(), accelerator="cpu", devices=1)
    trainer.fit(module, this_ranks_batches)     # one process per rank: torchrun, bitps-launch

Each process is one data-parallel replica that Lightning sees as a single device: no DDP, no
``torch.distributed``. Its client is ``bitps.connect(**client_overrides)`` (``BITPS_SERVERS``,
``RANK``, ``WORLD_SIZE`` as torchrun or ``bitps-launch`` set them), made when a fit starts,
unless one is given. Each rank feeds its own part of the data: Lightning adds no
``DistributedSampler`` to a single device.

**The optimizer.** The module's ``configure_optimizers`` runs as usual; its one optimizer
(more is a ``ValueError``: the shards hold one update rule) becomes a ``bitps.Optimizer`` over
the module with the same param groups: their parameters (frozen ones left out), ``lr`` and
``weight_decay``, and the keys schedulers put there (``initial_lr``, ...). What the groups set
for the torch optimizer's own constants (``betas``, ``eps``, ``momentum``, ``foreach``, ...)
is dropped, with a logged note: the update rule and its constants are the shards'
(``bitps-server --optimizer``), and ``weight_decay`` means what that rule makes of it. The
module's lr schedulers are re-targeted onto the new optimizer, so they set the lr every push
carries; a schedule of momentum (``cycle_momentum=True``) cannot be kept and is refused. A
``bitps.Optimizer`` the module builds itself (over ``self.trainer.strategy.client``) is kept.
Gradient clipping, accumulation and manual optimization work as with any torch optimizer: the
gradients are read at ``step()``. With overlap on they are read during backward, so Lightning's
clipping and accumulation are refused then (use ``EncoderConfig.clip_norm``).

**Ranks.** ``global_rank``/``world_size`` are the client's (``is_global_zero``: bitps rank 0,
which alone saves checkpoints; Lightning's process-wide ``rank_zero_only.rank`` is set to it,
as its DDP strategies do). There are no collectives: ``reduce``, ``all_gather``, ``broadcast``
and ``barrier`` are a single device's (each rank keeps its own values), so logged metrics are
rank-local, and stop decisions (``EarlyStopping``, ``max_steps``) should agree across ranks.

**Lifetime.** The optimizer is closed (leaving the shards) at the end of every fit, once, also
when training failed; a client given to the strategy serves one fit. Checkpoints hold the
optimizer's ``state_dict`` (param groups and the worker's part); the parameters' and the
rule's state are the shards' own checkpoints (docs/checkpoints.md).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

from bitps.worker.config import EncoderConfig, OverlapConfig
from bitps.worker.integrations.environment import client_config
from bitps.worker.training.optimizer import GROUP_KEYS, Optimizer
from bitps.worker.transport.client import PSClient

__all__ = ["BitPSStrategy"]

log = logging.getLogger(__name__)


class BitPSStrategy(SingleDeviceStrategy):
    """One data-parallel replica of a bitps job, a single device to Lightning (module
    docstring)."""

    strategy_name = "bitps"

    def __init__(self, client: PSClient | None = None, *, device: str | torch.device = "cpu",
                 overlap: OverlapConfig | None = None, encoder: EncoderConfig | None = None,
                 **client_overrides: Any) -> None:
        """``client``: this rank's, closed when the first fit ends; ``None``: a fresh
        ``bitps.connect(**client_overrides)`` each fit, its settings read now (the environment
        and ``ClientConfig`` fields, ``servers`` also as ``"host:port,..."``; no servers
        anywhere is ``bitps.connect``'s ``ValueError``). ``device``: where the module trains.
        ``overlap`` and ``encoder``: the ``bitps.Optimizer``'s (default: overlap off, raw
        pushes)."""
        if client is not None and not isinstance(client, PSClient):
            raise TypeError(f"client must be a bitps PSClient, got {type(client).__name__}")
        if client is not None and client_overrides:
            raise ValueError(f"give a client or client settings, not both; got a client and "
                             f"{sorted(client_overrides)}")
        super().__init__(device=device)
        self._given = client
        self._cfg = client.cfg if client is not None else client_config(**client_overrides)
        self._client: PSClient | None = None  # handed out for the fit under way
        self._spent = False  # the given client served its fit
        self._optimizer: Optimizer | None = None
        self._failure: BaseException | None = None
        self.overlap = overlap
        self.encoder = encoder
        # Lightning's ranks are the client's, known before a fit (trainer.global_rank)
        self.global_rank, self.world_size = self._cfg.rank, self._cfg.world_size

    # -- ranks ----------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """From here on Lightning's rank-zero-only logging follows the bitps rank."""
        rank_zero_only.rank = self.global_rank  # process-wide, as Lightning's DDP sets it
        super().setup_environment()

    @property
    def is_global_zero(self) -> bool:
        """bitps rank 0: Lightning's rank for logging and saving checkpoints."""
        return self.global_rank == 0

    @property
    def client(self) -> PSClient:
        """This fit's client: the one given (once), else ``bitps.connect()``'s, made on first
        use; a ``configure_optimizers`` that builds its own ``bitps.Optimizer`` passes it."""
        if self._client is None:
            if self._given is None:
                self._client = PSClient(self._cfg)
            elif self._spent:
                raise RuntimeError("the client given to BitPSStrategy served one fit and left "
                                   "the shards; give a new one, or none (then each fit "
                                   "connects from the environment)")
            else:
                self._client = self._given
        return self._client

    @property
    def bitps_optimizer(self) -> Optimizer | None:
        """The ``bitps.Optimizer`` of the fit under way (``None`` outside one)."""
        return self._optimizer

    # -- optimizers -----------------------------------------------------------------------------
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's (``configure_optimizers``, parsed and checked), then its one optimizer
        becomes a ``bitps.Optimizer`` and the schedulers follow it."""
        super().setup_optimizers(trainer)
        optimizers = self.optimizers
        if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
            names = [type(o).__name__ for o in optimizers]
            raise ValueError(f"BitPSStrategy trains through exactly one torch optimizer (the "
                             f"shards hold one update rule per parameter); configure_optimizers "
                             f"returned {len(optimizers)}: {names}")
        old = optimizers[0]
        if isinstance(old, _MockOptimizer):  # what Lightning makes of a None
            raise ValueError("BitPSStrategy needs an optimizer; configure_optimizers returned "
                             "none")
        if self.overlap is not None and self.overlap.mode != "off":
            _check_overlap(trainer, self.overlap.mode)
        if isinstance(old, Optimizer):
            self._optimizer = old
            return
        schedulers = [s for config in self.lr_scheduler_configs
                      for s in _chained(config.scheduler)]
        for scheduler in schedulers:  # before the shards are joined
            _check_scheduler(scheduler, old)
        self._optimizer = new = self._convert(old)
        for scheduler in schedulers:
            scheduler.optimizer = new
        if hasattr(old.step, "_wrapped_by_lr_sched"):
            _count_steps(new)
        self.optimizers = [new]

    def _convert(self, old: torch.optim.Optimizer) -> Optimizer:
        module = self.lightning_module
        assert module is not None, "setup_optimizers runs with the module connected"
        groups, dropped, kept = [], set(), []
        for i, group in enumerate(old.param_groups):
            if "lr" not in group:
                raise ValueError(f"param group {i} of {type(old).__name__} has no 'lr'; "
                                 f"bitps.Optimizer pushes each group's lr")
            # torch steps a frozen parameter never; bitps would refuse it (not the module's)
            params = [p for p in group["params"] if p.requires_grad]
            groups.append({"params": params, "lr": group["lr"],
                           "weight_decay": group.get("weight_decay", 0.0)})
            dropped |= (set(group) & set(old.defaults)) - GROUP_KEYS
            # keys a scheduler added (initial_lr, max_lr, ...): it reads them back
            kept.append({k: v for k, v in group.items()
                         if k not in GROUP_KEYS and k not in old.defaults})
        first = old.param_groups[0]
        new = Optimizer(groups, self.client, lr=first["lr"],
                        weight_decay=first.get("weight_decay", 0.0), model=module,
                        overlap=self.overlap, encoder=self.encoder)
        for group, extra in zip(new.param_groups, kept):
            group.update(extra)
        if dropped:
            log.info("BitPSStrategy: %s became a bitps.Optimizer with its param groups' "
                     "params, lr and weight_decay; its %s are not used: the shards' update rule "
                     "and its constants apply (bitps-server --optimizer, --beta1, ...)",
                     type(old).__name__, ", ".join(sorted(dropped)))
        return new

    # -- lifetime -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Remembered, so that a failure to close after it does not hide it."""
        self._failure = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """After a fit: close the optimizer (leave the shards) and the client, once, whether
        the fit finished or failed; then Lightning's teardown."""
        try:
            if self._fitting():
                self._release()
        finally:
            self._failure = None
            super().teardown()

    def _fitting(self) -> bool:
        module = self.lightning_module
        try:
            return module is not None and module.trainer.state.fn == TrainerFn.FITTING
        except RuntimeError:  # a module no trainer holds
            return False

    def _release(self) -> None:
        optimizer, client = self._optimizer, self._client
        self._optimizer = self._client = None  # once, even if closing fails
        if self._given is not None and not self._spent:
            # the given client ends with its fit, also one that failed before it was used
            client, self._spent = self._given, True
        try:
            try:
                if optimizer is not None:
                    optimizer.close()
            finally:
                if client is not None:
                    client.close()
        except Exception:
            if self._failure is None:
                raise
            log.warning("BitPSStrategy: closing the bitps client after %r failed as well",
                        self._failure, exc_info=True)


def _check_overlap(trainer: pl.Trainer, mode: str) -> None:
    """Overlap pushes gradients from backward's hooks: Lightning's clipping and accumulation,
    which change them after backward, would not be what is pushed."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(f"overlap mode {mode!r} pushes every backward's gradients; "
                         f"accumulate_grad_batches={trainer.accumulate_grad_batches} needs "
                         f"overlap off")
    if trainer.gradient_clip_val:
        raise ValueError(f"overlap mode {mode!r} pushes gradients before Lightning clips them "
                         f"(gradient_clip_val={trainer.gradient_clip_val}); clip with "
                         f"EncoderConfig(clip_norm=...) or turn overlap off")


def _chained(scheduler: Any) -> list[Any]:
    """``scheduler`` and those it drives (``SequentialLR``, ``ChainedScheduler``)."""
    return [scheduler, *(s for inner in getattr(scheduler, "_schedulers", ())
                         for s in _chained(inner))]


def _check_scheduler(scheduler: Any, old: torch.optim.Optimizer) -> None:
    """Refuse a scheduler that cannot follow the optimizer to the shards: one that schedules
    a constant of their rule, or one attached to another optimizer."""
    if getattr(scheduler, "cycle_momentum", False):
        raise ValueError(f"{type(scheduler).__name__} schedules momentum (cycle_momentum=True), "
                         f"a constant of the shards' update rule; pass cycle_momentum=False")
    if getattr(scheduler, "optimizer", None) is not old:
        raise ValueError(f"{type(scheduler).__name__} is not attached to the module's "
                         f"optimizer {type(old).__name__}; it cannot follow it to the shards")


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """What torch's ``LRScheduler`` does to its optimizer's ``step`` (mark that it ran), so
    its check that ``step()`` came first holds here as on the optimizer it was made on."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    ref, func = weakref.ref(optimizer), step.__func__  # no cycle through the instance

    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]
