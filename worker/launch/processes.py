"""The processes of one local run (``bitps-launch``): each child in a session of its own,
killed with its parent, its JSON stdout lines turned into events on one queue, its stderr its
log; torn down with SIGTERM, then SIGKILL after a grace period."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Child", "Cluster", "signal_group"]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    events: list = field(default_factory=list)


def _die_with_parent() -> None:
    """Child side of fork: get SIGKILL if the launcher dies, so no orphan outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Cluster:
    """The processes of one local run."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.children: list[Child] = []
        self.events: queue.Queue = queue.Queue()

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, *,
              echo: bool = False) -> Child:
        """Start ``argv``; its JSON stdout lines become events, its stderr its log. ``echo``
        (a user's script): stdout and stderr together are its log, and every line is an
        ``output`` event; an ``eof`` event follows the last."""
        log = self.run_dir / f"{name}.log"
        env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
        with log.open("wb") as stderr:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT if echo else stderr,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                    preexec_fn=_die_with_parent if sys.platform == "linux"
                                    else None)
        child = Child(name, proc, log)
        threading.Thread(target=self._echo if echo else self._read, args=(child,),
                         daemon=True).start()
        self.children.append(child)
        return child

    def _echo(self, child: Child) -> None:
        with child.log.open("ab") as log:
            for raw in child.proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip("\r\n")
                self.events.put((child, {"event": "output", "line": line}))
        self.events.put((child, {"event": "eof"}))

    def _read(self, child: Child) -> None:
        for raw in child.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            child.events.append(event)
            self.events.put((child, event))

    def failed(self) -> Child | None:
        for c in self.children:
            if c.proc.poll() not in (None, 0):
                return c
        return None

    def teardown(self, grace_s: float = 5.0) -> None:
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in alive:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (its session), if it is still there."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
