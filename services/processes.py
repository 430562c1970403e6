"""The processes of a stack on one machine (`pdserve up`): start them, wait until each
serves, stop them.

Every process runs in a session of its own (so a signal reaches its children too), pinned to
its cores when it has some, and gets SIGTERM when the supervising process dies, even by
SIGKILL (Linux). All start at once and are waited for in dependency order; they stop tier by
tier: the router, then the workers, then the kvtransfer agents, so handoffs in flight finish.
What runs, with which flags, is `pdserve up`'s plan (up.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common.health import wait_serving
from pdserve.common.ports import listened_on
from pdserve.common.security import ChannelSecurity

PR_SET_PDEATHSIG = 1


@dataclass
class Proc:
    """One planned process: its name (`prefill-0`, `kvtransfer-a`), the address it serves on,
    its command line; once started, its process and log file."""

    name: str
    address: str
    argv: list[str]
    metrics_port: int = -1
    cpus: list[int] | None = None  # pinned to these cores (None: wherever the OS runs it)
    ports: list[int] = field(default_factory=list)  # the fixed ports it listens on
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None


class Stack:
    """The planned processes, started (`start`) and stopped (`stop`) together."""

    def __init__(self, procs: list[Proc], log_dir: Path, env: dict[str, str] | None = None,
                 security: ChannelSecurity | None = None):
        self.procs = procs
        self.log_dir = log_dir
        self.security = security
        self.env = {**os.environ, **(env or {})}  # every process's environment

    def start(self, timeout_s: float) -> None:
        for p in self.procs:
            p.log = self.log_dir / f"{p.name}.log"
            with open(p.log, "wb") as out:
                p.popen = subprocess.Popen(p.argv, stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True,
                                           preexec_fn=_child_setup(p.cpus))
        for p in self.procs:  # all start at once; wait in dependency order
            print(f"  waiting for {p.name:<12} {p.address} ...", end="", flush=True)
            try:
                wait_serving(p.address, timeout_s, p.popen, security=self.security)
            except (TimeoutError, RuntimeError) as exc:
                print(" failed")
                raise RuntimeError(f"{p.name} did not come up: {exc}\n--- last lines of "
                                   f"{p.log} ---\n{self.tail(p)}") from None
            print(" serving", flush=True)
        dead = self.exited()  # its SERVING came from whatever took its port since the check
        if dead:
            p = dead[0]
            code = p.popen.returncode if p.popen else None
            raise RuntimeError(f"{p.name} exited with status {code} while the stack started\n"
                               f"--- last lines of {p.log} ---\n{self.tail(p)}")

    def watch(self, poll_s: float = 0.5) -> int:
        """Serve until interrupted, reporting each process that exits: the rest keep serving
        without a worker or an agent (the router routes around it); without the router nothing
        does, so then (or once every process exited) returns 1."""
        reported: set[str] = set()
        while True:
            time.sleep(poll_s)  # the interval of the supervision poll
            for dead in self.exited():
                if dead.name in reported:
                    continue
                reported.add(dead.name)
                code = dead.popen.returncode if dead.popen else None
                fatal = dead.name == "router" or len(reported) == len(self.procs)
                then = "stopping the stack" if fatal else "the other processes keep serving"
                print(f"{dead.name} exited with status {code}; {then}. Its last lines:\n"
                      f"{self.tail(dead)}", file=sys.stderr, flush=True)
                if fatal:
                    return 1

    def tail(self, p: Proc, lines: int = 25) -> str:
        if p.log is None:
            return ""
        try:
            return "\n".join(p.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exited(self) -> list[Proc]:
        return [p for p in self.procs if p.popen and p.popen.poll() is not None]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM tier by tier: the router, then every worker at once, then the agents (so
        handoffs in flight can finish), each tier within `timeout_s`; SIGKILL leftovers."""
        for tier in (0, 1, 2):
            procs = [p for p in self.procs if p.popen and _stop_tier(p.name) == tier]
            for p in procs:
                if p.popen and p.popen.poll() is None:
                    _signal_group(p.popen, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for p in procs:
                assert p.popen is not None
                try:
                    p.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(p.popen, signal.SIGKILL)
                p.popen.wait()


def port_conflicts(procs: list[Proc]) -> list[str]:
    """Why the planned ports cannot all be listened on ([] when they can): a port planned
    for two processes, or one that something already listens on (another `pdserve up`
    would otherwise answer this one's readiness checks)."""
    owner: dict[int, str] = {}
    problems = []
    for p in procs:
        for port in p.ports:
            if port in owner:
                problems.append(f"port {port} is planned for both {owner[port]} and {p.name}")
                continue
            owner[port] = p.name
            if listened_on(port):
                problems.append(f"port {port} ({p.name}) is already in use")
    return problems


def _stop_tier(name: str) -> int:
    """When a process stops: the router (0), the workers (1), the kvtransfer agents (2)."""
    role = name.partition("-")[0]
    return 0 if role == "router" else 2 if role == "kvtransfer" else 1


def _child_setup(cpus: list[int] | None) -> Callable[[], None]:
    """In the child, before it runs: its cores, and SIGTERM if `pdserve up` itself dies, even
    by SIGKILL (Linux)."""
    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
    return setup


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass
