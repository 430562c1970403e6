"""Process plumbing shared by the benchmarks and tools that start whole stacks: a block of free
loopback ports, and stopping a process group started with `start_new_session=True`."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from pdserve.common.ports import free_port, free_port_block

__all__ = ["free_port", "free_port_block", "stop_group"]


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
