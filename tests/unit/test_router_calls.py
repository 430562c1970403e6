"""The router's calls to workers (`router.calls`): run on the waiting thread, cancelled by the
client's going without leaving anything behind in grpc, their failures named and sorted; on
grpcio and on gRPC's C++ core (common/native_calls.py)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve.common import native_grpc
from pdserve.common.errors import ResourceExhausted
from pdserve.common.native_calls import NativeChannel, NativeMethod
from pdserve.router.calls import ON_THREAD, OnThreadCall, Retry, WorkerCalls, unary_call
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.channels import CHANNEL_OPTIONS

from tests.support import free_port


class Health(health.HealthServicer):
    """Check waits until released or cancelled (and says which); `refuse` answers with it."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived, self.release, self.cancelled = (threading.Event() for _ in range(3))
        self.refuse: str = ""

    def Check(self, request, context):
        self.arrived.set()
        if self.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.refuse)
        while not self.release.wait(0.01):
            if not context.is_active():
                self.cancelled.set()
                return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class NoSuspects:
    def __init__(self) -> None:
        self.suspected: list[str] = []

    def suspect(self, address: str) -> None:
        self.suspected.append(address)


def _channel(kind: str, address: str) -> grpc.Channel | NativeChannel:
    if kind == "native":
        return NativeChannel(native_grpc.library(), address, None, CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=(*CHANNEL_OPTIONS, *ON_THREAD))


@pytest.fixture(params=["grpcio", "native"])
def served(request):
    servicer = Health()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    channel = _channel(request.param, address)
    try:
        yield servicer, WorkerCalls(channel, "decode"), address
    finally:
        channel.close()
        server.stop(0)


def _call(method, scope: CallScope, address: str, timeout_s: float = 10.0):
    return unary_call(NoSuspects(), scope, "router.check", method,
                      health_pb2.HealthCheckRequest(), timeout_s, f"decode {address}", "check",
                      address)


def _in_thread(method, scope: CallScope, address: str) -> tuple[threading.Thread, list]:
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(_call(method, scope, address))
        except ClientCancelled as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    return caller, outcome


def test_a_call_runs_on_the_waiting_thread_and_the_clients_going_cancels_it(served):
    """No thread of grpc's own waits for it (one started per call on an idle channel, which in
    front of a large pool is nearly every call), and it stays cancellable from another."""
    servicer, calls, address = served
    scope = CallScope()
    before = set(threading.enumerate())
    caller, outcome = _in_thread(calls.check, scope, address)
    assert servicer.arrived.wait(10)
    started = {t.name for t in set(threading.enumerate()) - before
               if not t.name.startswith("ThreadPoolExecutor")}  # (the server's)
    assert started == {caller.name}, started  # as a future: grpc's poller "Thread-N (_run)" too
    scope.cancel()  # what the servicer's callback does when the client goes
    caller.join(10)
    assert not caller.is_alive() and isinstance(outcome[0], ClientCancelled), outcome
    assert servicer.cancelled.wait(10)  # the worker saw it and stopped


@pytest.mark.parametrize("served", ["grpcio"], indirect=True)  # grpcio's own record
def test_a_cancelled_call_leaves_nothing_in_grpc(served):
    """grpc keeps what a cancelled single-threaded call still has in its completion queue
    (~27 KB) until its reader takes it: `OnThreadCall` takes it, whether cancelled during a
    read (from another thread) or between reads."""
    servicer, calls, _ = served
    during = OnThreadCall(calls.check(health_pb2.HealthCheckRequest(), timeout=10))
    threading.Thread(target=lambda: servicer.arrived.wait(10) and during.cancel()).start()
    with pytest.raises(grpc.RpcError):
        next(during)
    between = OnThreadCall(calls.check(health_pb2.HealthCheckRequest(), timeout=10))
    between.cancel()
    for call in (during, between):
        assert call._call.code() == grpc.StatusCode.CANCELLED
        assert not call._call._state.due  # grpc's own record of what it still holds


def test_a_call_answers_and_its_failure_is_named(served):
    servicer, calls, address = served
    servicer.release.set()
    assert _call(calls.check, CallScope(), address).status == \
        health_pb2.HealthCheckResponse.SERVING
    servicer.refuse = "no free pages"
    with pytest.raises(ResourceExhausted, match=rf"decode {address} \(check\): no free pages"):
        _call(calls.check, CallScope(), address)
    servicer.refuse = ""
    assert _call(calls.check, CallScope(), address).status == \
        health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("served", ["native"], indirect=True)
def test_a_native_stream_reads_each_message_and_a_cancel_ends_it(served):
    servicer, _, address = served
    channel = NativeChannel(native_grpc.library(), address, None, CHANNEL_OPTIONS)
    watch = channel.method("/grpc.health.v1.Health/Watch",
                           health_pb2.HealthCheckRequest.SerializeToString,
                           health_pb2.HealthCheckResponse.FromString, stream=True)
    call = watch(health_pb2.HealthCheckRequest(service="x"), timeout=10,
                 metadata=[("traceparent", "00-ab-cd-01")])
    assert next(call).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    channel.close()
    with pytest.raises(ValueError, match="Channel closed"):  # as grpcio says it: pool.py
        watch(health_pb2.HealthCheckRequest(), timeout=1)


@pytest.mark.parametrize("served", ["grpcio", "native"], indirect=True)
def test_a_worker_that_is_not_there_is_refused_and_one_too_slow_times_out(served):
    servicer, calls, address = served
    kind = "native" if isinstance(calls.check, NativeMethod) else "grpcio"
    dead = f"127.0.0.1:{free_port()}"
    channel = _channel(kind, dead)
    with pytest.raises(Retry) as err:
        _call(WorkerCalls(channel, "decode").check, CallScope(), dead, timeout_s=5)
    assert err.value.refused, str(err.value)  # another worker may take the same reservation
    channel.close()
    with pytest.raises(Retry, match=r"\(check\): DEADLINE_EXCEEDED "):
        _call(calls.check, CallScope(), address, timeout_s=0.2)
    servicer.release.set()
