"""The one server bootstrap every pdserve service uses.

    handle = start("decode", cfg.port, lambda s: add_DecodeServicer_to_server(servicer, s),
                   ready=lambda: registered, on_drain=stop_admitting)
    return handle.wait()          # blocks until SIGTERM/SIGINT, drains, returns 0

or, when nothing needs the handle, `return serve(...)` with the same arguments.

What it does for every service: a thread-pool grpc.Server with the servicers, grpc.health.v1
(overall "" and one entry per registered service, plus `pdserve.liveness` for liveness
probes: SERVING from the start until draining) and server reflection; health starts
NOT_SERVING and follows `ready()` (or turns SERVING at once without it); on SIGTERM/SIGINT
health turns NOT_SERVING for good, `on_drain()` runs (stop admitting new work), in-flight calls
get up to `grace_s` to finish, then the server stops and `wait()` returns 0.

Errors: handlers raise the domain errors of `pdserve.common.errors`; one interceptor turns
their status name into the gRPC status code. A request that does not parse as its message
(gRPC's own answer would be INTERNAL "Exception deserializing request!") is refused with
INVALID_ARGUMENT naming the method and the parser's complaint.
The same interceptor runs each handler with its caller's trace (W3C `traceparent` metadata) as
the current tracing context when tracing is on (pdserve.common.tracing).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pdserve.common import tracing
from pdserve.common.errors import ServiceError
from pdserve.common.native_server import NativeServer
from pdserve.common.security import ServerTls

log = logging.getLogger("pdserve.server")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_POLL_S = 0.2
# A health entry that is SERVING while the process serves at all, whatever its readiness (the
# router's depends on its workers'): what a liveness probe should ask, so a service waiting
# for others is not restarted. NOT_SERVING only once draining.
LIVENESS_SERVICE = "pdserve.liveness"

# Peers (the router, agents) send keepalive pings on long streams; accept them.
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class ServerStartError(RuntimeError):
    """The server could not start (for example: its port is in use)."""


class _Malformed:
    """A request whose bytes did not parse: the handler refuses it instead of running."""

    def __init__(self, message: str):
        self.message = message


def _lenient(parse: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:
            return _Malformed(f"{method}: the request ({len(data)} bytes) does not parse as its "
                              f"message: {exc}")
    return deserialize


def _guard_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return fn(request, context)
        except ServiceError as exc:
            context.abort(grpc.StatusCode[exc.code], exc.message)
    return functools.wraps(fn)(unary)


def _guard_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A response-streaming handler's errors as statuses (bidi too: `request` is then the
    request iterator, whose malformed messages the handler sees as `_Malformed`)."""
    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            yield from fn(request, context)
        except ServiceError as exc:
            context.abort(grpc.StatusCode[exc.code], exc.message)
    return functools.wraps(fn)(stream)


class _Interceptor(grpc.ServerInterceptor):
    """Maps errors for pdserve handlers, counts their in-flight calls (for draining) and runs
    them in their caller's trace."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._inflight = 0

    def intercept_service(self, continuation: Callable[..., Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc."):
            return handler  # health and reflection: not work to drain, no domain errors
        kw = {"request_deserializer": _lenient(handler.request_deserializer, details.method),
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream), **kw)
        if handler.stream_stream is not None:  # Decode/DecodeMany: traced per sequence inside
            return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream),
                                                         **kw)
        return handler  # client streaming: not used by pdserve.v1

    def _unary(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = _guard_unary(fn)

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            self._enter()
            try:
                return tracing.traced_call(context, fn, request, context)
            finally:
                self._exit()
        return call

    def _stream(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = _guard_stream(fn)

        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter()
            try:
                yield from tracing.traced_stream(context, fn(request, context))
            finally:
                self._exit()
        return call

    def _enter(self) -> None:
        with self._idle:
            self._inflight += 1

    def _exit(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no pdserve call is in flight or the timeout passes; True when idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout_s)


class _Registrar:
    """Stands in for the grpc.Server during `register` to learn the registered service names."""

    def __init__(self, server: grpc.Server):
        self._server = server
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        for h in handlers:
            if hasattr(h, "service_name") and h.service_name() not in self.names:
                self.names.append(h.service_name())
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, handlers: Any) -> None:
        if service_name not in self.names:
            self.names.append(service_name)
        self._server.add_registered_method_handlers(service_name, handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


# --- the server handle --------------------------------------------------------------------

class ServerHandle:
    """A started server: its bound port, its health, and the way to drain and stop it."""

    def __init__(self, name: str, server: grpc.Server, port: int, services: list[str],
                 health_servicer: health.HealthServicer, interceptor: _Interceptor, *,
                 ready: Callable[[], bool] | None, grace_s: float,
                 on_drain: Callable[[], None] | None):
        self.name = name
        self.server = server
        self.port = port
        self.services = services
        self._health = health_servicer
        self._interceptor = interceptor
        self._ready = ready
        self._grace_s = grace_s
        self._on_drain = on_drain
        self._stop_requested = threading.Event()
        self._serving: bool | None = None
        self._lock = threading.Lock()
        if ready is None:
            self.set_serving(True)
        else:
            self.set_serving(False)
            threading.Thread(target=self._follow_ready, name=f"{name}-ready", daemon=True).start()

    def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (overall and per service). Ignored once draining.

        For services started without `ready`; with it, health follows `ready()` instead."""
        with self._lock:
            if serving == self._serving or self._stop_requested.is_set():
                return
            self._serving = serving
            status = _SERVING if serving else _NOT_SERVING
            for service in ("", *self.services):
                self._health.set(service, status)
        log.info("%s health: %s", self.name, "SERVING" if serving else "NOT_SERVING")

    def serving(self) -> bool:
        """What health Check answers now: SERVING (ready, not draining)."""
        return bool(self._serving) and not self._stop_requested.is_set()

    def _follow_ready(self) -> None:
        failed_before = False
        while True:  # the first look at once: a service ready at start is SERVING at start
            try:
                self.set_serving(bool(self._ready()))  # type: ignore[misc]
                failed_before = False
            except Exception:
                if not failed_before:
                    log.exception("%s readiness check failed; reporting NOT_SERVING", self.name)
                failed_before = True
                self.set_serving(False)
            if self._stop_requested.wait(READY_POLL_S):
                return

    def request_stop(self) -> None:
        """Begin draining (what SIGTERM does). Thread-safe; `wait()` then returns."""
        self._stop_requested.set()

    def wait(self) -> int:
        """Block until SIGTERM/SIGINT (or `request_stop`), drain, stop; return exit status 0.

        Signal handlers are installed only when called from the main thread.
        """
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        while not self._stop_requested.wait(0.5):
            pass
        self.drain()
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_requested.is_set():
            log.warning("%s: second %s, stopping now", self.name, signal.Signals(signum).name)
            self.server.stop(0)
            return
        log.info("%s: %s received, draining", self.name, signal.Signals(signum).name)
        self.request_stop()

    def drain(self) -> None:
        """NOT_SERVING for good, `on_drain()`, wait for in-flight calls up to the grace
        period, stop."""
        self._stop_requested.set()
        self._health.enter_graceful_shutdown()
        started = time.monotonic()
        if self._on_drain is not None:
            try:
                self._on_drain()
            except Exception:
                log.exception("%s: on_drain failed", self.name)
        if not self._interceptor.wait_idle(self._grace_s):
            log.warning("%s: calls still in flight after %.1fs grace; cancelling them",
                        self.name, self._grace_s)
        left_s = max(0.0, self._grace_s - (time.monotonic() - started))
        self.server.stop(min(left_s, 1.0)).wait()
        log.info("%s stopped after %.2fs of draining", self.name, time.monotonic() - started)


