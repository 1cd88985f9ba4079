"""``ReadyProcess``: a child process (a shard, a raw pyzmq peer) that prints one JSON line when
it is ready to serve; the benches read it and stop the child when done. ``ready_router`` is the
child side of the peers that serve one ROUTER."""

from __future__ import annotations

import json
import subprocess

import zmq

__all__ = ["ReadyProcess", "ready_router"]


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
