"""``Ranks``: the worker processes of one bench run, each printing JSON lines on stdout that
reader threads collect (``bench.e2e``; ``bench.e2e_rank`` is the child side). A rank that exits
non-zero or outlives its time is an error carrying the tail of its log."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["Ranks"]


class Ranks:
    """Worker processes of one run, their JSON lines collected by reader threads."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lines: list[list[dict]] = []

    def start(self, argv: list[str], log: Path, on_line=None) -> None:
        """Start a rank; ``on_line(proc, line)``, if given, sees each JSON line it prints."""
        err = log.open("wb")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)
        err.close()
        lines: list[dict] = []
        self.procs.append(proc)
        self.lines.append(lines)

        def read() -> None:
            for raw in proc.stdout:
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    continue
                if on_line is not None:
                    on_line(proc, lines[-1])

        threading.Thread(target=read, daemon=True).start()

    def wait(self, timeout: float, logs: list[Path]) -> None:
        deadline = time.monotonic() + timeout
        for rank, (proc, log) in enumerate(zip(self.procs, logs)):
            try:
                proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"rank {rank} timed out {self._progress()}; log {log}:\n"
                                   f"{log.read_text()[-3000:]}") from err
            if proc.returncode:
                raise RuntimeError(f"rank {rank} exited {proc.returncode} {self._progress()}; "
                                   f"log {log}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # let the readers drain

    def _progress(self) -> str:
        steps = [sum(e.get("event") == "step" for e in ls) for ls in self.lines]
        return f"(steps logged per rank: {steps}, exit codes {[p.poll() for p in self.procs]})"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
