"""Hosts for multi-host tests: network namespaces on this machine joined by veth links.
Only addresses inside the namespaces made here are used; they are removed afterwards, also
when a test fails."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ServiceProcess

SUBNET = "10.203.{}.{}"  # control link
DATA_SUBNET = "10.204.{}.{}"  # data link: KV bytes only


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def cannot_run(why: str) -> None:
    """Skip with the reason; in CI (CI=true) fail instead, so these tests never silently do
    not run there."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}, and CI must run them")
    pytest.skip(why)


def require_root() -> None:
    """Skip (with the reason) where namespaces cannot be made; in CI fail instead."""
    why = ("multi-host tests need root for `ip netns`" if os.geteuid() != 0 else
           "multi-host tests need iproute2's `ip`" if not shutil.which("ip") else "")
    if why:
        cannot_run(why)


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


def wait_operstate_up(ns: str, dev: str, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(in_ns(ns, "cat", f"/sys/class/net/{dev}/operstate"),
                             capture_output=True, text=True, timeout=30)
        if out.stdout.strip() == "up":
            return True
        time.sleep(0.05)  # bounded poll of the interface state
    return False


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(in_ns(ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"),
                         capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout)


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
            Path(p.log.name).unlink(missing_ok=True)


def logs_of(running: list[ServiceProcess]) -> str:
    return "\n".join(f"--- {' '.join(p.proc.args[3:6])}\n{p.output()[-1500:]}" for p in running)
