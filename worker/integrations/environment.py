"""``connect()``: a :class:`~bitps.worker.transport.client.PSClient` for this process from its
environment, as torchrun and ``bitps-launch`` set it up:

    client = bitps.connect()     # BITPS_SERVERS, RANK, WORLD_SIZE (and BITPS_TOKEN, ...)

The settings are ``bitps-worker``'s own client settings (the servers, ``RANK``,
``WORLD_SIZE`` and :func:`~bitps.worker.config.connection_settings`: token, CURVE, TLS,
deadlines), read by the same reader (``bitps.proto.settings``) from the environment only, so a
script needs no flags of ours; keyword arguments override them (``ClientConfig`` fields).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from bitps.proto.settings import Program, from_field, option
from bitps.worker.config import ClientConfig, connection_settings
from bitps.worker.transport.client import PSClient

__all__ = ["client_config", "connect", "program"]


@functools.cache
def program() -> Program:
    """The client settings a script's environment may hold (``docs/configuration.md``)."""
    return Program("bitps.connect", "A worker script's client (`bitps.connect()`, "
                   "docs/integrations.md), from its environment only: no flags, no file; "
                   "keyword arguments override.", (
        option("servers", default="", metavar="HOST:PORT,...",
               help="comma-separated gRPC host:port of every shard, in shard-id order"),
        from_field(ClientConfig, "rank", env="RANK", help="worker rank (torchrun's RANK)"),
        from_field(ClientConfig, "world_size", env="WORLD_SIZE",
                   help="number of worker ranks (torchrun's WORLD_SIZE)"),
        *connection_settings(),
    ))


def client_config(environ: Mapping[str, str] | None = None, **overrides: Any) -> ClientConfig:
    """The ``ClientConfig`` ``environ`` (default ``os.environ``) describes, with ``overrides``
    (fields of ``ClientConfig``; ``servers`` may be a comma-separated string). No servers
    anywhere is a ``ValueError`` naming ``BITPS_SERVERS``."""
    r = program().parse([], os.environ if environ is None else environ)
    fields = {**r.kwargs(ClientConfig), **overrides}
    servers = fields.pop("servers", r["servers"])
    if isinstance(servers, str):
        servers = tuple(s for s in servers.split(",") if s)
    if not servers:
        raise ValueError("no shards: set BITPS_SERVERS=HOST:PORT,... (every shard's gRPC "
                         "address, in shard-id order) or pass servers=")
    return ClientConfig(**fields, servers=tuple(servers))


def connect(environ: Mapping[str, str] | None = None, **overrides: Any) -> PSClient:
    """A client for the shards :func:`client_config` names (registration happens when a
    model is bound: ``bitps.PSModel``, ``bitps.Optimizer``)."""
    return PSClient(client_config(environ, **overrides))
