"""One unary call to a worker on a request's path, and how its failure is sorted: a retry
elsewhere (`Retry`), the client's own answer (`ResourceExhausted`, `ServiceError`), or the
client gone (`ClientCancelled`); every error names the peer and the phase.

The router's calls to workers (Reserve, Prefill, a sequence's Decode stream, the health
rounds' Stats and Check; a peer router's Placed) run on the thread that waits for them
(`WorkerCalls`). grpc's sync API otherwise starts a thread for a call on a channel that has
none in flight (the channel's "spin" thread, which ends with the channel's last call), and in
front of many workers almost every call finds its channel idle: each call started and ended
a thread (~75 us of CPU here) and handed every message over to the waiting thread. Called as
unary-stream calls on a channel of the worker's own with grpc's SingleThreadedUnaryStream
option, the same requests (the wire is the same) are driven by the reading thread, and several
can be in flight at once, each read in turn (`reply`).

grpc leaves the rest of a cancelled single-threaded call in its completion queue, for good
(~27 KB a call, measured) unless its reader takes it: `OnThreadCall` is cancellable from any
thread and takes what is left on the reading side. At 1,000 simulated workers and 200 req/s
(docs/benchmarks.md, issue 24): 3.7 ms of router CPU a request against 4.38.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import grpc
import grpc.experimental
from grpc_health.v1 import health_pb2
from pdserve.common import tracing
from pdserve.common.errors import ResourceExhausted, ServiceError
from pdserve.common.native_calls import NativeCall, NativeChannel, NativeMethod
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})
# Decode failing before its first message: the worker died, or the handoff's lease or data
# did not hold. Nothing was streamed, so another attempt is still allowed.
DECODE_START_RETRYABLE = RETRYABLE | {"FAILED_PRECONDITION"}


# The channel of `WorkerCalls` (a worker's second, beside the one of its shared DecodeMany
# stream and CacheEvents): its unary-stream calls are driven by the thread that reads them.
ON_THREAD = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)


class WorkerCalls:
    """A worker's unary methods as the router calls them: on the caller's thread. Each returns
    a call to pass to `reply` (and to `.cancel()` from elsewhere)."""

    def __init__(self, channel: grpc.Channel | NativeChannel, role: str):
        service = "/pdserve.v1.Prefill/" if role == "prefill" else "/pdserve.v1.Decode/"
        self.stats = on_thread(channel, service + "Stats", common_pb2.StatsRequest,
                               common_pb2.WorkerStats)
        self.check = on_thread(channel, "/grpc.health.v1.Health/Check",
                               health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)
        self.reserve = on_thread(channel, "/pdserve.v1.Decode/Reserve", decode_pb2.ReserveRequest,
                                 decode_pb2.ReserveResponse)
        self.prefill = on_thread(channel, "/pdserve.v1.Prefill/Prefill",
                                 prefill_pb2.PrefillRequest, prefill_pb2.PrefillResponse)
        self.decode = on_thread(channel, "/pdserve.v1.Decode/Decode", decode_pb2.DecodeRequest,
                                decode_pb2.DecodeResponse, stream=True)  # wrap in OnThreadCall


def on_thread(channel: grpc.Channel | NativeChannel, path: str, request: Any, response: Any, *,
              stream: bool = False) -> grpc.UnaryStreamMultiCallable | NativeMethod:
    """The method `path` of `channel` (a grpcio one opened with ON_THREAD: a unary method
    called as a stream too), `stream` when it answers with a stream."""
    if isinstance(channel, NativeChannel):
        return channel.method(path, request.SerializeToString, response.FromString, stream)
    return channel.unary_stream(path, request_serializer=request.SerializeToString,
                                response_deserializer=response.FromString)


class OnThreadCall:
    """A `WorkerCalls` call as the router holds one: iterate it on one thread, `cancel()` it
    from any. Whatever grpc still holds for it once it is cancelled is taken on the reading
    side: by `cancel()` itself when no read is under way, else by that read when it ends."""

    def __init__(self, call: Any):
        self._call = call
        self._lock = threading.Lock()
        self._drained = threading.Lock()
        self._reading = self._cancelled = False

    def __iter__(self) -> OnThreadCall:
        return self

    def __next__(self) -> Any:
        with self._lock:
            self._reading = True
        try:
            return next(self._call)
        finally:
            with self._lock:
                self._reading = False
                cancelled = self._cancelled
            if cancelled:
                self._drain()

    @property
    def native_handle(self) -> int | None:
        """The C++ call of a call on the native library (common/native_calls.py), else None."""
        return self._call.handle if isinstance(self._call, NativeCall) else None

    def cancel(self) -> None:
        self._call.cancel()
        with self._lock:
            self._cancelled = True
            reading = self._reading
        if not reading:
            self._drain()

    def _drain(self) -> None:
        # grpc's _SingleThreadedRendezvous: its operations still due, and how it takes the
        # next event (private: without them, as on another grpc, nothing is taken here).
        state = getattr(self._call, "_state", None)
        consume = getattr(self._call, "_consume_next_event", None)
        if state is None or consume is None:
            return
        with self._drained:
            while state.due:
                consume()


class NoReply(grpc.RpcError):
    """A unary method's call that ended OK without its message."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def details(self) -> str:
        return "the worker answered OK without a message"


