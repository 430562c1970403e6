"""The shared server bootstrap (health, reflection, errors, drain, cancellation), on grpcio's
server and on the native one (gRPC's C++ core, common/native_server.py), and the config
pattern."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import socket
import sys
import textwrap
import threading
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from pdserve.common import config, errors, logs, native_grpc, server
from pdserve.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

from tests.support import ServiceProcess, free_port, wait_for, wait_serving

pytestmark = pytest.mark.service

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.ended = threading.Event()  # the call's termination callback ran
        self.closed = threading.Event()  # its generator was closed
        self.metadata: dict[str, str] = {}

    def Generate(self, request, context):
        if request.prompt == "bad":
            raise errors.InvalidArgument("prompt: 'bad' is not allowed")
        self.metadata = dict(context.invocation_metadata())
        context.add_callback(self.ended.set)
        self.entered.set()
        if request.prompt == "endless":
            try:
                for i in range(10_000):  # bounded: a client that goes stops it long before
                    yield router_pb2.GenerateResponse(request_id=f"r{i}")
                    self.release.wait(0.01)
            finally:
                self.closed.set()
            return
        yield router_pb2.GenerateResponse(request_id="r1")
        self.release.wait(10)
        if request.prompt == "late-error":
            raise errors.Unavailable("worker went away")
        yield router_pb2.GenerateResponse(request_id="r1")


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def Reserve(self, request, context):
        raise errors.ResourceExhausted(f"no room for {request.num_prompt_tokens} tokens")


def register(router: FakeRouter):
    def add(s: grpc.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(router, s)
        decode_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(), s)
    return add


def check(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


@pytest.fixture(params=["grpcio", "native"])
def started(request):
    ready = threading.Event()
    drained = threading.Event()
    router = FakeRouter()
    native = native_grpc.library() if request.param == "native" else None
    handle = server.start("test", 0, register(router), host="127.0.0.1", ready=ready.is_set,
                          grace_s=5.0, on_drain=drained.set, native=native)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield handle, ready, drained, router, channel
    router.release.set()
    channel.close()
    handle.server.stop(0)


def test_health_follows_ready_for_overall_and_each_service(started):
    handle, ready, _, _, channel = started
    assert handle.services == ["pdserve.v1.Router", "pdserve.v1.Decode"]
    assert check(channel) == NOT_SERVING
    assert check(channel, "pdserve.v1.Router") == NOT_SERVING
    assert handle.serving() is False  # what a worker's Stats report as `serving`
    # Liveness (what Kubernetes' liveness probes ask) does not wait for readiness.
    assert check(channel, server.LIVENESS_SERVICE) == SERVING
    ready.set()
    wait_serving(f"127.0.0.1:{handle.port}", timeout_s=5)
    for service in ("", "pdserve.v1.Router", "pdserve.v1.Decode"):
        assert check(channel, service) == SERVING
    assert handle.serving() is True
    ready.clear()  # readiness is followed for the server's life, not only at start
    assert wait_for(lambda: check(channel) == NOT_SERVING, timeout_s=5), \
        "health did not follow ready() back to NOT_SERVING"
    assert handle.serving() is False
    assert check(channel, server.LIVENESS_SERVICE) == SERVING


def test_reflection_lists_services(started):
    handle, *_, channel = started
    names = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pdserve.v1.Router", "pdserve.v1.Decode", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_service_errors_become_status_codes(started):
    *_, channel = started
    with pytest.raises(grpc.RpcError) as err:
        decode_pb2_grpc.DecodeStub(channel).Reserve(
            decode_pb2.ReserveRequest(num_prompt_tokens=7), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "7 tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(prompt="bad"), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in err.value.details()


def test_error_after_streamed_output_ends_stream_with_status(started):
    _, _, _, router, channel = started
    stream = router_pb2_grpc.RouterStub(channel).Generate(
        router_pb2.GenerateRequest(prompt="late-error"), timeout=5)
    assert next(stream).request_id == "r1"
    router.release.set()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_drain_finishes_in_flight_stream_then_stops(started):
    handle, ready, drained, router, channel = started
    ready.set()
    wait_serving(f"127.0.0.1:{handle.port}", timeout_s=5)
    stream = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(), timeout=10)
    assert next(stream).request_id == "r1"
    waiter = threading.Thread(target=handle.wait)
    waiter.start()
    handle.request_stop()
    assert drained.wait(5)
    assert check(channel) == NOT_SERVING  # still answering, but out of rotation
    assert handle.serving() is False
    assert check(channel, server.LIVENESS_SERVICE) == NOT_SERVING
    assert waiter.is_alive()              # waiting for the in-flight stream
    router.release.set()
    assert [r.request_id for r in stream] == ["r1"]
    waiter.join(10)
    assert not waiter.is_alive()


def test_metadata_reaches_the_handler_and_an_unknown_method_is_unimplemented(started):
    _, _, _, router, channel = started
    router.release.set()
    stream = router_pb2_grpc.RouterStub(channel).Generate(
        router_pb2.GenerateRequest(), timeout=5, metadata=[("traceparent", "00-ab-cd-01")])
    assert [r.request_id for r in stream] == ["r1", "r1"]
    assert router.metadata["traceparent"] == "00-ab-cd-01"
    assert router.ended.wait(5), "the termination callback did not run"
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/pdserve.v1.Router/Nothing")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as err:  # not a GenerateRequest: named, not INTERNAL
        channel.unary_stream("/pdserve.v1.Router/Generate")(b"\xff\xff", timeout=5).next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Generate" in err.value.details()


def test_a_client_that_goes_ends_the_handler_and_runs_its_callback(started):
    _, _, _, router, channel = started
    stream = router_pb2_grpc.RouterStub(channel).Generate(
        router_pb2.GenerateRequest(prompt="endless"), timeout=10)
    assert next(stream).request_id == "r0"
    stream.cancel()
    assert router.ended.wait(5), "the termination callback did not run on cancellation"
    assert router.closed.wait(5), "the handler went on streaming to a cancelled call"


class AbortingContext:
    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")


@pytest.mark.parametrize("kind", ["grpcio", "native"])
def test_busy_port_fails_with_clear_message(kind):
    native = native_grpc.library() if kind == "native" else None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(server.ServerStartError, match=f"port {port} is in use"):
            server.start("busy", port, lambda s: None, host="127.0.0.1", native=native)


SCRIPT = textwrap.dedent("""
    import sys
    from pdserve.common import logs, server
    logs.setup_logging("text", "INFO")
    sys.exit(server.serve("tiny", int(sys.argv[1]), lambda s: None, host="127.0.0.1", grace_s=5))
