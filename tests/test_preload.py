"""``bitps.native.preload``: numba's one-time set-up on a daemon thread, started by a shard and
by a worker's encoder, so that the first step does not pay for it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from bitps.native import preload as preload_mod

# a fresh interpreter: no kernel loaded yet, so what is loaded afterwards is the preload's doing
_FRESH = """
from bitps.native.update_rules import all_finite, sum_squares
assert not all_finite.signatures and not sum_squares.signatures
{start}
assert len(all_finite.signatures) == 1, all_finite.signatures
assert not sum_squares.signatures  # only numba's set-up and the one kernel
print("ok")
"""


@pytest.mark.parametrize("start", [
    "from bitps.native.preload import preload\nt = preload()\nassert t.daemon\nt.join(120)",
    # a worker's encoder starts it (here without a shard: nothing is registered)
    "import threading\nfrom bitps.worker import ClientConfig, PSClient\n"
    "from bitps.worker.config import EncoderConfig\n"
    "from bitps.worker.training.encoder import Encoder\n"
    "client = PSClient(ClientConfig(servers=('127.0.0.1:1',), rank=0, world_size=1))\n"
    "Encoder(EncoderConfig(), client).close()\n"
    "[t.join(120) for t in threading.enumerate() if t.name == 'bitps-numba-preload']\n"
    "client.close()",
])
def test_the_preload_loads_one_kernel_on_a_daemon_thread(start):
    proc = subprocess.run([sys.executable, "-c", _FRESH.format(start=start)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_shard_starts_the_preload(cluster, monkeypatch):
    from bitps.ps import server as server_mod

    started = []
    real = server_mod.preload
    monkeypatch.setattr(server_mod, "preload", lambda: started.append(real()) or started[-1])
    cluster(1)
    assert len(started) == 1 and isinstance(started[0], threading.Thread)
    started[0].join(60)
    assert not started[0].is_alive()


@pytest.mark.parametrize("breaks", ["kernel", "import"])
def test_a_failed_preload_is_logged_not_raised(breaks, monkeypatch, caplog):
    from bitps.native import update_rules

    def broken(x):
        raise RuntimeError("no numba here")

    if breaks == "kernel":
        monkeypatch.setattr(update_rules, "all_finite", broken)
    else:  # the module cannot be imported: the thread still ends through the log
        monkeypatch.setitem(sys.modules, "bitps.native.update_rules", None)
    with caplog.at_level(logging.WARNING, logger=preload_mod.__name__):
        preload_mod.preload().join(10)
    expected = RuntimeError if breaks == "kernel" else ImportError
    assert any("numba set-up ahead of the first step failed" in r.getMessage()
               and r.exc_info and isinstance(r.exc_info[1], expected) for r in caplog.records)


def test_closing_the_encoder_waits_for_the_preload(monkeypatch):
    """No preload thread is left running when a worker's interpreter exits: there a garbage
    collection it triggered freed torch tensors, and the thread's end inside torch's dealloc
    aborted a stage worker whose work was done (SIGABRT, from its core dump)."""
    from bitps.worker import ClientConfig, PSClient
    from bitps.worker.config import EncoderConfig
    from bitps.worker.training import encoder as encoder_mod

    release = threading.Event()
    threads = []

    def slow_preload():  # numba's set-up still running when the worker closes
        t = threading.Thread(target=release.wait, args=(30,), daemon=True)
        t.start()
        threads.append(t)
        return t

    monkeypatch.setattr(encoder_mod, "preload", slow_preload)
    client = PSClient(ClientConfig(servers=("127.0.0.1:1",), rank=0, world_size=1))
    enc = encoder_mod.Encoder(EncoderConfig(), client)
    closer = threading.Thread(target=enc.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and threads[0].is_alive()  # close waits for the set-up
    release.set()
    closer.join(10)
    assert not closer.is_alive() and not threads[0].is_alive()
    client.close()
