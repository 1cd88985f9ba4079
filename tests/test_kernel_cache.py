"""Numba's on-disk cache of the kernels is dropped when any kernel source changes
(``native/cache.py``): numba keys a cached kernel on its own file only, so a kernel that calls
one of another file kept running the old callee after that file was edited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bitps.native.cache import STAMP, drop_stale

CALLEE = '''import numba

@numba.njit(cache=True)
def value():
    return {value}
'''

CALLER = '''import numba
from kernels.callee import value

@numba.njit(cache=True)
def twice():
    return 2 * value()
'''

RUN = '''import sys
from pathlib import Path
sys.path.insert(0, {root!r})
if {check}:
    from bitps.native.cache import drop_stale
    drop_stale(Path({root!r}) / "kernels")
from kernels.caller import twice
print(twice())
'''


def _twice(root: Path, *, check: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",
                                                            "NUMBA_DISABLE_JIT")}
    out = subprocess.run([sys.executable, "-c", RUN.format(root=str(root), check=check)],
                         capture_output=True, text=True, env=env, check=True, timeout=120)
    return int(out.stdout.strip())


def _package(root: Path, value: int) -> None:
    pkg = root / "kernels"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(CALLEE.format(value=value))
    if not (pkg / "caller.py").exists():
        (pkg / "caller.py").write_text(CALLER)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", [False, True])
def test_an_edited_callee_reaches_a_cached_caller_only_with_the_check(tmp_path, check):
    """Numba alone (``check`` False) runs the cached caller with the callee it was compiled
    against after the callee's file changed (the defect); with the digest check the cache is
    dropped and the caller sees the edit."""
    _package(tmp_path, 1)
    assert _twice(tmp_path, check=check) == 2
    time.sleep(0.01)
    _package(tmp_path, 5)  # the callee edited, the caller's file untouched
    assert _twice(tmp_path, check=check) == (10 if check else 2)


def test_the_digest_is_kept_and_the_cache_dropped_only_when_a_source_changes(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    for name in ("a.f-1.py311.nbi", "a.f-1.py311.1.nbc", "a.cpython-311.pyc"):
        (cache / name).write_text("")
    assert drop_stale(tmp_path) is True
    assert sorted(p.name for p in cache.iterdir()) == ["a.cpython-311.pyc", STAMP]
    (cache / "a.f-1.py311.nbi").write_text("")  # numba caches again
    assert drop_stale(tmp_path) is False and (cache / "a.f-1.py311.nbi").exists()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert drop_stale(tmp_path) is True and not (cache / "a.f-1.py311.nbi").exists()
    (tmp_path / "b.py").write_text("")  # a new kernel file counts too
    (cache / "b.g-1.py311.nbi").write_text("")
    assert drop_stale(tmp_path) is True


def test_nothing_is_touched_where_numba_caches_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.f-1.py311.nbi").write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert drop_stale(tmp_path) is False
    assert (tmp_path / "__pycache__" / "a.f-1.py311.nbi").exists()
    assert not (tmp_path / "__pycache__" / STAMP).exists()
