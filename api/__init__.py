"""bitps: a parameter server for asynchronous distributed PyTorch training with 1-bit gradients.

The public API is the names below; everything else lives in the subpackages and may change:
``bitps.ps`` (the shard: numpy + numba, no torch), ``bitps.worker`` (the client and the torch
integration), ``bitps.proto`` (wire schema and layouts), ``bitps.native`` (numba kernels) and
``bitps.bench`` (the benchmark harness).

Names resolve on first use (PEP 562), so ``import bitps`` alone loads neither torch nor the
shard: a shard process (``python -m bitps.ps``) imports this package first and must stay
torch-free.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {
    "PSClient": "bitps.worker.transport.client",
    "PSModel": "bitps.worker.training.model",
    "Optimizer": "bitps.worker.training.optimizer",
    "connect": "bitps.worker.integrations.environment",
    "ClientConfig": "bitps.worker.config",
    "EncoderConfig": "bitps.worker.config",
    "Encoder": "bitps.worker.training.encoder",
    "OverlapConfig": "bitps.worker.config",
    "PoolConfig": "bitps.worker.config",
    "ActivationPool": "bitps.worker.memory.pool",
    "BatchBalance": "bitps.worker.algorithms.balance",
    "CodecConfig": "bitps.proto.codecs",
    "PSError": "bitps.proto.wire",
    "PSTimeoutError": "bitps.worker.transport.channel",
    "ServerConfig": "bitps.ps.config",
    "OptimizerConfig": "bitps.ps.config",
    "create_server": "bitps.ps.server",
    # pipeline parallelism (docs/pipeline.md)
    "ParallelConfig": "bitps.worker.pipeline.config",
    "PlanError": "bitps.worker.pipeline.errors",
    "get_schedule": "bitps.worker.pipeline.schedules",
    "simulate": "bitps.worker.pipeline.simulate",
    "StageContext": "bitps.worker.pipeline.runtime",
    "StageRuntime": "bitps.worker.pipeline.runtime",
    "StageFailedError": "bitps.worker.pipeline.p2p",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bitps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
