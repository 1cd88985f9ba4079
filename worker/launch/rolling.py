"""Rolling restarts of a local cluster's shards: ``bitps-launch --checkpoints``, then SIGHUP to
the launcher while it trains (``kill -HUP <pid>``; the pid is in ``cluster.json``).

One shard at a time is stopped with SIGTERM (its held pulls are answered ``SHUTTING_DOWN``,
its final checkpoint written), started again with the same command line on the same ports
(it restores that checkpoint before it serves), and waited for (its ready line) before the
next one goes. The workers wait each restart out: a shard that answered ``SHUTTING_DOWN`` or
stopped answering is recovered once it is back (``PSClient.recover``), so training continues
and, in sync, ends as it would have without the restarts. This is what a Kubernetes rolling
update of the shard StatefulSet does (docker/README.md).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from rich.console import Console

from bitps.worker.launch.processes import Child, Cluster, signal_group

__all__ = ["RollingRestart"]


class RollingRestart:
    """Restarts ``shards`` (started with ``argvs``, ready as ``ready`` says) one at a time,
    each time :meth:`request` is called (a signal handler: it only sets an event). Without
    checkpoints (``enabled`` False) a request is refused, with the reason printed: a shard
    restarted without its state would lose every update."""

    def __init__(self, cluster: Cluster, shards: Sequence[Child], argvs: Sequence[list[str]],
                 ready: Sequence[dict], *, console: Console, enabled: bool,
                 timeout_s: float = 60.0) -> None:
        self.cluster, self.console, self.enabled = cluster, console, enabled
        self.shards, self.argvs = list(shards), [list(a) for a in argvs]
        # the same ports again: the workers dial them, cluster.json names them
        self.ports = [["--grpc-port", str(r["grpc_port"]), "--data-port", str(r["data_port"]),
                       "--metrics-port", str(r["metrics_port"])] for r in ready]
        self.timeout_s = timeout_s
        self.done = 0
        """Rolling restarts completed."""
        self._wanted = threading.Event()
        threading.Thread(target=self._loop, name="bitps-rolling-restart", daemon=True).start()

    def request(self, signum: int | None = None, frame=None) -> None:
        """Ask for one rolling restart (SIGHUP's handler)."""
        self._wanted.set()

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if not self.enabled:
                self.console.print("[yellow]rolling restart refused: the shards keep no "
                                   "checkpoints (start bitps-launch with --checkpoints)")
                continue
            self._restart_all()

    def _restart_all(self) -> None:
        n = len(self.shards)
        for i in range(n):
            old = self.shards[i]
            self.console.print(f"rolling restart: shard {i} of {n}: SIGTERM")
            signal_group(old.proc, signal.SIGTERM)
            try:
                rc = old.proc.wait(self.timeout_s)
            except subprocess.TimeoutExpired:  # a shard that will not stop: the run fails
                signal_group(old.proc, signal.SIGKILL)
                rc = old.proc.wait()
            if rc != 0:
                self.console.print(f"[red]rolling restart: shard {i} exited {rc}; stopping")
                return
            new = self.cluster.spawn(f"shard-{i}-restart-{self.done + 1}",
                                     self.argvs[i] + self.ports[i])
            self.shards[i] = new
            if not self._wait_ready(new):
                self.console.print(f"[red]rolling restart: shard {i} did not come back "
                                   f"within {self.timeout_s:.0f} s (log {new.log})")
                return
            self.console.print(f"rolling restart: shard {i} of {n} is back")
        self.done += 1
        self.console.print(f"rolling restart {self.done}: every shard restarted")

    def _wait_ready(self, child: Child) -> bool:
        """Until ``child``'s ready line (its reader thread appends it to ``child.events``)."""
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end and child.proc.poll() is None:
            if any(e.get("event") == "ready" for e in child.events):
                return True
            time.sleep(0.05)
        return False
