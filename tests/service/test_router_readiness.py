"""Readiness that tells the truth: the router's model list answers 200 only once a request can
be served, and the first request after it succeeds.

The router starts before its workers (as under `pdserve up`, or a router pod beside workers
still loading): until a prefill and a decode worker are healthy, /v1/models, /v1/models/{m}
and /health answer 503 with the same reason and gRPC health says NOT_SERVING; a client that
polls /v1/models (a bounded poll) and then sends its request gets its completion.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import ServiceProcess, free_port, running, wait_serving

pytestmark = pytest.mark.service

PY = [sys.executable, "-m"]
QUIET = ["--metrics-port", "-1"]


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (or a POST of `body`); (0, {}) while nothing listens."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def _poll(url: str, done, timeout_s: float, max_polls: int = 2000) -> tuple[int, dict]:
    """GET `url` until `done(status)` (bounded in time and count); the last answer."""
    deadline = time.monotonic() + timeout_s
    for _ in range(max_polls):
        status, body = _http(url)
        if done(status) or time.monotonic() > deadline:
            return status, body
        time.sleep(0.05)  # the interval of a bounded poll
    return status, body


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status


@contextlib.contextmanager
def _started(argv: list[str]) -> Iterator[ServiceProcess]:
    """A process started without waiting for it (the test watches it come up)."""
    proc = ServiceProcess(argv)
    try:
        yield proc
    finally:
        proc.stop()


def test_models_is_503_until_the_workers_serve_then_the_first_request_succeeds(tiny_model_dir):
    ports = {name: free_port() for name in
             ("agent_a", "agent_b", "prefill", "decode", "router", "http")}
    addr = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
    base = f"http://{addr['http']}"
    agent = [*PY, "pdserve.kvtransfer.main", *QUIET, "--port"]
    router = [*PY, "pdserve.router.main", *QUIET, "--port", str(ports["router"]),
              "--http-port", str(ports["http"]), "--prefill", addr["prefill"],
              "--decode", addr["decode"], "--model", str(tiny_model_dir),
              "--model-name", "builtin-tiny"]
    with running([*agent, str(ports["agent_a"])], addr["agent_a"]), \
         running([*agent, str(ports["agent_b"])], addr["agent_b"]), \
         _started(router) as router_proc:
        # Neither worker exists yet: every readiness answer says so, with the same reason.
        status, health = _poll(f"{base}/health", lambda s: s != 0, timeout_s=120)
        assert status == 503, (status, health, router_proc.output()[-3000:])
        reason = health["status"]
        assert reason.startswith("not ready:") and "no healthy decode worker" in reason
        assert addr["decode"] in reason and "no healthy prefill worker" in reason
        for path in ("/v1/models", "/v1/models/builtin-tiny"):
            status, body = _http(base + path)
            assert status == 503 and body["error"]["message"] == reason, (path, body)
            assert body["error"]["code"] == "unavailable"
        assert _grpc_health(addr["router"]) == health_pb2.HealthCheckResponse.NOT_SERVING

        # The workers start; a client waits for the model list, then sends its request.
        worker = [*QUIET, "--kv-cache-mb", "16", "--model", "tiny"]
        with _started([*PY, "pdserve.prefill.main", "--port", str(ports["prefill"]),
                       "--kv-agent", addr["agent_a"], *worker]), \
             _started([*PY, "pdserve.decode.main", "--port", str(ports["decode"]),
                       "--kv-agent", addr["agent_b"], *worker]):
            status, models = _poll(f"{base}/v1/models", lambda s: s == 200, timeout_s=180)
            assert status == 200, (models, router_proc.output()[-3000:])
            assert [m["id"] for m in models["data"]] == ["builtin-tiny"]
            status, reply = _http(f"{base}/v1/completions", {
                "prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert status == 200, reply
            assert reply["usage"]["completion_tokens"] == 4
            assert _http(f"{base}/health") == (200, {"status": "ok"})
            wait_serving(addr["router"], timeout_s=10)  # gRPC health follows within a poll