def start(name: str, port: int, register: Callable[[grpc.Server], None], *,
          host: str = "0.0.0.0", ready: Callable[[], bool] | None = None,
          grace_s: float = 30.0, on_drain: Callable[[], None] | None = None,
          max_workers: int = 128, credentials: grpc.ServerCredentials | None = None,
          interceptors: Sequence[grpc.ServerInterceptor] = (),
          native: ctypes.CDLL | None = None, tls: ServerTls | None = None) -> ServerHandle:
    """Create, register, bind and start a server; returns its handle (health NOT_SERVING
    until `ready()` is true, which is polled for the server's life; SERVING at once if None).

    `register(server)` adds the service's servicers (the generated `add_*_to_server`).
    `port=0` binds a free port (see `handle.port`). Raises `ServerStartError` naming the
    address when the port cannot be bound. `credentials` (pdserve.common.security): a TLS port
    instead of a plaintext one; `interceptors` run before the shared one (API keys).
    `native` (native_grpc.choose()): served by gRPC's C++ core (native_server.py; its TLS from
    `tls`, the same files as `credentials`) instead of grpcio's; the same handlers either way.
    """
    interceptor = _Interceptor()
    server: Any
    if native is not None:
        server = NativeServer(native, max_workers=max_workers, thread_name_prefix=f"{name}-rpc",
                              interceptors=(*interceptors, interceptor), options=SERVER_OPTIONS,
                              tls=tls if credentials is not None else None)
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                        thread_name_prefix=f"{name}-rpc"),
                             interceptors=(*interceptors, interceptor), options=SERVER_OPTIONS)
    registrar = _Registrar(server)
    register(registrar)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", *registrar.names):
        health_servicer.set(service, _NOT_SERVING)
    health_servicer.set(LIVENESS_SERVICE, _SERVING)
    reflection.enable_server_reflection(
        (*registrar.names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError as exc:
        raise ServerStartError(f"{name}: cannot listen on {address}: port {port} is in use "
                               f"or the address is not available ({exc})") from None
    if bound == 0:  # older grpc reported a failed bind this way
        raise ServerStartError(f"{name}: cannot listen on {address}: port {port} is in use")
    server.start()
    log.info("%s listening on %s:%d%s (%s)", name, host, bound,
             "" if credentials is None else " with TLS", ", ".join(registrar.names) or "-")
    return ServerHandle(name, server, bound, registrar.names, health_servicer, interceptor,
                        ready=ready, grace_s=grace_s, on_drain=on_drain)


def serve(name: str, port: int, register: Callable[[grpc.Server], None], *,
          host: str = "0.0.0.0", ready: Callable[[], bool] | None = None,
          grace_s: float = 30.0, on_drain: Callable[[], None] | None = None,
          max_workers: int = 128, credentials: grpc.ServerCredentials | None = None,
          interceptors: Sequence[grpc.ServerInterceptor] = (),
          native: ctypes.CDLL | None = None, tls: ServerTls | None = None) -> int:
    """`start(...)` then `wait()`: serve until SIGTERM/SIGINT, drain, return exit status 0."""
    return start(name, port, register, host=host, ready=ready, grace_s=grace_s,
                 on_drain=on_drain, max_workers=max_workers, credentials=credentials,
                 interceptors=interceptors, native=native, tls=tls).wait()
