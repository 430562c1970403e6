"""Process plumbing shared by the benchmarks and tools that start whole stacks: a block of free
loopback ports, waiting for a started server's health URL, and stopping a process group
started with `start_new_session=True`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.common.ports import free_port, free_port_block

__all__ = ["free_port", "free_port_block", "stop_group", "wait_http"]


def wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float, log: Path,
              what: str = "the server") -> None:
    """Return once `url` answers 200; raise (with the end of `log`) when `proc` (`what`)
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it answered {url}:\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling a starting server's health, not synchronisation
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s; log: {log}")


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
