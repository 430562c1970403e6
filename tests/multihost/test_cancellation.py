"""A client that cancels while its KV is on the wire, against real processes on two hosts.

The data link between the agents is rate-limited (`tc ... tbf`), so a long prompt's handoff
takes seconds while gRPC on the control link stays fast. The driver (inside host A) waits
until prefill has finished and holds the pages only for the send, cancels, and reports; the
test asserts that no token reached the client and every page came back on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multihost.conftest import in_ns, logs_of, two_host_stack

pytestmark = pytest.mark.multihost

DRIVER = """
import json, sys, threading, time, grpc
from pdserve.common.health import wait_serving
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc
router, prefill, decode = sys.argv[1:4]
for address in (prefill, decode, router):
    wait_serving(address, 120)

def stats(stub):
    return stub.Stats(common_pb2.StatsRequest(), timeout=10)

def poll(pred, timeout_s=60.0):  # bounded
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False

p = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill))
d = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(decode))
p0, d0 = stats(p), stats(d)
call = router_pb2_grpc.RouterStub(grpc.insecure_channel(router)).Generate(
    router_pb2.GenerateRequest(token_ids=[5 + i % 900 for i in range(2000)], max_tokens=4,
                               temperature=0.0), timeout=120)
kinds, error = [], []
def read():
    try:
        kinds.extend(m.WhichOneof("kind") for m in call)
    except grpc.RpcError as exc:
        error.append(exc.code().name)
reader = threading.Thread(target=read)
reader.start()

def sending():  # prefill done, its pages held only for the handoff
    s = stats(p)
    return s.waiting_sequences == 0 and s.running_sequences == 0 and s.free_pages < p0.free_pages

out = {"sending": poll(sending)}
out["decode_reserved_while_sending"] = stats(d).free_pages < d0.free_pages
call.cancel()
reader.join(30)
out["prefill_freed"] = poll(lambda: stats(p).free_pages == p0.free_pages)
out["decode_freed"] = poll(lambda: stats(d).free_pages == d0.free_pages)
out["kinds"], out["error"] = kinds, error
print(json.dumps(out))
"""


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_cancel_during_the_kv_send_frees_pages_on_both_sides(hosts, transport, tiny_model_dir):
    ns_a, _, ip_a, data_a, _ = hosts["A"]
    ns_b, _, ip_b, data_b, _ = hosts["B"]
    for ns, dev in ((ns_a, data_a), (ns_b, data_b)):  # about 0.5 MB/s each way
        subprocess.run(in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                             "4mbit", "burst", "16kb", "latency", "5s"), check=True, timeout=30)
    with two_host_stack(hosts, transport, tiny_model_dir) as running:
        done = subprocess.run(in_ns(ns_a, sys.executable, "-c", DRIVER, f"{ip_a}:50051",
                                    f"{ip_a}:50061", f"{ip_b}:50071"),
                              capture_output=True, text=True, timeout=300)
        logs = logs_of(running)
        assert done.returncode == 0, done.stderr + logs
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["sending"], f"never saw the handoff in flight: {out}\n{logs}"
        assert out["decode_reserved_while_sending"]
        assert out["kinds"] == [] and out["error"] == ["CANCELLED"]  # no token streamed
        assert out["prefill_freed"] and out["decode_freed"], f"{out}\n{logs}"
