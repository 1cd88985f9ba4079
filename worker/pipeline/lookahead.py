"""Look-ahead buffering: the first stage prepares the next micro-batches on a side thread.

    pre = Prefetcher(loader, prepare=lambda batch: embed(collate(batch)), depth=2,
                     device="cuda")
    rt = StageRuntime(ctx, module, prefetcher=pre)   # F takes pre.get() when given no inputs
    ...
    pre.close()

A thread pulls items from ``source`` (any iterable: a data loader, a generator of raw samples),
runs ``prepare`` on each (load, collate, embed, move to the device) and puts the result in a
queue of ``depth`` items, so while micro-batch ``i`` computes, ``i + 1`` .. ``i + depth`` are
being made ready; at the end of a step the thread is already preparing the next step's first
micro-batch. On CUDA ``prepare`` runs on a side stream; :meth:`Prefetcher.get` makes the caller's
stream wait for that item's copy (an event) and marks its tensors as used there, so the caching
allocator does not hand their memory back early.

An exception in ``source`` or ``prepare`` is not lost: it ends the thread and is re-raised by
the next :meth:`get` (as :class:`PrefetchError`, chained to the original). The end of
``source`` raises ``StopIteration`` from ``get``. :meth:`close` stops and joins the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["PrefetchError", "Prefetcher"]


class PrefetchError(RuntimeError):
    """The prefetch thread failed; ``__cause__`` is what it raised."""


class _End:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class Prefetcher:
    """Prepared items of ``source``, ``depth`` ahead, from a side thread (see the module
    docstring). Iterating it yields :meth:`get` until the source ends."""

    def __init__(self, source: Iterable, prepare: Callable[[Any], Any] | None = None, *,
                 depth: int = 2, device: torch.device | str = "cpu",
                 join_timeout_s: float = 10.0) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        self.prepare = prepare or (lambda item: item)
        self.join_timeout_s = join_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, args=(iter(source),),
                                        name="bitps-prefetch", daemon=True)
        self._thread.start()

    def get(self, timeout: float | None = None) -> Any:
        """The next prepared item (waiting at most ``timeout`` seconds, None: for ever).
        Raises ``PrefetchError`` if the thread failed, ``StopIteration`` past the end."""
        if self._done:
            raise StopIteration
        try:
            got = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no prefetched item within {timeout} s") from None
        if isinstance(got, _End):
            self._done = True
            raise StopIteration
        if isinstance(got, _Failure):
            self._done = True
            raise PrefetchError(f"the prefetch thread failed: {got.exc!r}") from got.exc
        item, ready = got
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for t in _tensors(item):
                t.record_stream(current)
        return item

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        return self.get()

    def close(self) -> None:
        """Stop the thread and join it (items not taken are dropped)."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a put waiting for room
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
            if not self._thread.is_alive():
                break
            self.join_timeout_s -= 0.05
            if self.join_timeout_s <= 0:
                raise TimeoutError("the prefetch thread did not stop (blocked in source or "
                                   "prepare)")
        self._done = True

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, it) -> None:
        try:
            for raw in it:
                if self._stop.is_set():
                    return
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        item = self.prepare(raw)
                        ready = torch.cuda.Event()
                        ready.record()
                else:
                    item, ready = self.prepare(raw), None
                if not self._put((item, ready)):
                    return
            self._put(_End())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, never lost
            self._put(_Failure(exc))

    def _put(self, obj) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(obj, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
