"""Free TCP ports on loopback for a rendezvous that binds them a moment later.

Why not ``bind(("127.0.0.1", 0))`` and hand the number on, as torchelastic and Ray Train do: the
kernel draws that port from its ephemeral range, the same range it draws the local end of every
outgoing connection from, so between the release here and the rendezvous' own bind any connection on
the machine (Ray's gRPC clients, an S3 client, another job's ranks) may take it and the process
group fails with EADDRINUSE (seen in the suite on a busy machine). A port drawn below that range is
never given to a connection or to another ``bind(0)``. It is drawn above ``ray start``'s worker ports
too (10002-19999 by default: each Ray worker binds the next one the raylet hands it, without a
check, so a port there checked free here was taken by a starting Ray worker before the rendezvous
bound it, also seen in the suite). Only a process naming the same port could take it, and a port
is not handed out twice by one process. Ports are drawn from the system's entropy, never from the
``random`` module: a training loop seeds that (exact resume restores it), so processes that ran the same
job in-process drew the same "random" ports and took each other's rendezvous (seen in the suite: its
xdist workers, each having trained with the same seed).
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_FIRST = 20000  # the lowest port drawn: above `ray start`'s default worker ports (--max-worker-port 19999)
_HANDED_OUT: set[int] = set()  # every port this process gave out: a rendezvous binds it seconds later
_TRIES = 200
_DRAW = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it is unreadable)."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, each bound once here to check it, all held until every one is chosen."""
    low = ephemeral_low()
    first = _FIRST if low - _FIRST >= 4096 else max(1024, low - 4096)  # a narrowed ephemeral range: below it
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(_TRIES):
            if len(ports) == n:
                break
            port = _DRAW.randrange(first, low) if low > first else 0
            if port in _HANDED_OUT:
                continue
            s = socket.socket()
            held.append(s)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
            ports.append(port)
            _HANDED_OUT.add(port)
        if len(ports) < n:
            raise OSError(f"no {n} free TCP ports on 127.0.0.1 below {low} after {_TRIES} tries")
        return ports
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """One free port (a process group's rendezvous, a local server)."""
    return free_ports(1)[0]
