"""Free loopback ports for the stacks pdserve starts itself (benchmarks, `plan validate`) and
for the test suite.

A port the kernel picks (bind to port 0) comes from the ephemeral range, the same range every
outgoing connection takes its local port from: between our pick and the service's own bind,
a client connection anywhere on the machine may take it (seen in CI: a router's HTTP port was
taken and the router exited with "address already in use"). So ports are picked below the
ephemeral range, where only listeners live, each checked by binding it, and a port is never
handed out twice by one process.
"""

from __future__ import annotations

import errno
import random
import socket
import threading
from pathlib import Path

# Listeners only: below Linux's default ephemeral range (32768-60999) and above the ports
# services commonly claim.
_LOW = 20000
_TRIES = 200

_lock = threading.Lock()
_given: set[int] = set()


def listener_range() -> tuple[int, int]:
    """[low, high) for picks: below the machine's ephemeral range, or above it if that
    leaves too few."""
    try:
        lo, hi = (int(v) for v in
                  Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    if lo - _LOW >= 2000:
        return _LOW, lo
    if 65535 - hi >= 2000:
        return hi + 1, 65536
    return 1024, 65536  # the whole space is ephemeral: the bind check is all there is


def listened_on(port: int) -> bool:
    """Whether something listens on `port`: binding 0.0.0.0, as the services do, fails as
    taken (with SO_REUSEADDR, as theirs: a port left in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def bindable(port: int) -> bool:
    """Whether `port` can be bound now on every interface and on loopback."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port_block(n: int = 1) -> int:
    """A base port with `n` consecutive free loopback ports from it (each checked by binding),
    none handed out before by this process."""
    lo, hi = listener_range()
    with _lock:
        for _ in range(_TRIES):
            base = random.randrange(lo, hi - n)
            block = range(base, base + n)
            if any(p in _given for p in block) or not all(bindable(p) for p in block):
                continue
            _given.update(block)
            return base
    raise RuntimeError(f"no block of {n} free loopback ports in {lo}-{hi - 1} after {_TRIES} tries")


def free_port() -> int:
    """One free loopback port, outside the ephemeral range."""
    return free_port_block(1)
