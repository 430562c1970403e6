"""Two hosts on one machine: network namespaces joined by two veth links.

Host A runs the router, a prefill worker and its kvtransfer agent; host B runs a decode worker
and its agent. All gRPC (router, workers, the agents' control calls) uses the control link;
the agents advertise their data path on a second link that carries nothing else. The KV
handoff must cross that data link (UCX over TCP, or the TCP transport): the bytes received on
host B's data interface grow by at least the handoffs' size and by little more, the control
link carries far less than the KV, and the output still equals transformers token for token.
Only addresses inside the namespaces made here are used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.support import ServiceProcess

pytestmark = pytest.mark.multihost

SUBNET = "10.203.{}.{}"  # control link
DATA_SUBNET = "10.204.{}.{}"  # data link: KV bytes only


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def require_root() -> None:
    """Skip (with the reason) where namespaces cannot be made; in CI (CI=true) fail instead,
    so the test can never silently not run there."""
    why = ("multi-host tests need root for `ip netns`" if os.geteuid() != 0 else
           "multi-host tests need iproute2's `ip`" if not shutil.which("ip") else "")
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{why}, and CI must run them")
        pytest.skip(why)


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
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for dev_a, dev_b, subnet in links.values():
            _ip("link", "add", dev_a, "netns", a, "type", "veth", "peer", "name", dev_b,
                "netns", b)
            for ns, dev, host in ((a, dev_a, 1), (b, dev_b, 2)):
                _ip("-n", ns, "addr", "add", f"{subnet.format(net, host)}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
            for ns, dev in ((a, dev_a), (b, dev_b)):  # a link comes up asynchronously
                assert _wait_operstate_up(ns, dev), f"{dev} in {ns} did not come up"
        (ca, cb, _), (da, db, _) = links["ctl"], links["data"]
        yield {"A": (a, ca, SUBNET.format(net, 1), da, DATA_SUBNET.format(net, 1)),
               "B": (b, cb, SUBNET.format(net, 2), db, DATA_SUBNET.format(net, 2))}
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
    ns_a, ctl_a, ip_a, data_a, data_ip_a = hosts["A"]
    ns_b, ctl_b, ip_b, data_b, data_ip_b = hosts["B"]
    py = [sys.executable, "-m"]
    ucx_env = {"UCX_TLS": "tcp"}  # same machine: keep UCX off shared memory so it uses a link
    procs = [  # the agents' data path on the data link, their gRPC on the control link
        (_in(ns_a, *py, "pdserve.kvtransfer.main", "--port", "50081",
             "--advertise-host", data_ip_a, "--transport", transport),
         {**ucx_env, "UCX_NET_DEVICES": data_a}),
        (_in(ns_b, *py, "pdserve.kvtransfer.main", "--port", "50081",
             "--advertise-host", data_ip_b, "--transport", transport),
         {**ucx_env, "UCX_NET_DEVICES": data_b}),
        (_in(ns_a, *py, "pdserve.prefill.main", "--kv-agent", f"{ip_a}:50081",
             "--advertise-host", ip_a, "--kv-cache-mb", "16"), {}),
        (_in(ns_b, *py, "pdserve.decode.main", "--kv-agent", f"{ip_b}:50081",
             "--advertise-host", ip_b, "--kv-cache-mb", "16"), {}),
        (_in(ns_a, *py, "pdserve.router.main", "--model", str(tiny_model_dir),
             "--prefill", f"{ip_a}:50061", "--decode", f"{ip_b}:50071"), {}),
    ]
    running = [ServiceProcess(argv, env) for argv, env in procs]
    try:
        before = _rx_bytes(ns_b, data_b), _rx_bytes(ns_b, ctl_b)
        prompts = PROMPTS[:4]
        done = subprocess.run(_in(ns_a, sys.executable, "-c", DRIVER, f"{ip_a}:50051",
                                  json.dumps(prompts), str(MAX_TOKENS)),
                              capture_output=True, text=True, timeout=300)
        logs = "\n".join(f"--- {' '.join(p.proc.args[3:6])}\n{p.output()[-1500:]}" for p in running)
        assert done.returncode == 0, done.stderr + logs
        data_rx = _rx_bytes(ns_b, data_b) - before[0]
        control_rx = _rx_bytes(ns_b, ctl_b) - before[1]
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
        # Only the agents use the data link: it carried the KV (plus TCP/IP and per-handoff
        # header overhead), and the control link carried a small fraction of that.
        assert data_rx >= kv_bytes, f"only {data_rx} of {kv_bytes} KV bytes crossed the data link"
        assert data_rx <= 1.25 * kv_bytes + 256 * 1024, f"{data_rx} bytes for {kv_bytes} of KV"
        assert control_rx < kv_bytes / 2, f"{control_rx} control bytes for {kv_bytes} of KV"
    finally:
        for p in reversed(running):
            p.stop()
            Path(p.log.name).unlink(missing_ok=True)
