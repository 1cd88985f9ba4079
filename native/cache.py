"""Numba's on-disk cache of the kernels, dropped whole when any kernel source changes.

Numba keys a cached kernel on its own file alone (modification time and size), but kernels here
call kernels of other files, and LLVM inlines them: after an edit of ``native/update_rules.py``,
``native/push.py``'s cached ``_code_apply`` went on running the old arithmetic until its cache
files were deleted by hand (seen 2026-12-06). So the package keeps a digest of every
``native/*.py`` beside numba's cache files (``__pycache__/bitps-kernels.sha256``) and, when it
differs, removes the ``.nbi``/``.nbc`` files there before any kernel module is imported; numba
then compiles and caches afresh.

This matters for source checkouts (an editable install, a ``git pull`` that changes one kernel
file): an upgrade of an installed package rewrites every file, and numba's other cache
locations (``NUMBA_CACHE_DIR``, the per-user cache of a read-only install) key on each file's
path and stamp the same way, so nothing here touches them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["STAMP", "drop_stale"]

STAMP = "bitps-kernels.sha256"
"""The digest's file name in the kernels' ``__pycache__``."""


def drop_stale(directory: Path) -> bool:
    """Remove numba's cache files in ``directory/__pycache__`` when the digest of
    ``directory/*.py`` differs from the one recorded there, and record it; whether files were
    dropped. Does nothing where numba does not cache in that folder (``NUMBA_CACHE_DIR`` set, or
    the folder not writable)."""
    cache = directory / "__pycache__"
    if os.environ.get("NUMBA_CACHE_DIR") or not os.access(
            cache if cache.exists() else directory, os.W_OK):
        return False
    digest = hashlib.sha256()
    for source in sorted(directory.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    stamp = cache / STAMP
    try:
        if stamp.read_text() == digest.hexdigest():
            return False
    except OSError:
        pass  # no digest yet: whatever is cached may predate it
    cache.mkdir(exist_ok=True)
    dropped = False
    for path in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
        path.unlink(missing_ok=True)  # another process may have dropped it first
        dropped = True
    partial = cache / f"{STAMP}.{os.getpid()}"
    partial.write_text(digest.hexdigest())
    os.replace(partial, stamp)  # atomic: a process importing meanwhile reads a whole digest
    return dropped
