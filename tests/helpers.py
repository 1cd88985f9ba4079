"""Small helpers several test modules share (the bigger ones have modules of their own:
``tests.faults``, ``tests.encoding``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["docs_generator", "one_key_core"]


def docs_generator():
    """``docs/gen_configuration.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gen_configuration",
                                                  ROOT / "docs" / "gen_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_key_core(cfg, n: int):
    """A ``ShardCore`` for ``cfg`` (clock fixed at 0) with one registered float32 key ``w`` of
    ``n`` elements, its initial values ``linspace(-1, 1, n)``, rank 0 of a world of one."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.wire import PROTOCOL
    from bitps.ps.shard import ShardCore

    core = ShardCore(cfg, now=lambda: 0.0)
    spec = pb.KeySpec(key=0, name="w", offset=0, length=n, dtype=pb.FLOAT32)
    init = np.linspace(-1, 1, n, dtype=np.float32)
    core.register(pb.RegisterRequest(protocol=PROTOCOL, rank=0, world_size=1, signature="s",
                                     num_shards=1, shard_id=0, keys=[spec], sends_values=True),
                  {0: init.tobytes()})
    return core
