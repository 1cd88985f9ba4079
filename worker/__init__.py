"""The worker side, by concern:

- ``transport/``: ``PSClient`` (registration, heartbeats, push/pull over ZeroMQ) and the
  push-policy interface; torch-free and algorithm-free.
- ``training/``: ``PSModel`` (the five-line integration) and the overlap of backward with
  push/pull, clipping under overlap, the torch codecs.
- ``algorithms/``: one module per worker-side algorithm (1-bit Adam's push policies, local SGD /
  DiLoCo); importing ``bitps.worker`` registers their push policies.
- ``memory/``: the activation pool.
- ``launch/``: ``bitps-launch`` (the local cluster launcher) and ``bitps-status``.
- ``demo.py``: the demo model and corpus; ``config.py``, ``metrics.py``: the client's settings
  and metrics; ``__main__.py`` is ``bitps-worker``.

``PSModel`` imports torch on first use, so the client stays torch-free.
"""

from bitps.worker import algorithms  # noqa: F401  (registers the algorithms' push policies)
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.client import Handle, PSClient, PSTimeoutError, ShardLostError

__all__ = ["ClientConfig", "Handle", "PSClient", "PSModel", "PSTimeoutError", "ShardLostError",
           "WorkerMetrics"]


def __getattr__(name: str):
    if name == "PSModel":
        from bitps.worker.training.model import PSModel

        return PSModel
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
