"""Two hosts on one machine: network namespaces joined by two veth links.

Host A runs the router, a prefill worker and its kvtransfer agent; host B runs a decode worker
and its agent. All gRPC (router, workers, the agents' control calls) uses the control link;
the agents advertise their data path on a second link that carries nothing else. The KV
handoff must cross that data link (UCX over TCP, or the TCP transport, which the prefill
worker's own lane sends onto itself, as its metrics show): the bytes received on
host B's data interface grow by at least the handoffs' size and by little more, the control
link carries far less than the KV, and the output still equals transformers token for token.
Only addresses inside the namespaces made here are used.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.multihost.conftest import in_ns, logs_of, rx_bytes, two_host_stack
from tests.support import samples

pytestmark = pytest.mark.multihost

# One long prompt among the short ones, so the KV (~1 MiB) dwarfs the control traffic the stack
# makes meanwhile (health checks, stats, lease renewals): that grows with the test's duration.
LONG_PROMPT = [(i * 7919) % 1000 + 5 for i in range(2048)]
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny: layers x (K, V) x KV heads x head dim x fp32


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
            request = (router_pb2.GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=0.0)
                       if isinstance(p, str) else
                       router_pb2.GenerateRequest(token_ids=p, max_tokens=2, temperature=0.0))
            msgs = [MessageToDict(m, preserving_proto_field_name=True)
                    for m in stub.Generate(request, timeout=120)]
            print(json.dumps(msgs), flush=True)
""")


SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(" \
         "f'http://{sys.argv[1]}/metrics', timeout=30).read().decode())"


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_kv_handoff_crosses_the_link_between_two_hosts(hosts, transport, reference, tiny_model_dir):
    ns_a, _, ip_a, _, _ = hosts["A"]
    ns_b, ctl_b, ip_b, data_b, _ = hosts["B"]
    with two_host_stack(hosts, transport, tiny_model_dir) as running:
        before = rx_bytes(ns_b, data_b), rx_bytes(ns_b, ctl_b)
        prompts = PROMPTS[:4]
        done = subprocess.run(in_ns(ns_a, sys.executable, "-c", DRIVER, f"{ip_a}:50051",
                                  json.dumps([*prompts, LONG_PROMPT]), str(MAX_TOKENS)),
                              capture_output=True, text=True, timeout=300)
        logs = logs_of(running)
        assert done.returncode == 0, done.stderr + logs
        data_rx = rx_bytes(ns_b, data_b) - before[0]
        control_rx = rx_bytes(ns_b, ctl_b) - before[1]
        metrics = subprocess.run(in_ns(ns_a, sys.executable, "-c", SCRAPE, f"{ip_a}:9061"),
                                 capture_output=True, text=True, timeout=60)
        assert metrics.returncode == 0, metrics.stderr
    # Over tcp the prefill worker sent the handoffs onto host B's data port itself (its own
    # lane; the first one to a new agent goes through its agent), short prompts' pages written
    # from the engine's thread the moment their KV was ready (made ready while the prompt
    # computed: a request whose preparation lost the race goes the usual way, so not all of
    # them); UCX only through the agent.
    found = samples(metrics.stdout)
    lane = found.get(("pdserve_kv_lane_handoffs_total", frozenset({("transport", "tcp")})), 0)
    begun = found.get(("pdserve_kv_handoffs_begun_total", frozenset()), 0)
    if transport == "tcp":
        assert lane >= len(PROMPTS[:4]) and begun >= 1, metrics.stdout[-2000:]
    else:
        assert lane == 0 and begun == 0, metrics.stdout[-2000:]
    tok, refs = reference
    lines = done.stdout.splitlines()
    long_timing = next(m["timing"] for m in json.loads(lines[-1]) if "timing" in m)
    assert long_timing["kv_transport"] == transport
    kv_bytes = int(long_timing["kv_bytes"])
    assert kv_bytes >= len(LONG_PROMPT) * KV_BYTES_PER_TOKEN
    for prompt, line in zip(prompts, lines):
        msgs = json.loads(line)
        ids = [int(t) for m in msgs if "delta" in m for t in m["delta"].get("token_ids", [])]
        timing = next(m["timing"] for m in msgs if "timing" in m)
        assert ids == refs[prompt][1], prompt
        assert timing["kv_transport"] == transport
        assert timing["decode_worker"].startswith(f"decode@{ip_b}")
        kv_bytes += int(timing["kv_bytes"])
    # Only the KV uses the data link (the agents, and over tcp the prefill worker's lane): it
    # carried the KV (plus TCP/IP and per-handoff header overhead), and the control link
    # carried a small fraction of that.
    assert data_rx >= kv_bytes, f"only {data_rx} of {kv_bytes} KV bytes crossed the data link"
    assert data_rx <= 1.25 * kv_bytes + 256 * 1024, f"{data_rx} bytes for {kv_bytes} of KV"
    assert control_rx < kv_bytes / 2, f"{control_rx} control bytes for {kv_bytes} of KV"


@pytest.mark.parametrize("transport,prefill_tp,decode_tp", [("tcp", 2, 1), ("ucx", 1, 2)])
def test_a_handoff_between_tp_splits_crosses_the_link_token_exact(hosts, transport, prefill_tp,
                                                                  decode_tp, reference,
                                                                  tiny_model_dir):
    """A prefill worker of one TP size on host A, a decode worker of another on host B (each
    rank a process of its own, its ranks' all-reduces on its host's loopback): every head range
    crosses the data link to the decode rank that owns it, and the output stays exact."""
    ns_a, _, ip_a, _, _ = hosts["A"]
    ns_b, _, _, data_b, _ = hosts["B"]
    extra = {"prefill": ("--tp", str(prefill_tp)), "decode": ("--tp", str(decode_tp))}
    with two_host_stack(hosts, transport, tiny_model_dir, extra) as running:
        before = rx_bytes(ns_b, data_b)
        prompts = [PROMPTS[3], PROMPTS[-1]]
        done = subprocess.run(in_ns(ns_a, sys.executable, "-c", DRIVER, f"{ip_a}:50051",
                                    json.dumps(prompts), str(MAX_TOKENS)),
                              capture_output=True, text=True, timeout=300)
        logs = logs_of(running)
        assert done.returncode == 0, done.stderr + logs
        data_rx = rx_bytes(ns_b, data_b) - before
    tok, refs = reference
    kv_bytes = 0
    for prompt, line in zip(prompts, done.stdout.splitlines()):
        msgs = json.loads(line)
        ids = [int(t) for m in msgs if "delta" in m for t in m["delta"].get("token_ids", [])]
        timing = next(m["timing"] for m in msgs if "timing" in m)
        assert ids == refs[prompt][1], (prompt, logs)
        assert timing["kv_transport"] == transport
        n_prompt = refs[prompt][0]
        assert int(timing["kv_bytes"]) == -(-n_prompt // 16) * 16 * KV_BYTES_PER_TOKEN
        kv_bytes += int(timing["kv_bytes"])
    assert data_rx >= kv_bytes, f"only {data_rx} of {kv_bytes} KV bytes crossed the data link"
