"""``Spy``: a py-spy recording of one running process, and the top CPU consumers it found.

py-spy (https://github.com/benfred/py-spy, the ``py-spy`` wheel of the ``bench`` extra) samples a
Python process from outside, without changing it. :class:`Spy` runs::

    py-spy record --pid PID --rate RATE --nonblocking --format raw --output PATH

until the process exits (``--nonblocking``: the target is not paused to be read; a sample can
then be torn, which costs a frame now and then, not the figures). py-spy samples the Python
threads it finds active, leaving out those it sees idle (in a sleep, or blocked on a lock or a
socket), so the samples approximate CPU, not exactly: a thread that is runnable but waiting for
a core counts (on a busy machine, a thread that wakes often), and torch's own worker threads,
which have no Python frames, are not sampled. On the bench's LM they summed to 1.06x (DDP) and
1.3-1.4x (bitps) the ranks' CPU from ``/proc``: read the ranking, and the differences between
runs, more than the sum.

The raw output is one collapsed stack per line, outermost frame first::

    <module> (train.py:11);step (bitps/worker/training/model.py:120);encode (...:88) 235

:func:`top_consumers` sums the samples by their innermost frame's function and file, its line
dropped: the Python function that was running, or that had called into torch, numba or libzmq
(``--native`` would unwind into those, at far more cost per sample). ``ms per step`` is
``samples / rate / steps``: the CPU of one step that function accounts for.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

__all__ = ["Spy", "executable", "top_consumers"]

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def executable() -> str | None:
    """The py-spy program: beside this Python (a venv's bin), else on PATH; ``None``."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if os.access(here, os.X_OK) else shutil.which("py-spy")


class Spy:
    """One py-spy recording of ``pid`` into ``path`` at ``rate`` samples per second, from
    construction until the process exits (:meth:`wait`)."""

    def __init__(self, pid: int, path: Path, *, rate: int = 100) -> None:
        program = executable()
        if program is None:
            raise RuntimeError("py-spy is not installed: pip install py-spy (the bench extra)")
        self.path, self.rate = Path(path), rate
        self._log = self.path.with_suffix(".log")
        with self._log.open("wb") as log:
            self.proc = subprocess.Popen(
                [program, "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking",
                 "--format", "raw", "--output", str(self.path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = 30.0) -> str:
        """Wait for the recording to be written once the process has exited (or ``timeout``
        has passed: :meth:`stop`); its stacks (the raw text). ``RuntimeError`` with py-spy's
        own message when it wrote none (no permission to read the process: ptrace,
        CAP_SYS_PTRACE)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.stop(timeout)
        return self._read()

    def stop(self, timeout: float = 30.0) -> str:
        """End the recording of a process that goes on (a shard); its stacks. py-spy writes
        what it has on SIGINT (its Ctrl-C); on SIGTERM it dies without writing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as err:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"py-spy did not stop within {timeout} s of SIGINT; "
                                   f"killed: {self._log.read_text(errors='replace')[-500:]}"
                                   ) from err
        return self._read()

    def _read(self) -> str:
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no samples (exit {self.proc.returncode}): "
                               f"{self._log.read_text(errors='replace')[-500:]}")
        return self.path.read_text(errors="replace")


def top_consumers(raw: str, *, rate: int, steps: int, n: int = 10) -> dict:
    """The ``n`` functions with the most samples in ``raw`` (py-spy's collapsed stacks), as
    ``{"samples", "steps", "cpu_ms_per_step", "top": [{"function", "file", "ms_per_step",
    "share"}]}``: each function's samples (innermost frame, line dropped) over ``rate`` and
    ``steps``; ``share`` of all samples. Stacks py-spy could not read (empty) count in the
    total, not in the top."""
    if steps <= 0 or rate <= 0:
        raise ValueError(f"steps {steps} and rate {rate}; expected both > 0")
    by: Counter[tuple[str, str]] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        leaf = stack.rsplit(";", 1)[-1].strip()
        m = _FRAME.match(leaf)
        if m:
            by[(m["function"], m["file"])] += int(count)
    per_step = 1e3 / rate / steps
    return {"samples": total, "steps": steps, "cpu_ms_per_step": total * per_step,
            "top": [{"function": f, "file": path, "ms_per_step": c * per_step,
                     "share": c / total} for (f, path), c in by.most_common(n)]}
