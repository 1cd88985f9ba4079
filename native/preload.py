"""Numba's one-time set-up, done before the first step needs a kernel.

The first call of any numba kernel in a process pays for numba itself: it imports its
typing and lowering registries and builds its CPU target before it can load the kernel's
machine code from the cache (``cache=True``). Measured here: about 0.45 s for the first
kernel of a process, 20-40 ms for each one after it. Paid where the first call happens,
that is inside a worker's first ``step()`` and, on the shard, inside the first push's update,
which the worker's first pull waits for.

:func:`preload` does it on a daemon thread when a shard starts and when a worker's encoder is
made, so the first step finds numba ready. It loads one small kernel (``all_finite``); the
others still load at their own first call, at the 20-40 ms each. A failure is logged, never
raised: the first real call would then pay the cost, or raise the same error itself. A worker
joins the thread before it exits (``Encoder.close``): still importing numba at the
interpreter's exit, it can abort a process that holds torch tensors (see there).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

__all__ = ["preload"]

log = logging.getLogger(__name__)


def _load() -> None:
    try:
        from bitps.native.update_rules import all_finite

        all_finite(np.zeros(1, np.float32))
    except Exception:  # noqa: BLE001 - logged; the first real call raises it again
        log.warning("numba set-up ahead of the first step failed", exc_info=True)


def preload() -> threading.Thread:
    """Start numba's set-up and the load of one kernel on a daemon thread (returned, started).
    Safe to call any number of times; the calls after the first find numba ready."""
    thread = threading.Thread(target=_load, name="bitps-numba-preload", daemon=True)
    thread.start()
    return thread
