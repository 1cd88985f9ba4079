"""``emulated_cluster``: nodes joined by shaped links, for the end-to-end bench.

Each node is a network namespace with one veth NIC (``eth0``, ``10.214.0.<n+1>/24``); the other
end of every veth is a port of one bridge inside a switch namespace. A ``tc tbf`` qdisc of the
asked rate sits on both ends of every veth, so each node's NIC is limited to ``rate`` in each
direction, as a full-duplex port of a switched cluster is; an optional ``netem`` delay sits under
it (a clear ``DelayUnsupported`` where the kernel has no netem). Only the namespaces carry
addresses: the host's own network is untouched. Everything is torn down on exit, on an error,
on Ctrl-C and on SIGTERM (turned into ``SystemExit`` while the cluster is up).

Traffic between processes of one node (a worker and its colocated shard) goes over that node's
own stack and never touches a shaped link; traffic between nodes crosses two (the sender's
egress and the receiver's ingress). :meth:`Cluster.wire_bytes` reads the bridge ports' byte
counters: the bytes that crossed the links.

When namespaces cannot be made (not root, no ``ip``/``tc``) the cluster falls back to loopback:
every node is ``127.0.0.1``, nothing is shaped, ``wire_bytes`` is empty and ``note`` says why.

    with emulated_cluster(2, rate="1gbit") as cluster:
        node = cluster.nodes[0]
        subprocess.Popen([*node.prefix, sys.executable, "-m", "bitps.ps", "--host", node.ip])
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Cluster", "DelayUnsupported", "Node", "emulated_cluster"]

_SUBNET = "10.214.0"


@dataclass(frozen=True)
class Node:
    """One emulated machine."""

    index: int
    ip: str
    """Its address: processes on it bind here, and peers connect here."""
    prefix: tuple[str, ...]
    """Prepend to a command's argv to run it on this node (empty on loopback)."""
    port: str
    """Its bridge port in the switch namespace (empty on loopback)."""


@dataclass(frozen=True)
class Cluster:
    kind: str
    """``netns`` (namespaces, bridge, tbf) or ``loopback`` (the unshaped fallback)."""
    nodes: tuple[Node, ...]
    rate: str
    """The tbf rate of every link (``1gbit``), or ``unshaped``."""
    delay: str
    """Added one-way delay per link end (``netem``), or empty."""
    switch: str
    """The switch namespace's name (empty on loopback)."""
    note: str
    """What was set up, or why the fallback was taken."""

    def wire_bytes(self) -> dict[int, int]:
        """Bytes each node has sent plus received over its link so far (bridge port
        counters); empty on loopback."""
        if self.kind != "netns":
            return {}
        out = subprocess.run(["ip", "-n", self.switch, "-s", "-j", "link", "show"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        by_port = {link["ifname"]: link.get("stats64", {}) for link in json.loads(out)}
        return {n.index: int(by_port[n.port]["rx"]["bytes"]) + int(by_port[n.port]["tx"]["bytes"])
                for n in self.nodes}


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise OSError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")


class DelayUnsupported(RuntimeError):
    """An added delay was asked for, and this kernel has no ``netem`` qdisc to make it."""


def _shape(prefix: tuple[str, ...], dev: str, rate: str, delay: str, burst: str,
           latency: str) -> None:
    tbf = ("tbf", "rate", rate, "burst", burst, "latency", latency)
    if not delay:
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
        return
    try:
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
             "delay", delay)
    except OSError as err:
        raise DelayUnsupported(f"an added delay of {delay!r} needs the netem qdisc "
                               f"(sch_netem), which this kernel lacks: {err}") from err
    _run(*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)


@contextlib.contextmanager
def emulated_cluster(nodes: int, *, rate: str = "1gbit", delay: str = "",
                     burst: str = "256kb", latency: str = "50ms") -> Iterator[Cluster]:
    """``nodes`` namespaces on one shaped switch, or loopback when that cannot be made."""
    if not 1 <= nodes <= 200:
        raise ValueError(f"nodes must be in [1, 200], got {nodes}")
    tag = f"{os.getpid() % 100000}"
    switch = f"bitps-sw-{tag}"
    names = [f"bitps-n{i}-{tag}" for i in range(nodes)]
    made: list[str] = []
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(signum, frame):
        # a second SIGTERM (a supervisor's and its child's both reach us) must not cut the
        # teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    try:
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise OSError(f"{' and '.join(missing)} not found")
        sw = ("ip", "netns", "exec", switch)
        _run("ip", "netns", "add", switch)
        made.append(switch)
        _run(*sw, "ip", "link", "add", "br0", "type", "bridge")
        _run(*sw, "ip", "link", "set", "br0", "up")
        built = []
        for i, ns in enumerate(names):
            port = f"p{i}"
            _run("ip", "netns", "add", ns)
            made.append(ns)
            inside = ("ip", "netns", "exec", ns)
            # create the pair inside the switch, then move the node's end into its namespace
            _run(*sw, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run(*sw, "ip", "link", "set", port, "master", "br0")
            _run(*sw, "ip", "link", "set", port, "up")
            ip = f"{_SUBNET}.{i + 1}"
            _run(*inside, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            for prefix, dev in ((inside, "eth0"), (sw, port)):
                _shape(prefix, dev, rate, delay, burst, latency)
            built.append(Node(index=i, ip=ip, prefix=inside, port=port))
    except DelayUnsupported:
        _teardown(made)
        raise
    except (OSError, subprocess.SubprocessError) as err:
        _teardown(made)
        yield Cluster(kind="loopback", rate="unshaped", delay="", switch="",
                      nodes=tuple(Node(index=i, ip="127.0.0.1", prefix=(), port="")
                                  for i in range(nodes)),
                      note=f"could not build the emulated cluster ({err}); fell back to "
                           f"unshaped loopback, so communication is far cheaper than on a "
                           f"{rate} link")
        return
    signal.signal(signal.SIGTERM, terminated)
    try:
        yield Cluster(kind="netns", nodes=tuple(built), rate=rate, delay=delay, switch=switch,
                      note=f"{nodes} namespaces on bridge br0 (namespace {switch}); every "
                           f"veth shaped with tc tbf rate {rate} burst {burst} latency "
                           f"{latency} on both ends" + (f", netem delay {delay}" if delay
                                                         else ""))
    finally:
        signal.signal(signal.SIGTERM, previous)
        _teardown(made)


def _teardown(namespaces: list[str]) -> None:
    # Deleting a namespace deletes the veth ends inside it, and with them the pairs.
    for ns in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
