"""`pdserve up --tls DIR --api-key-file FILE`, as a user runs it: every hop over TLS, mutual
TLS between the services, API keys on the router's public API (gRPC metadata), health and
metrics open to probes; refused callers get the code and message that say why."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.certs import CertPaths, create
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.v1 import common_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

from tests.service.stack import Stack, collect, pdserve_stack
from tests.service.test_operability import _grpcurl
from tests.support import pdserve_argv

pytestmark = pytest.mark.service
Code = grpc.StatusCode
KEY = "pdserve-test-key-0123456789"
REQUEST = dict(prompt="def fibonacci(n):", max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    """Made as a user would: `pdserve certs create DIR`."""
    directory = tmp_path_factory.mktemp("tls")
    done = subprocess.run(pdserve_argv("certs", "create", str(directory)), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"pdserve up --tls {directory}" in done.stdout
    return CertPaths(directory)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return create(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def stack(certs: CertPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# the test's key\n{KEY}\n")
    # Health is answered without a key; over TLS it needs the CA (and for the workers a
    # client certificate).
    security = ChannelSecurity(str(certs.ca), str(certs.server_cert), str(certs.server_key))
    with pdserve_stack("--tls", str(certs.directory), "--api-key-file", str(keys),
                       security=security) as s:
        yield s


def generate(stack: Stack, security: ChannelSecurity | None,
             metadata: list[tuple[str, str]] | None = None) -> list[router_pb2.GenerateResponse]:
    with open_channel(stack.router, security) as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(**REQUEST), timeout=60, metadata=metadata))


def refusal(stack: Stack, security: ChannelSecurity | None,
            metadata: list[tuple[str, str]] | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, security, metadata)
    return info.value


def test_generate_over_tls_with_an_api_key(stack: Stack, certs: CertPaths) -> None:
    ids, _, timing, finish = collect(generate(stack, ChannelSecurity(str(certs.ca)),
                                              [("authorization", f"Bearer {KEY}")]))
    assert len(ids) == 6 and finish.finish_reason == "length"
    # The handoff went between the two agents: by same-host copy, granted over mutual TLS.
    assert timing.kv_transport == "shm" and timing.kv_bytes > 0


def test_pdserve_generate_takes_the_ca_and_the_key_from_its_environment(
        stack: Stack, certs: CertPaths) -> None:
    argv = pdserve_argv("generate", "--address", stack.router, "--max-tokens", "4",
                        "--temperature", "0", "hello")
    env = {**os.environ, "PDSERVE_API_KEY": KEY, "PDSERVE_CLIENT_TLS_CA": str(certs.ca)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "finish: length; " in done.stdout and "4 completion tokens" in done.stdout
    env.pop("PDSERVE_API_KEY")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert ("pdserve generate: UNAUTHENTICATED: missing API key: send the header "
            "'authorization: Bearer <key>'") in done.stderr


def test_a_missing_or_wrong_api_key_is_unauthenticated(stack: Stack, certs: CertPaths) -> None:
    tls = ChannelSecurity(str(certs.ca))
    cases = {
        None: "missing API key: send the header 'authorization: Bearer <key>'",
        "Bearer not-the-key": "invalid API key",
        f"Bearer {KEY}x": "invalid API key",
        KEY: "malformed authorization header: expected 'Bearer <key>'",
    }
    for header, message in cases.items():
        error = refusal(stack, tls, None if header is None else [("authorization", header)])
        assert (error.code(), error.details()) == (Code.UNAUTHENTICATED, message), header
    assert len(collect(generate(stack, tls, [("authorization", f"Bearer {KEY}")]))[0]) == 6


def test_health_and_metrics_stay_reachable_without_a_key(stack: Stack, certs: CertPaths) -> None:
    with open_channel(stack.router, ChannelSecurity(str(certs.ca))) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "pdserve_requests_total" in stack.scrape("router")
    assert "pdserve_kv_pages_free" in stack.scrape("decode-0")


def test_plaintext_and_untrusted_servers_are_refused(stack: Stack, certs: CertPaths,
                                                     stranger: CertPaths) -> None:
    auth = [("authorization", f"Bearer {KEY}")]
    assert refusal(stack, None, auth).code() == Code.UNAVAILABLE  # plaintext to a TLS port
    # A client that trusts another CA does not accept the router's certificate.
    assert refusal(stack, ChannelSecurity(str(stranger.ca)), auth).code() == Code.UNAVAILABLE


def _decode_stats(stack: Stack, security: ChannelSecurity) -> common_pb2.WorkerStats:
    with open_channel(stack.decode[0], security) as channel:
        return decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)


def test_workers_take_calls_only_with_a_certificate_from_the_ca(
        stack: Stack, certs: CertPaths, stranger: CertPaths) -> None:
    for who, security in {
        "no client certificate": ChannelSecurity(str(certs.ca)),
        "a certificate from another CA": ChannelSecurity(
            str(certs.ca), str(stranger.client_cert), str(stranger.client_key)),
    }.items():
        with pytest.raises(grpc.RpcError) as info:
            _decode_stats(stack, security)
        assert info.value.code() == Code.UNAVAILABLE, who
    stats = _decode_stats(stack, ChannelSecurity(str(certs.ca), str(certs.client_cert),
                                                 str(certs.client_key)))
    assert stats.num_pages > 0 and stats.role == "decode"


def test_grpcurl_with_the_ca_and_a_bearer_key(stack: Stack, certs: CertPaths) -> None:
    def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_grpcurl(), "-cacert", str(certs.ca), *args], capture_output=True,
                              text=True, timeout=60)

    body = '{"prompt": "def fibonacci(n):", "max_tokens": 3, "temperature": 0}'
    ok = grpcurl("-H", f"authorization: Bearer {KEY}", "-d", body, stack.router,
                 "pdserve.v1.Router/Generate")
    assert ok.returncode == 0, ok.stderr
    assert '"finish_reason": "length"' in ok.stdout
    refused = grpcurl("-H", "authorization: Bearer wrong", "-d", body, stack.router,
                      "pdserve.v1.Router/Generate")
    assert refused.returncode != 0
    assert "Code: Unauthenticated" in refused.stderr and "invalid API key" in refused.stderr
    missing = grpcurl("-d", body, stack.router, "pdserve.v1.Router/Generate")
    assert missing.returncode != 0
    assert "Code: Unauthenticated" in missing.stderr and "missing API key" in missing.stderr
    # No key needed for probes (health) and the schema (reflection).
    health = grpcurl(stack.router, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and '"status": "SERVING"' in health.stdout
    listed = grpcurl(stack.router, "list")
    assert listed.returncode == 0 and "pdserve.v1.Router" in listed.stdout.split()


def test_bench_serve_measures_a_secured_router(stack: Stack, certs: CertPaths,
                                               tiny_model_dir: Path) -> None:
    argv = pdserve_argv("bench", "serve", "--target", stack.router, "--model",
                        str(tiny_model_dir), "--workload", "fixed:8,3", "--num-requests", "2",
                        "--warmup", "0", "--concurrency", "2", "--tls-ca", str(certs.ca))
    env = {**os.environ, "PDSERVE_API_KEY": KEY}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2/2 done, 0 failed" in done.stderr


def test_bad_security_flags_stop_a_service_with_a_message_naming_them(certs: CertPaths) -> None:
    cases = [
        (["router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
          "--api-key-file", "/nonexistent/keys"],
         "api_key_file='/nonexistent/keys': expected a readable file of API keys"),
        (["decode", "--tls-ca", str(certs.ca)],
         "tls_cert='': expected a certificate (--tls-ca turns on mutual TLS, which needs one)"),
        (["kvtransfer", "--tls-cert", str(certs.server_cert)],
         "tls_key='': expected set together with --tls-cert"),
    ]
    for args, message in cases:
        done = subprocess.run(pdserve_argv(*args), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
