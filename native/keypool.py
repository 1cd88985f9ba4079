"""``KeyPool``: one message's keys worked on by several threads at once.

The kernels here release the GIL, so the per-key work of one message runs in parallel on
``threads`` threads: the caller's own and ``threads - 1`` helpers. Two users:

- a shard (``ServerConfig.threads``, ``bitps-server --threads``): a push's decode, the rule's
  update and publishing, per key (``ps.consistency``, ``ps.checks``);
- a worker's encoder (``EncoderConfig.threads``, ``bitps-worker --encoder-threads``): a push's
  finiteness check and encode with error feedback, per key (``worker.training.encoder``).

Each key's work touches only that key's state, so keys need no lock against each other; what
is shared across keys (counts, metrics) is counted under a lock by the caller.

The results do not depend on the threads: each key's arithmetic is the same sequence whichever
thread runs it, and ``map`` returns once every key is done (an error in one key's work is raised
once every other key was done).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MIN_SPLIT_BYTES", "KeyPool", "default_threads"]

T = TypeVar("T")

MIN_SPLIT_BYTES = 1 << 20
"""A message whose keys hold less than this in all runs on one thread: handing work to a
helper costs tens of microseconds, more than small keys' arithmetic."""


def default_threads() -> int:
    """One per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class KeyPool:
    """Runs a function over a message's keys on ``threads`` threads (0: one per core)."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="bitps-keys") \
            if self.threads > 1 else None

    def map(self, fn: Callable[[T], None], items: Sequence[T], nbytes: int) -> None:
        """``fn(item)`` for every item (``nbytes``: the keys' size together); returns when all
        are done, raising the first error once every item was tried. Items are dealt round
        robin: item i goes to thread i mod N, the calling thread taking share 0."""
        if self._pool is None or len(items) < 2 or nbytes < MIN_SPLIT_BYTES:
            for item in items:
                fn(item)
            return
        n = min(self.threads, len(items))

        def share(k: int) -> BaseException | None:
            """Thread k's items; the first error, once every one of them was tried."""
            first = None
            for item in items[k::n]:
                try:
                    fn(item)
                except BaseException as exc:  # the other keys still run: raised in map
                    first = first or exc
            return first

        futures = [self._pool.submit(share, k) for k in range(1, n)]
        errors = [share(0), *(f.result() for f in futures)]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
