"""The PS shard: numpy + numba, no torch.

Start one with ``bitps-server`` or :func:`create_server`. Read ``ps/shard.py`` (request handling
and consistency), then ``ps/clocks.py``, ``ps/store.py`` and ``ps/data.py``.
"""

from ps.clocks import ClockTable
from ps.config import MODES, OPTIMIZERS, OptimizerConfig, ServerConfig
from ps.rules import UpdateRule, make_rule
from ps.server import ServerShard, create_server
from ps.shard import Admission, ShardCore

__all__ = [
    "MODES",
    "OPTIMIZERS",
    "Admission",
    "ClockTable",
    "OptimizerConfig",
    "ServerConfig",
    "ServerShard",
    "ShardCore",
    "UpdateRule",
    "create_server",
    "make_rule",
]
