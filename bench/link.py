"""``shaped_link``: a bandwidth-limited link between this process and a child, for benches.

It creates a network namespace and a veth pair (one end here, one in the namespace), puts a
``tc tbf`` qdisc of the asked rate on both ends (so each direction is limited, as on a full-duplex
NIC), and yields a :class:`Link` whose ``prefix`` runs a command inside the namespace. Everything
is torn down on exit, also after an error. Creating namespaces needs root (CAP_NET_ADMIN) and
``ip``/``tc``; when that fails the link falls back to unshaped loopback and says why.

    with shaped_link("1gbit") as link:
        shard = ReadyProcess([*link.prefix, sys.executable, "-m", "bitps.ps",
                              "--host", link.server_ip])
        ...  # connect to link.server_ip
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Link", "shaped_link"]


@dataclass(frozen=True)
class Link:
    """Where the bench's child listens and how to start it."""

    kind: str
    """``netns`` (veth + tbf at ``rate``) or ``loopback`` (unshaped fallback)."""
    server_ip: str
    """Address the child binds and this process connects to."""
    host_ip: str
    """This end's address, which a child in the namespace connects to."""
    prefix: tuple[str, ...]
    """Prepend to the child's argv (``ip netns exec NS``; empty on loopback)."""
    rate: str
    """The tbf rate (``1gbit``), or ``unshaped``."""
    note: str
    """What was set up, or why the fallback was taken."""
    devices: tuple[str, ...] = ()
    """The veth ends, this namespace's then the child's (``ip link set DEV down`` cuts the
    link: tests/test_partition.py); empty on loopback."""


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise OSError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")


@contextlib.contextmanager
def shaped_link(rate: str = "1gbit", *, burst: str = "256kb",
                latency: str = "50ms") -> Iterator[Link]:
    """A veth link limited to ``rate`` each way into a fresh namespace, or loopback."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"bitps-bench-{tag}", f"bpw{tag}", f"bpp{tag}"
    host_ip, server_ip = "10.213.0.1", "10.213.0.2"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    created = False
    try:
        if missing:
            raise OSError(f"{' and '.join(missing)} not found")
        _run("ip", "netns", "add", ns)
        created = True
        _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _run("ip", "link", "set", there, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", here)
        _run("ip", "link", "set", here, "up")
        inside = ("ip", "netns", "exec", ns)
        _run(*inside, "ip", "addr", "add", f"{server_ip}/30", "dev", there)
        _run(*inside, "ip", "link", "set", there, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        for prefix, dev in (((), here), (inside, there)):
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", latency)
    except (OSError, subprocess.SubprocessError) as err:
        _teardown(ns, here, created)
        yield Link(kind="loopback", server_ip="127.0.0.1", host_ip="127.0.0.1", prefix=(),
                   rate="unshaped",
                   note=f"could not set up a shaped link ({err}); fell back to unshaped "
                        f"loopback, so communication is cheaper than on a {rate} link")
        return
    try:
        yield Link(kind="netns", server_ip=server_ip, host_ip=host_ip, prefix=inside,
                   rate=rate, devices=(here, there),
                   note=f"veth pair {here} <-> {there} (namespace {ns}), tc tbf rate {rate} "
                        f"burst {burst} latency {latency} on both ends")
    finally:
        _teardown(ns, here, created)


def _teardown(ns: str, here: str, created: bool) -> None:
    # Deleting the namespace deletes the veth end inside it, and with it the pair.
    if shutil.which("ip") is None:  # nothing was made without it (a GPU box's image has none)
        return
    for argv in ((["ip", "netns", "del", ns] if created else []),
                 ["ip", "link", "del", here]):
        if argv:
            subprocess.run(argv, capture_output=True, timeout=30)
