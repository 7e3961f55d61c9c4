"""A private network a test makes for itself: a bridge in the root namespace on a /24 of 10.213.0.0/16
that nothing on this machine uses, and one network namespace per worker node, joined to the bridge by
a veth pair. Everything is named with the test's own token and removed in ``finally``.

Why namespaces: a reclaimed VM often vanishes without closing its connections (no RST, no exit code),
and only a link that stops carrying packets reproduces that on one machine. ``Node.cut`` sets the
node's end of its veth down: the bridge side loses carrier, packets to and from the node are dropped
without a reply, established TCP connections hang (until a timeout) and a new connection to it fails
only after ARP gives up, as for a host gone from its subnet. (``iptables``/``tc netem``/tc classifiers
are not available on every kernel; a veth's state is.)

The namespaces have no route but the test's /24, so a node cannot reach any address the test did not
create. Needs root and ``ip netns``: ``require_netns()`` skips the test otherwise, naming what is missing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

INNER_IF = "spnet0"  # the node's end of its veth, the same name in every namespace (GLOO_SOCKET_IFNAME)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def require_netns() -> None:
    """Skip (never fail) where the capability is missing: not root, no ``ip``, or namespaces refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes network namespaces and veth pairs")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` (network namespaces)")
    probe = f"sp-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` is refused here: {made.stderr.strip()[:200]}")
    try:  # the link kinds the test makes, tried inside the probe namespace (nothing outside it changes)
        for kind in (["sp-br", "type", "bridge"], ["sp-v0", "type", "veth", "peer", "name", "sp-v1"]):
            tried = subprocess.run(
                ["ip", "netns", "exec", probe, "ip", "link", "add", *kind], capture_output=True, text=True
            )
            if tried.returncode != 0:
                pytest.skip(f"`ip link add ... {kind[2]}` is refused here: {tried.stderr.strip()[:200]}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.k.0/24 that no address or route of this machine's root namespace overlaps."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    nets = []
    for word in used.split():
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(word, strict=False))
    ks = list(range(1, 255))
    random.shuffle(ks)  # two tests at once rarely pick the same one
    for k in ks:
        net = ipaddress.ip_network(f"10.213.{k}.0/24")
        if not any(net.overlaps(n) for n in nets if n.prefixlen > 0):
            return net
    raise AssertionError("no free /24 in 10.213.0.0/16 on this machine")


@dataclass
class Node:
    """One worker node's namespace: ``prefix`` runs a command inside it."""

    ns: str
    ip: str
    host_if: str  # the veth end on the bridge (root namespace)

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        """The node goes silent: its end of the link goes down; nothing is sent to anyone (no RST, no FIN)."""
        _ip("link", "set", INNER_IF, "down", ns=self.ns)


@dataclass
class Network:
    subnet: ipaddress.IPv4Network
    bridge: str
    token: str
    head_ip: str  # the bridge's address, in the root namespace: the Ray head binds here
    nodes: list[Node] = field(default_factory=list)
    _hosts: Iterator[ipaddress.IPv4Address] | None = None

    def add_node(self) -> Node:
        """A new namespace with ``lo`` up and one veth to the bridge, on the next free address."""
        assert self._hosts is not None
        i = len(self.nodes)
        ip = str(next(self._hosts))
        node = Node(ns=f"sp-{self.token}-{i}", ip=ip, host_if=f"spv{self.token}{i}")
        self.nodes.append(node)  # before anything is made: teardown removes what exists of it
        subprocess.run(["ip", "netns", "add", node.ns], check=True, capture_output=True, timeout=30)
        _ip("link", "set", "lo", "up", ns=node.ns)
        tmp = f"spt{self.token}{i}"  # made in the root namespace, renamed to INNER_IF inside the node's
        _ip("link", "add", node.host_if, "type", "veth", "peer", "name", tmp)
        _ip("link", "set", tmp, "netns", node.ns)
        _ip("link", "set", tmp, "name", INNER_IF, ns=node.ns)
        _ip("addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", INNER_IF, ns=node.ns)
        _ip("link", "set", INNER_IF, "up", ns=node.ns)
        _ip("link", "set", node.host_if, "master", self.bridge)
        _ip("link", "set", node.host_if, "up")
        routes = _ip("-4", "route", "show", "table", "all", ns=node.ns).stdout
        assert "default" not in routes, f"namespace {node.ns} has a default route:\n{routes}"
        return node


def _pids_in(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


@contextlib.contextmanager
def private_network() -> Iterator[Network]:
    """The bridge (``head_ip`` on it) and, through ``add_node``, the namespaces; all removed at the end,
    with any process still inside a namespace the test made (the test started them all) killed first."""
    require_netns()
    token = uuid.uuid4().hex[:5]
    subnet = _free_subnet()
    hosts = subnet.hosts()
    head_ip = str(next(hosts))
    net = Network(subnet=subnet, bridge=f"spb{token}", token=token, head_ip=head_ip, _hosts=hosts)
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{head_ip}/{subnet.prefixlen}", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        yield net
    finally:
        for node in net.nodes:
            for pid in _pids_in(node.ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_pids_in(n.ns) for n in net.nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in net.nodes:
            _ip("link", "del", node.host_if, check=False)  # its peer goes with it
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True, timeout=30)
        _ip("link", "del", net.bridge, check=False)
