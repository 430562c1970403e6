"""Fixtures and stacks for multi-host tests (hosts themselves: tests/multihost/network.py).

Two layouts: `hosts` (A and B joined by a control link and a data link, with
`two_host_stack`) and `bridged_hosts` (any number of hosts on one bridge, names resolved
through per-namespace hosts files as a cluster's DNS would, with `pool_stack`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pdserve.common.shm import SHM_DIR, leftover_segments

from tests.multihost.network import (
    NETNS_ETC,
    Host,
    Network,
    bridged_hosts,
    cannot_run,
    in_ns,
    ip,
    require_root,
    rx_bytes,
    scrape,
    wait_operstate_up,
)
from tests.support import ServiceProcess

__all__ = ["NETNS_ETC", "Host", "Network", "bridged_hosts", "cannot_run", "in_ns", "ip",
           "require_root", "rx_bytes", "scrape", "wait_operstate_up", "hosts", "two_host_stack",
           "logs_of", "PoolStack", "pool_stack"]

SUBNET = "10.203.{}.{}"  # control link
DATA_SUBNET = "10.204.{}.{}"  # data link: KV bytes only


@pytest.fixture
def hosts():
    """Namespaces `A` and `B` joined by a control link (10.203.N.1/.2) and a data link
    (10.204.N.1/.2); yields per host (namespace, control dev, control ip, data dev, data ip)."""
    require_root()
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 250 + 1
    a, b = f"pdA{tag}", f"pdB{tag}"
    links = {"ctl": (f"va{tag}", f"vb{tag}", SUBNET), "data": (f"da{tag}", f"db{tag}", DATA_SUBNET)}
    created = []
    try:
        for ns in (a, b):
            made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True,
                                  timeout=30)
            if made.returncode != 0:  # root without CAP_SYS_ADMIN, e.g. in a container
                cannot_run(f"`ip netns add` failed: {made.stderr.strip()}")
            created.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for dev_a, dev_b, subnet in links.values():
            ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b,
                "netns", b)
            for ns, dev, host in ((a, dev_a, 1), (b, dev_b, 2)):
                if subnet is DATA_SUBNET:  # no IPv6 neighbour/router chatter on the KV link
                    subprocess.run(in_ns(ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/"
                                         f"{dev}/disable_ipv6"),
                                   capture_output=True, timeout=30)  # absent without IPv6
                ip("-n", ns, "addr", "add", f"{subnet.format(net, host)}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
            for ns, dev in ((a, dev_a), (b, dev_b)):  # a link comes up asynchronously
                assert wait_operstate_up(ns, dev), f"{dev} in {ns} did not come up"
        (ca, cb, _), (da, db, _) = links["ctl"], links["data"]
        yield {"A": (a, ca, SUBNET.format(net, 1), da, DATA_SUBNET.format(net, 1)),
               "B": (b, cb, SUBNET.format(net, 2), db, DATA_SUBNET.format(net, 2))}
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@contextlib.contextmanager
def two_host_stack(hosts: dict[str, tuple[str, str, str, str, str]], transport: str,
                   model_dir: Path, extra: dict[str, tuple[str, ...]] | None = None
                   ) -> Iterator[list[ServiceProcess]]:
    """Router, prefill worker and agent on host A; decode worker and agent on host B. All
    gRPC on the control link; the agents' data path on the data link (UCX over TCP there, so
    it never takes shared memory on this one machine). `extra`: more flags per role (agent,
    prefill, decode, router). Stopped, logs removed, on exit."""
    more = extra or {}
    ns_a, _, ip_a, data_a, data_ip_a = hosts["A"]
    ns_b, _, ip_b, data_b, data_ip_b = hosts["B"]
    py = [sys.executable, "-m"]
    ucx = {"UCX_TLS": "tcp"}
    procs = [
        (in_ns(ns_a, *py, "pdserve.kvtransfer.main", "--port", "50081",
               "--advertise-host", data_ip_a, "--transport", transport, *more.get("agent", ())),
         {**ucx, "UCX_NET_DEVICES": data_a}),
        (in_ns(ns_b, *py, "pdserve.kvtransfer.main", "--port", "50081",
               "--advertise-host", data_ip_b, "--transport", transport, *more.get("agent", ())),
         {**ucx, "UCX_NET_DEVICES": data_b}),
        (in_ns(ns_a, *py, "pdserve.prefill.main", "--kv-agent", f"{ip_a}:50081",
               "--advertise-host", ip_a, "--kv-cache-mb", "16", *more.get("prefill", ())), {}),
        (in_ns(ns_b, *py, "pdserve.decode.main", "--kv-agent", f"{ip_b}:50081",
               "--advertise-host", ip_b, "--kv-cache-mb", "16", *more.get("decode", ())), {}),
        (in_ns(ns_a, *py, "pdserve.router.main", "--model", str(model_dir),
               "--prefill", f"{ip_a}:50061", "--decode", f"{ip_b}:50071",
               *more.get("router", ())), {}),
    ]
    running = [ServiceProcess(argv, env) for argv, env in procs]
    try:
        yield running
    finally:
        for p in reversed(running):
            p.stop()


def logs_of(running: list[ServiceProcess]) -> str:
    return "\n".join(f"--- {' '.join(p.proc.args[3:6])}\n{p.output()[-1500:]}" for p in running)


@dataclass
class PoolStack:
    """A router discovering prefill and decode pools by DNS name, each worker host with its
    own agent (see `pool_stack`)."""

    network: Network
    router: Host
    prefill: list[Host]
    decode: list[Host]
    transport: str
    processes: dict[str, ServiceProcess] = field(default_factory=dict)  # "role@host" -> process

    def address(self, host: Host, port: int) -> str:
        return f"{host.ip}:{port}"

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{p.output()[-1500:]}" for name, p in self.processes.items())


ROUTER_PORT, PREFILL_PORT, DECODE_PORT, AGENT_PORT = 50051, 50061, 50071, 50081
ROUTER_METRICS, AGENT_METRICS = 9051, 9081


@contextlib.contextmanager
def pool_stack(network: Network, transport: str, model_dir: Path, *, router: str,
               prefill: Sequence[str], decode: Sequence[str],
               worker_flags: Sequence[str] = (),
               worker_env: dict[str, dict[str, str]] | None = None) -> Iterator[PoolStack]:
    """On each prefill and decode host a kvtransfer agent (`--agent-id kv-HOST`, advertising
    the host's address) and a worker that reaches it at 127.0.0.1 (as a pod's sidecar) and
    advertises the host's address; on `router` a router given `dns:///prefill-pool:50061` and
    `dns:///decode-pool:50071`, whose records list the worker hosts. `worker_env`: more
    environment for the worker of a host, by host name. Every process is stopped (and its log
    removed) on exit."""
    py = [sys.executable, "-m"]
    stack = PoolStack(network, network[router], [network[h] for h in prefill],
                      [network[h] for h in decode], transport)
    network.set_records({**network.records, "prefill-pool": list(prefill),
                         "decode-pool": list(decode)})
    argv: dict[str, tuple[list[str], dict[str, str]]] = {}
    for role, hosts in (("prefill", stack.prefill), ("decode", stack.decode)):
        for host in hosts:
            # UCX over TCP on the bridge only: never shared memory between these "hosts".
            ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.dev}
            argv[f"kvtransfer@{host.name}"] = (host.argv(
                *py, "pdserve.kvtransfer.main", "--port", str(AGENT_PORT), "--advertise-host",
                host.ip, "--transport", transport, "--agent-id", f"kv-{host.name}"), ucx)
            argv[f"{role}@{host.name}"] = (host.argv(
                *py, f"pdserve.{role}.main", "--kv-agent", f"127.0.0.1:{AGENT_PORT}",
                "--advertise-host", host.ip, "--kv-cache-mb", "16", "--threads", "1",
                *worker_flags), dict((worker_env or {}).get(host.name, {})))
    argv[f"router@{router}"] = (stack.router.argv(
        *py, "pdserve.router.main", "--model", str(model_dir),
        "--prefill", f"dns:///prefill-pool:{PREFILL_PORT}",
        "--decode", f"dns:///decode-pool:{DECODE_PORT}",
        "--discovery-interval-s", "0.5", "--health-interval-s", "0.5"), {})
    try:
        for name, (args, env) in argv.items():
            stack.processes[name] = ServiceProcess(args, env)
        yield stack
    finally:
        for p in reversed(stack.processes.values()):
            p.stop()
            # A killed worker could not unlink its pool segment: as the kubelet wipes a dead
            # pod's emptyDir, the harness that killed it removes it.
            for name in leftover_segments(p.proc.pid):
                (SHM_DIR / name).unlink(missing_ok=True)
