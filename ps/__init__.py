"""The PS shard: numpy + numba, no torch.

Start one with ``bitps-server`` or :func:`create_server`. Read ``ps/shard.py`` (request handling
and consistency), then ``ps/clocks.py``, ``ps/store.py`` and ``ps/data.py``.
"""

# the built-in rules and modes register on import (the config's choices are their names)
from bitps.ps import consistency, onebit, outer  # noqa: F401
from bitps.ps.clocks import ClockTable
from bitps.ps.config import CONSISTENCY, MODES, OPTIMIZERS, RULES, OptimizerConfig, ServerConfig
from bitps.ps.rules import UpdateRule, make_rule
from bitps.ps.server import ServerShard, create_server
from bitps.ps.shard import Admission, ShardCore

__all__ = [
    "CONSISTENCY",
    "MODES",
    "OPTIMIZERS",
    "Admission",
    "ClockTable",
    "OptimizerConfig",
    "RULES",
    "ServerConfig",
    "ServerShard",
    "ShardCore",
    "UpdateRule",
    "create_server",
    "make_rule",
]
