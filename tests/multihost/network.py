"""Hosts for multi-host tests: network namespaces on this machine, joined by veth links or
by one bridge. Only addresses inside the namespaces made here are used; everything made is
removed afterwards, also when a test fails. Importable helpers (conftest re-exports them);
`bridged_hosts` is the general one: N hosts, names in per-namespace hosts files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.netns import in_ns, wait_operstate_up

from tests.support import cannot_run

BRIDGE_SUBNET = "10.205.{}.{}"  # bridged hosts
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts NETNS_ETC/NS/* over /etc/*


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def require_root() -> None:
    """Skip (with the reason) where namespaces cannot be made; in CI fail instead."""
    why = ("multi-host tests need root for `ip netns`" if os.geteuid() != 0 else
           "multi-host tests need iproute2's `ip`" if not shutil.which("ip") else "")
    if why:
        cannot_run(why)


def rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(in_ns(ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"),
                         capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout)


# ---- any number of hosts on one bridge ---------------------------------------------------

@dataclass(frozen=True)
class Host:
    """One host: its namespace, its interface on the bridge and that interface's address."""

    name: str
    ns: str
    dev: str
    ip: str

    def argv(self, *argv: str) -> list[str]:
        """`argv` run on this host."""
        return in_ns(self.ns, *argv)

    def pids(self) -> list[int]:
        """Every process on this host (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True,
                             timeout=30)
        return [int(p) for p in out.stdout.split()]

    def counter(self, name: str) -> int:
        """An interface statistic of this host's link, e.g. tx_bytes."""
        out = subprocess.run(self.argv("cat", f"/sys/class/net/{self.dev}/statistics/{name}"),
                             capture_output=True, text=True, check=True, timeout=30)
        return int(out.stdout)


@dataclass
class Network:
    """Hosts on one bridge (itself in a namespace of its own, so nothing is added to this
    machine's network). Every host reads the same hosts file: `set_records` maps a name to the
    addresses of some hosts, as a headless Service has one A record per pod."""

    hosts: dict[str, Host]
    records: dict[str, list[str]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def set_records(self, records: Mapping[str, Sequence[str]]) -> None:
        """name -> host names. Rewrites each hosts file in place (running processes see the
        bind-mounted file, the same inode, change)."""
        self.records = {name: list(hosts) for name, hosts in records.items()}
        lines = ["127.0.0.1 localhost", *(f"{h.ip} {h.name}" for h in self.hosts.values()),
                 *(f"{self.hosts[h].ip} {name}" for name, hs in self.records.items()
                   for h in hs)]
        for host in self.hosts.values():
            with open(NETNS_ETC / host.ns / "hosts", "w") as f:  # same inode: no rename
                f.write("\n".join(lines) + "\n")

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process on host `name` (a host's power cut); returns their pids."""
        pids = self.hosts[name].pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


@contextlib.contextmanager
def bridged_hosts(names: Sequence[str]) -> Iterator[Network]:
    """Namespaces for `names` (at most 200), each with one veth on a shared bridge
    (10.205.N.i/24) and its own /etc/netns/NS/{hosts,host.conf}. Torn down afterwards, also
    when the test fails: every process left on a host is killed, namespaces (with their links
    and the bridge) deleted, /etc/netns entries removed."""
    require_root()
    assert 0 < len(names) <= 200
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 250 + 1
    switch = f"pdS{tag}"
    bridge = "br0"  # inside the switch namespace: the name is free there
    made: list[str] = []
    hosts: dict[str, Host] = {}
    try:
        _add_ns(switch, made)
        ip("-n", switch, "link", "add", bridge, "type", "bridge")
        ip("-n", switch, "link", "set", bridge, "up")
        for i, name in enumerate(names, start=1):
            ns = f"pd{i}h{tag}"
            _add_ns(ns, made)
            host_dev, switch_dev = f"h{i}x{tag}", f"s{i}x{tag}"
            ip("link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name", switch_dev,
               "netns", switch)
            ip("-n", switch, "link", "set", switch_dev, "master", bridge)
            ip("-n", switch, "link", "set", switch_dev, "up")
            subprocess.run(in_ns(ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/"
                                 f"{host_dev}/disable_ipv6"),
                           capture_output=True, timeout=30)  # only the test's traffic counts
            address = BRIDGE_SUBNET.format(net, i)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", host_dev)
            ip("-n", ns, "link", "set", host_dev, "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "host.conf").write_text("multi on\n")  # every record of a name
            hosts[name] = Host(name, ns, host_dev, address)
        for host in hosts.values():  # links come up asynchronously
            assert wait_operstate_up(host.ns, host.dev), f"{host.dev} in {host.ns} is not up"
        network = Network(hosts)
        network.set_records({})
        yield network
    finally:
        for ns in reversed(made):
            _remove_ns(ns)


def _add_ns(ns: str, made: list[str]) -> None:
    done = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:  # root without CAP_SYS_ADMIN, e.g. in a container
        cannot_run(f"`ip netns add` failed: {done.stderr.strip()}")
    made.append(ns)
    ip("-n", ns, "link", "set", "lo", "up")


def _remove_ns(ns: str, timeout_s: float = 10.0) -> None:
    """Kill what still runs in `ns` (bounded wait), delete it and its /etc/netns entry."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = Host("", ns, "", "").pids()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # bounded poll: killed processes leave the namespace
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def scrape(host: Host, url: str) -> str:
    """GET `url` from `host` (e.g. a /metrics page on the bridge)."""
    done = subprocess.run(host.argv(sys.executable, "-c", "import sys, urllib.request; print("
                                    "urllib.request.urlopen(sys.argv[1], timeout=10).read()"
                                    ".decode())", url),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"GET {url} on {host.name}: {done.stderr[-2000:]}"
    return done.stdout
