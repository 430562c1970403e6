"""Process plumbing shared by the benchmarks and tools that start whole stacks: a block of free
loopback ports, and stopping a process group started with `start_new_session=True`."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from typing import Any


def free_port() -> int:
    """One free loopback port (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int) -> int:
    """A base port with `n` free loopback ports above it (checked by binding)."""
    for _ in range(100):
        base = random.randint(41000, 59000)
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 60) -> None:
    """SIGTERM a process started with `start_new_session=True` and everything it started;
    SIGKILL what is left after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
