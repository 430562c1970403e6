"""The router's calls to workers (`router.calls`): run on the waiting thread, cancelled by the
client's going without leaving anything behind in grpc, their failures named and sorted."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve.common.errors import ResourceExhausted
from pdserve.router.calls import ON_THREAD, OnThreadCall, WorkerCalls, unary_call
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.channels import CHANNEL_OPTIONS


class Health(health.HealthServicer):
    """Check waits until released or cancelled (and says which); `refuse` answers with it."""

    def __init__(self) -> None:
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


@pytest.fixture
def served():
    servicer = Health()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address, options=(*CHANNEL_OPTIONS, *ON_THREAD))
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