def reply(call: Any) -> Any:
    """The one message of a `WorkerCalls` call, read on this thread once its status is in
    (so that the call ends here, not by cancellation when it is collected). Raises the call's
    error as a `grpc.RpcError`."""
    message = next(call, None)
    for _ in call:  # the status: a unary method sends nothing more
        pass
    if message is None:
        raise NoReply()
    return message


class Suspects(Protocol):
    def suspect(self, address: str) -> None: ...


class Retry(Exception):
    """One attempt failed in a way another attempt may not."""

    def __init__(self, message: str, prefill: str | None = None, decode: str | None = None,
                 code: str = "UNAVAILABLE"):
        super().__init__(message)
        self.prefill = prefill
        self.decode = decode
        self.code = code  # the status the attempt's span records

    @property
    def refused(self) -> bool:
        """The peer could not be reached at all (nothing was sent: its address is dead)."""
        return self.code == "UNAVAILABLE" and any(
            text in str(self) for text in ("failed to connect", "Connection refused"))


def unary_call(pool: Suspects, scope: CallScope, span_name: str,
               method: grpc.UnaryStreamMultiCallable | NativeMethod, request: Any,
               timeout_s: float, peer: str,
               phase: str, address: str, *, prefill: str | None = None,
               decode: str | None = None, placement: str = "") -> Any:
    """One unary call (a `WorkerCalls` method) that client cancellation interrupts; errors
    sorted by what to do and named by the `peer` and the `phase` they happened in.

    Traced as a client span (router.reserve, router.prefill) whose context the call
    carries, so the worker's span is its child."""
    with tracing.span(span_name, kind=tracing.CLIENT, worker=address,
                      request_id=getattr(request, "request_id", ""), placement=placement):
        scope.check()
        call = OnThreadCall(method(request, timeout=timeout_s,
                                   metadata=tracing.outgoing_metadata()))
        with scope.guard(call.cancel):
            try:
                return reply(call)
            except grpc.RpcError as exc:
                if scope.cancelled:
                    raise ClientCancelled() from None
                code, details = exc.code().name, exc.details()
        where = f"{peer} ({phase})"
        if code == "DEADLINE_EXCEEDED" and details == "Deadline Exceeded":
            details = f"no answer within {timeout_s:g} s"
        if code == "UNAVAILABLE":
            pool.suspect(address)  # re-check its health now, not at the next round
        if code == "RESOURCE_EXHAUSTED":
            raise ResourceExhausted(f"{where}: {details}")
        if code in RETRYABLE:
            raise Retry(f"{where}: {code} {details}", prefill=prefill, decode=decode,
                         code=code)
        raise ServiceError(f"{where}: {details}", code)