""")


@pytest.mark.service
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_exits_zero_on_signal(sig):
    port = free_port()
    proc = ServiceProcess([sys.executable, "-c", SCRIPT, str(port)])
    try:
        wait_serving(f"127.0.0.1:{port}", timeout_s=30, proc=proc.proc)
        proc.proc.send_signal(sig)
        assert proc.proc.wait(timeout=20) == 0, proc.output()
        assert "draining" in proc.output()
    finally:
        proc.stop()


# --- config -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DemoConfig(config.ServerConfig):
    """Demo service."""

    port: int = config.option(50099, "gRPC port")
    workers: tuple[str, ...] = config.option((), "worker addresses, comma-separated")
    max_retries: int = config.option(1, "retries before the first token")
    verbose: bool = config.option(False, "say more")
    model: str | None = config.option(None, "model directory")

    def __post_init__(self) -> None:
        super().__post_init__()
        config.require(self.max_retries >= 0, "max_retries", self.max_retries, ">= 0")


def test_config_defaults_flags_and_env_twins():
    cfg = config.parse_config(DemoConfig, "demo", [], env={})
    assert (cfg.port, cfg.workers, cfg.verbose, cfg.model) == (50099, (), False, None)
    env = {"PDSERVE_DEMO_PORT": "6000", "PDSERVE_DEMO_WORKERS": "a:1, b:2",
           "PDSERVE_DEMO_VERBOSE": "yes", "PDSERVE_DEMO_MODEL": "/m"}
    cfg = config.parse_config(DemoConfig, "demo", [], env=env)
    assert (cfg.port, cfg.workers, cfg.verbose, cfg.model) == (6000, ("a:1", "b:2"), True, "/m")
    cfg = config.parse_config(DemoConfig, "demo", ["--port", "7000", "--no-verbose"], env=env)
    assert (cfg.port, cfg.verbose) == (7000, False)  # the flag wins over its twin
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_help_shows_env_names_and_env_defaults(capsys):
    parser = config.build_parser(DemoConfig, "demo", env={"PDSERVE_DEMO_MAX_RETRIES": "3"})
    text = parser.format_help()
    assert "PDSERVE_DEMO_MAX_RETRIES; default: 3" in text
    assert "PDSERVE_DEMO_PORT; default: 50099" in text
    assert "--log-format" in text and "PDSERVE_DEMO_LOG_FORMAT" in text


@pytest.mark.parametrize("argv, env, needle", [
    (["--max-retries", "-1"], {}, "max_retries=-1: expected >= 0"),
    (["--port", "70000"], {}, "port=70000"),
    ([], {"PDSERVE_DEMO_PORT": "abc"}, "PDSERVE_DEMO_PORT='abc'"),
    ([], {"PDSERVE_DEMO_VERBOSE": "maybe"}, "PDSERVE_DEMO_VERBOSE='maybe'"),
    (["--log-format", "xml"], {}, "log-format"),
])
def test_config_errors_name_the_field_and_value(capsys, argv, env, needle):
    with pytest.raises(SystemExit) as exit_info:
        config.parse_config(DemoConfig, "demo", argv, env=env)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_outcome_log_line_json(capsys):
    logs.setup_logging("json", "INFO", service="demo")
    try:
        logs.outcome(logging.getLogger("pdserve.t"), "done", request_id="x", ms=1.5)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        obj = json.loads(line)
        assert (obj["msg"], obj["request_id"], obj["ms"], obj["service"]) == \
            ("done", "x", 1.5, "demo")
    finally:
        logs.setup_logging("text", "WARNING")
