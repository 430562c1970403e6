"""Two hosts on one machine: network namespaces joined by a veth link.

Host A runs the router, a prefill worker and its kvtransfer agent; host B runs a decode worker
and its agent. The KV handoff must cross the link (UCX over TCP, or the TCP transport): the
bytes counted on host B's interface grow by at least the handoff's size, and the output still
equals transformers token for token. Only addresses inside the namespaces made here are used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.support import ServiceProcess

pytestmark = pytest.mark.multihost

SUBNET = "10.203.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    """Two namespaces, `A` 10.203.N.1 and `B` 10.203.N.2, linked by a veth pair."""
    if os.geteuid() != 0:
        pytest.fail("multi-host tests need root for `ip netns` (CI runs as root)")
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 250 + 1
    a, b = f"pdA{tag}", f"pdB{tag}"
    dev_a, dev_b = f"va{tag}", f"vb{tag}"
    created = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b, "netns", b)
        for ns, dev, host in ((a, dev_a, 1), (b, dev_b, 2)):
            _ip("-n", ns, "addr", "add", f"{SUBNET.format(net, host)}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        for ns, dev in ((a, dev_a), (b, dev_b)):  # the link comes up asynchronously
            assert _wait_operstate_up(ns, dev), f"{dev} in {ns} did not come up"
        yield {"A": (a, dev_a, SUBNET.format(net, 1)), "B": (b, dev_b, SUBNET.format(net, 2))}
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _wait_operstate_up(ns: str, dev: str, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(_in(ns, "cat", f"/sys/class/net/{dev}/operstate"),
                             capture_output=True, text=True, timeout=30)
        if out.stdout.strip() == "up":
            return True
        time.sleep(0.05)  # bounded poll of the interface state
    return False


def _in(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(_in(ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"),
                         capture_output=True, text=True, check=True, timeout=30)
    return int(out.stdout)


DRIVER = textwrap.dedent("""
    import json, sys, grpc
    from google.protobuf.json_format import MessageToDict
    from pdserve.common.health import wait_serving
    from pdserve.v1 import router_pb2, router_pb2_grpc
    router, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    wait_serving(router, 120)
    with grpc.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for p in prompts:
            msgs = [MessageToDict(m, preserving_proto_field_name=True) for m in stub.Generate(
                router_pb2.GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=0.0), timeout=120)]
            print(json.dumps(msgs), flush=True)
""")


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_kv_handoff_crosses_the_link_between_two_hosts(hosts, transport, reference, tiny_model_dir):
    ns_a, dev_a, ip_a = hosts["A"]
    ns_b, dev_b, ip_b = hosts["B"]
    py = [sys.executable, "-m"]
    ucx_env = {"UCX_TLS": "tcp"}  # same machine: keep UCX off shared memory so it uses the link
    procs = [
        (_in(ns_a, *py, "pdserve.kvtransfer.main", "--port", "50081", "--advertise-host", ip_a,
             "--transport", transport), {**ucx_env, "UCX_NET_DEVICES": dev_a}),
        (_in(ns_b, *py, "pdserve.kvtransfer.main", "--port", "50081", "--advertise-host", ip_b,
             "--transport", transport), {**ucx_env, "UCX_NET_DEVICES": dev_b}),
        (_in(ns_a, *py, "pdserve.prefill.main", "--kv-agent", f"{ip_a}:50081",
             "--advertise-host", ip_a, "--kv-cache-mb", "16"), {}),
        (_in(ns_b, *py, "pdserve.decode.main", "--kv-agent", f"{ip_b}:50081",
             "--advertise-host", ip_b, "--kv-cache-mb", "16"), {}),
        (_in(ns_a, *py, "pdserve.router.main", "--model", str(tiny_model_dir),
             "--prefill", f"{ip_a}:50061", "--decode", f"{ip_b}:50071"), {}),
    ]
    running = [ServiceProcess(argv, env) for argv, env in procs]
    try:
        before = _rx_bytes(ns_b, dev_b)
        prompts = PROMPTS[:4]
        done = subprocess.run(_in(ns_a, sys.executable, "-c", DRIVER, f"{ip_a}:50051",
                                  json.dumps(prompts), str(MAX_TOKENS)),
                              capture_output=True, text=True, timeout=300)
        logs = "\n".join(f"--- {' '.join(p.proc.args[3:6])}\n{p.output()[-1500:]}" for p in running)
        assert done.returncode == 0, done.stderr + logs
        after = _rx_bytes(ns_b, dev_b)
        tok, refs = reference
        kv_bytes = 0
        for prompt, line in zip(prompts, done.stdout.splitlines()):
            msgs = json.loads(line)
            ids = [int(t) for m in msgs if "delta" in m for t in m["delta"].get("token_ids", [])]
            timing = next(m["timing"] for m in msgs if "timing" in m)
            assert ids == refs[prompt][1], prompt
            assert timing["kv_transport"] == transport
            assert timing["decode_worker"].startswith(f"decode@{ip_b}")
            kv_bytes += int(timing["kv_bytes"])
        assert kv_bytes > 0
        assert after - before >= kv_bytes, "the KV bytes did not cross the veth link"
    finally:
        for p in reversed(running):
            p.stop()
            Path(p.log.name).unlink(missing_ok=True)
