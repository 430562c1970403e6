"""Two hosts on one machine for `pdserve bench kv --netns`: network namespaces joined by a veth
link (root and iproute2's `ip`). Each run's namespaces carry its pid in their names; they are
removed when the run ends, and a later run removes those of a run that was killed.

Each host also gets its own half of the machine's CPUs (`taskset`), as two hosts have their
own cores. Sharing them misplaces the two ends of a transfer: across a veth the sender's CPU
also does the receiving TCP work, and the scheduler wakes the reader where its waker runs, so
after the two sides sat idle for a few tens of milliseconds both ends of the next transfer ran
on one vCPU (24 MiB of raw TCP after a 50 ms pause: 11.4 ms shared, 7.1 ms pinned, on a
2-vCPU guest; 5.8-6.2 ms back to back either way).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "pdkv"
INNER_STOP_S = 90.0  # an interrupted inner run's time to stop the processes it started
SUBNET = "10.206.{}.{}"


@dataclass(frozen=True)
class Link:
    """Namespaces a and b, their ends of the veth and their addresses on it."""

    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    ip_a: str
    ip_b: str
    cpus_a: str = ""  # each host's CPUs, as `taskset -c` takes them but joined by "+"
    cpus_b: str = ""  # ("": not pinned)

    def spec(self) -> str:
        return ",".join([self.ns_a, self.ns_b, self.dev_a, self.dev_b, self.ip_a, self.ip_b,
                         self.cpus_a, self.cpus_b])

    def on_a(self, *argv: str) -> list[str]:
        """`argv` as a process of host a: in its namespace, on its CPUs."""
        return in_ns(self.ns_a, *argv, cpus=self.cpus_a)

    def on_b(self, *argv: str) -> list[str]:
        return in_ns(self.ns_b, *argv, cpus=self.cpus_b)

    def cpus_note(self) -> str:
        if not self.cpus_a:
            return "both hosts on all CPUs"
        a, b = (cpus.replace("+", ",") for cpus in (self.cpus_a, self.cpus_b))
        return f"host a on CPU {a}, b on CPU {b}"


def in_ns(ns: str, *argv: str, cpus: str = "") -> list[str]:
    pin = ["taskset", "-c", cpus.replace("+", ",")] if cpus else []
    return ["ip", "netns", "exec", ns, *pin, *argv]


def split_cpus() -> tuple[str, str]:
    """This process's CPUs in two halves, one per host ("" for both when there is one CPU or
    no `taskset`)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not shutil.which("taskset"):
        return "", ""
    half = len(cpus) // 2
    return "+".join(map(str, cpus[:half])), "+".join(map(str, cpus[half:]))


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def unavailable() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "--netns needs root (ip netns)"
    if not shutil.which("ip"):
        return "--netns needs iproute2's `ip`"
    return ""


def sweep_stale() -> list[str]:
    """Remove namespaces a killed run of this benchmark left (its pid is gone)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    removed = []
    for name in re.findall(rf"^({PREFIX}[ab](\d+))\b", out.stdout, re.M):
        try:
            os.kill(int(name[1]), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name[0]], capture_output=True, timeout=30)
            removed.append(name[0])
        except PermissionError:
            pass
    return removed


@contextlib.contextmanager
def two_hosts() -> Iterator[Link]:
    """Namespaces a and b joined by a veth (IPv6 off on it, so only the benchmark's traffic
    moves over it), each with its half of the CPUs (`Link.on_a`, `Link.on_b`); removed on
    exit, whatever happened."""
    sweep_stale()
    pid = os.getpid()
    net = pid % 250 + 1
    link = Link(f"{PREFIX}a{pid}", f"{PREFIX}b{pid}", f"kva{pid % 100000}", f"kvb{pid % 100000}",
                SUBNET.format(net, 1), SUBNET.format(net, 2), *split_cpus())
    made: list[str] = []
    try:
        for ns in (link.ns_a, link.ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", link.dev_a, "netns", link.ns_a, "type", "veth", "peer", "name",
            link.dev_b, "netns", link.ns_b)
        for ns, dev, address in ((link.ns_a, link.dev_a, link.ip_a),
                                 (link.ns_b, link.dev_b, link.ip_b)):
            subprocess.run(in_ns(ns, "sh", "-c",
                                 f"echo 1 > /proc/sys/net/ipv6/conf/{dev}/disable_ipv6"),
                           capture_output=True, timeout=30)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        for ns, dev in ((link.ns_a, link.dev_a), (link.ns_b, link.dev_b)):
            if not wait_operstate_up(ns, dev):
                raise RuntimeError(f"{dev} in {ns} did not come up")
        yield link
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def rerun_inside(prog: str, module: str, argv: list[str]) -> int:
    """Make the two namespaces and a scratch directory, run `python -m module argv --in-netns
    SPEC` inside namespace a (SPEC: `Link.spec` and the directory), remove them all after.
    Interrupted (Ctrl-C, SIGTERM), the inner run is stopped first, so it stops what it
    started (it calls `stop_on_sigterm`), then the namespaces go."""
    why = unavailable()
    if why:
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    stop_on_sigterm()
    with two_hosts() as link, tempfile.TemporaryDirectory(prefix=f"{PREFIX}-") as scratch:
        inner = subprocess.Popen(link.on_a(sys.executable, "-m", module, *argv,
                                           "--in-netns", f"{link.spec()},{scratch}"))
        try:
            return inner.wait()
        except KeyboardInterrupt:
            inner.send_signal(signal.SIGTERM)
            try:
                inner.wait(INNER_STOP_S)
            except subprocess.TimeoutExpired:
                inner.kill()
                inner.wait()
            print(f"{prog}: interrupted; its processes and namespaces are removed",
                  file=sys.stderr)
            return 130


def stop_on_sigterm() -> None:
    """SIGTERM (and Ctrl-C) raise KeyboardInterrupt once, so what a run started is stopped on
    the way out; later ones are ignored, so they cannot cut that short (a terminal's Ctrl-C
    reaches both runs, and the outer one then also sends SIGTERM to the inner one)."""
    def interrupt(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)


def from_spec(spec: str) -> tuple[Link, str]:
    """The link and scratch directory `rerun_inside` passed in `--in-netns`."""
    *fields, scratch = spec.split(",")
    return Link(*fields), scratch


def wait_operstate_up(ns: str, dev: str, timeout_s: float = 20.0) -> bool:
    """Whether `dev` in `ns` came up within `timeout_s` (a link comes up asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(in_ns(ns, "cat", f"/sys/class/net/{dev}/operstate"),
                             capture_output=True, text=True, timeout=30)
        if out.stdout.strip() == "up":
            return True
        time.sleep(0.05)  # bounded poll of the interface state
    return False
