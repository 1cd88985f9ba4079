"""The worker side: the PS client, the torch integration, the demo job and the launcher.

Read ``worker/client.py`` (PSClient and handles), then ``worker/model.py`` (PSModel, the
five-line integration) and ``worker/__main__.py`` (the demo trainer). ``PSModel`` imports torch
on first use, so the client stays torch-free.
"""

from bitps.worker.client import Handle, PSClient, PSTimeoutError
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import WorkerMetrics

__all__ = ["ClientConfig", "Handle", "PSClient", "PSModel", "PSTimeoutError", "WorkerMetrics"]


def __getattr__(name: str):
    if name == "PSModel":
        from bitps.worker.model import PSModel

        return PSModel
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
