"""Hugging Face ``transformers.Trainer`` through bitps: the shards are the data parallelism,
so each rank runs a stock Trainer that sees a job of one process.

    client = bitps.integrations.huggingface.connect()    # before TrainingArguments
    optimizer = bitps.Optimizer(model, client, lr=args.learning_rate,
                                weight_decay=args.weight_decay)
    trainer = Trainer(model=model, args=args, train_dataset=this_ranks_part,
                      optimizers=(optimizer, None))       # Trainer's schedule drives the lr
    trainer.train()
    optimizer.close()

:func:`connect` reads the client's settings from the environment (``bitps.connect``:
``BITPS_SERVERS``, ``RANK``, ``WORLD_SIZE`` as torchrun or ``bitps-launch`` set them) and
then removes torchrun's world variables (:data:`WORLD_VARIABLES`) from ``os.environ``: with
them, ``TrainingArguments`` (through accelerate) would start ``torch.distributed`` and
Trainer would wrap the model in DDP, all-reducing every gradient a second time. Without them
each rank's Trainer trains one replica: its gradients go to the shards in
``optimizer.step()`` (after Trainer's clipping: ``bitps.Optimizer`` reads them there), and its
lr scheduler sets the lr every push carries. Each rank feeds its own part of the data (the
Trainer's sampler is no longer distributed).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from bitps.worker.integrations.environment import client_config
from bitps.worker.transport.client import PSClient

__all__ = ["WORLD_VARIABLES", "connect"]

WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "PMI_SIZE",
                   "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
"""What torchrun (and MPI launchers) set that makes accelerate start ``torch.distributed``."""


def connect(environ: MutableMapping[str, str] | None = None, **overrides: Any) -> PSClient:
    """A client for this rank (``bitps.connect``), after which ``environ`` (default
    ``os.environ``) no longer holds :data:`WORLD_VARIABLES`: call it before
    ``TrainingArguments`` is made (that is when accelerate reads them)."""
    environ = os.environ if environ is None else environ
    client = PSClient(client_config(environ, **overrides))
    for name in WORLD_VARIABLES:
        environ.pop(name, None)
    return client
