"""``ReadyProcess``: a child process (a shard, a raw pyzmq peer) that prints one JSON line when
it is ready to serve; the benches read it and stop the child when done. ``ready_router`` is the
child side of the peers that serve one ROUTER. ``thread_cpu``, ``process_cpu`` and
``process_run_s`` and ``machine_busy`` read CPU time from ``/proc`` (Linux; empty or 0
elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import zmq

__all__ = ["ReadyProcess", "machine_busy", "process_cpu", "process_run_s", "ready_router",
           "thread_cpu"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_of(stat: str) -> tuple[str, float]:
    """``(comm, utime + stime in seconds)`` from a ``/proc/.../stat`` line."""
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of stat(5)


def thread_cpu(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """Every thread of ``pid``: thread id -> (name, CPU seconds so far, user + system)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out[int(task.name)] = _cpu_of((task / "stat").read_text())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def process_cpu(pid: int | str = "self") -> float:
    """CPU seconds ``pid`` has used so far (all its threads), 0.0 when it cannot be read."""
    try:
        return _cpu_of(Path(f"/proc/{pid}/stat").read_text())[1]
    except (OSError, ValueError):
        return 0.0


def process_run_s(pid: int | str = "self") -> float:
    """CPU seconds ``pid``'s live threads have run so far, from the scheduler's nanosecond
    count (``/proc/PID/task/TID/schedstat``, its first field): for small amounts, where
    :func:`process_cpu`'s clock ticks (10 ms) are too coarse; 0.0 when it cannot be read."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9


def machine_busy(seconds: float = 1.0) -> float:
    """Share of all cores busy over ``seconds`` (``/proc/stat``): the load a bench records
    before it measures, so a noisy window shows in its results."""
    def sample() -> tuple[int, int]:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = values[3] + values[4]  # idle + iowait
        return sum(values) - idle, sum(values)
    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return -1.0
    return (busy1 - busy0) / max(total1 - total0, 1)


class ReadyProcess:
    """Start ``argv`` and block until its first stdout line, parsed as JSON into ``ready``."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{' '.join(argv)} exited with status {self.proc.returncode} "
                               f"before it was ready")
        self.ready = json.loads(line)

    def stop(self) -> None:
        """Terminate, then kill after 10 s."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ready_router(host: str) -> zmq.Socket:
    """The child side: a ROUTER bound to a free port on ``host``, announced on stdout as
    ``{"event": "ready", "port": N}`` for :class:`ReadyProcess`."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{host}")
    print(json.dumps({"event": "ready", "port": port}), flush=True)
    return sock
