"""A gRPC server on gRPC's C++ core (native_grpc.py), answered by the same Python handlers as
grpcio's.

`NativeServer` stands in for the `grpc.Server` of the server bootstrap (common/server.py):
servicers, health, reflection and interceptors are registered as they are with grpcio, and
each call runs its handler on a thread of a pool with a `grpc.ServicerContext` of its own.
What changes is below the handler: csrc/grpc_server.cc takes every event of every call on one
C++ thread, and a handler's responses are queued there and sent in order without its thread
waiting for each (grpcio's server waits for every message it sends, two thread switches each).
A 9-message stream cost the server 0.25 ms of CPU against grpcio's 0.93 (tools/grpc_floor.py,
Zen 3): the router's Generate streams are most of its messages (docs/benchmarks.md, issue 24).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import grpc
from pdserve.common.security import ServerTls

log = logging.getLogger("pdserve.server")

QUEUED = 16  # a call's responses not yet sent past which its handler waits


class Metadatum(NamedTuple):
    key: str
    value: str | bytes


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[Metadatum, ...]):
        self.method = method
        self.invocation_metadata = metadata


class _Abort(Exception):
    """What `context.abort` raises: the call ends with the context's status."""


class Context(grpc.ServicerContext):
    """One call's context, as grpcio's handlers use it."""

    def __init__(self, lib: ctypes.CDLL, call: int, metadata: tuple[Metadatum, ...], peer: str,
                 remaining_s: float):
        self._lib, self._call = lib, call
        self._metadata, self._peer = metadata, peer
        self._deadline = None if remaining_s < 0 else time.monotonic() + remaining_s
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False
        self._lock = threading.Lock()
        self.status_code: grpc.StatusCode = grpc.StatusCode.OK
        self.status_details = ""

    # -- the call ----------------------------------------------------------------------------
    @property
    def native_call(self) -> int:
        """The C++ call, for a writer in C++ while the handler runs (router/native_relay.py)."""
        return self._call

    def is_active(self) -> bool:
        with self._lock:
            return not self._ended and bool(self._lib.pds_active(self._call))

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def cancel(self) -> None:
        with self._lock:
            if not self._ended:
                self._lib.pds_cancel(self._call)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        """The call is over (finished here, or cancelled by the client): run its callbacks
        once, on this thread."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a call's termination callback failed")

    # -- who called --------------------------------------------------------------------------
    def invocation_metadata(self) -> tuple[Metadatum, ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> list[bytes] | None:
        with self._lock:
            if self._ended:
                return None
            raw = self._lib.pds_identities(self._call) or b""
        return [line for line in raw.split(b"\n") if line] or None

    def peer_identity_key(self) -> str | None:
        return "x509_subject_alternative_name" if self.peer_identities() else None

    def auth_context(self) -> dict[str, list[bytes]]:
        ids = self.peer_identities()
        return {"x509_subject_alternative_name": ids} if ids else {}

    # -- the answer --------------------------------------------------------------------------
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status_code, self.status_details = code, details
        raise _Abort(details)

    def abort_with_status(self, status: Any) -> None:
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.status_code = code

    def set_details(self, details: str) -> None:
        self.status_details = details

    def code(self) -> grpc.StatusCode:
        return self.status_code

    def details(self) -> str:
        return self.status_details

    def send_initial_metadata(self, initial_metadata: Any) -> None:
        pass  # sent with the first message

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        pass

    def trailing_metadata(self) -> Any:
        return None

    def set_compression(self, compression: Any) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass


def _parse_metadata(raw: bytes) -> tuple[Metadatum, ...]:
    pairs: list[Metadatum] = []
    at = 0
    fields: list[bytes] = []
    while at + 4 <= len(raw):
        (size,) = struct.unpack_from("=I", raw, at)
        fields.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    for key, value in zip(fields[0::2], fields[1::2]):
        name = key.decode()
        pairs.append(Metadatum(name, value if name.endswith("-bin") else value.decode()))
    return tuple(pairs)


class NativeServer:
    """What the server bootstrap uses of a `grpc.Server`, served by csrc/grpc_server.cc."""

    def __init__(self, lib: ctypes.CDLL, *, max_workers: int, thread_name_prefix: str,
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 options: Sequence[tuple[str, Any]] = (), tls: ServerTls | None = None):
        self._lib = lib
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._interceptors = tuple(interceptors)
        self._options = tuple(options)
        self._tls = tls
        self._generic: list[grpc.GenericRpcHandler] = []
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._server: int | None = None
        self._held: dict[int, Context] = {}  # calls a handler runs now, by their handle
        self._held_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- registration, as grpc.Server ---------------------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for method, handler in handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def add_insecure_port(self, address: str) -> int:
        if self._tls is not None:
            raise RuntimeError("this server was made for TLS: add_secure_port")
        return self._bind(address)

    def add_secure_port(self, address: str, credentials: Any = None) -> int:
        """TLS from the `ServerTls` given at construction (`credentials` is grpcio's)."""
        if self._tls is None:
            raise RuntimeError("a TLS port needs the server's ServerTls")
        return self._bind(address)

    def _bind(self, address: str) -> int:
        if self._server is not None:
            raise RuntimeError("one port per native server")
        tls = self._tls
        cert, key, ca = tls.pems() if tls is not None else (b"", b"", None)
        pem = (cert, key, ca or b"")
        auth = 2 if tls is not None and tls.require_client else 0  # as grpcio's credentials
        lines = "\n".join(f"{key}={int(value) if isinstance(value, bool) else value}"
                          for key, value in self._options).encode()
        port = ctypes.c_int(0)
        server = self._lib.pds_start(address.encode(), lines, *pem, auth, ctypes.byref(port))
        if not server:
            raise RuntimeError(f"Failed to bind to address {address}")
        self._server = server
        return port.value

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._server is None:
            raise RuntimeError("no port added")
        for i in range(self._max_workers):
            self._spawn(self._serve_calls, f"{self._prefix}_{i}")
        self._spawn(self._end_cancelled, f"{self._prefix}-ended")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, give those in flight `grace` seconds, then cancel them; the event
        is set once every call has ended."""
        stopped = threading.Event()
        server, self._server = self._server, None
        if server is None:
            stopped.set()
            return stopped

        def stop() -> None:
            self._lib.pds_stop(server, grace or 0.0)
            stopped.set()

        threading.Thread(target=stop, name=f"{self._prefix}-stop", daemon=True).start()
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        for thread in self._threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    # -- calls --------------------------------------------------------------------------------
    def _serve_calls(self) -> None:
        server = self._server
        while server is not None:
            call = self._lib.pds_accept(server)
            if not call:
                return
            try:
                self._serve(call)
            except Exception:  # a bug here must not take the thread with it
                log.exception("native server: a call failed outside its handler")

    def _end_cancelled(self) -> None:
        server = self._server
        while server is not None:
            call = self._lib.pds_next_ended(server)
            if not call:
                return
            with self._held_lock:
                context = self._held.get(call)
            if context is not None:
                context.end()
            self._lib.pds_release(call)

    def _serve(self, call: int) -> None:
        lib = self._lib
        method, meta, peer = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
        size, remaining = ctypes.c_size_t(), ctypes.c_double()
        lib.pds_describe(call, ctypes.byref(method), ctypes.byref(meta), ctypes.byref(size),
                         ctypes.byref(peer), ctypes.byref(remaining))
        path = (method.value or b"").decode()
        metadata = _parse_metadata(ctypes.string_at(meta, size.value))
        context = Context(lib, call, metadata, (peer.value or b"").decode(), remaining.value)
        with self._held_lock:
            self._held[call] = context
        try:
            code, details = self._answer(call, path, metadata, context)
            lib.pds_finish(call, code.value[0], details.encode())
        finally:
            with self._held_lock:
                del self._held[call]
            context.end()
            lib.pds_release(call)

    def _answer(self, call: int, path: str, metadata: tuple[Metadatum, ...],
                context: Context) -> tuple[grpc.StatusCode, str]:
        handler = self._handler(_CallDetails(path, metadata))
        if handler is None:
            return grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
        parse = handler.request_deserializer or (lambda data: data)
        serialize = handler.response_serializer or (lambda message: message)
        requests = self._requests(call, parse)
        try:
            request: Any = requests if handler.request_streaming else next(requests, None)
        except Exception:  # as grpcio answers it
            request = None
        if request is None:
            return grpc.StatusCode.INTERNAL, "Exception deserializing request!"
        try:
            if handler.response_streaming:
                behaviour = handler.stream_stream if handler.request_streaming \
                    else handler.unary_stream
                responses = behaviour(request, context)
                try:
                    for response in responses:
                        if not self._write(call, serialize(response)):
                            break  # the call is over (cancelled): stop the handler here
                finally:
                    close = getattr(responses, "close", None)
                    if close is not None:
                        close()
            else:
                behaviour = handler.stream_unary if handler.request_streaming \
                    else handler.unary_unary
                response = behaviour(request, context)
                if context.status_code == grpc.StatusCode.OK:
                    if response is None:
                        return grpc.StatusCode.INTERNAL, "the handler returned no response"
                    self._write(call, serialize(response))
        except _Abort:
            pass
        except Exception as exc:
            if context.status_code == grpc.StatusCode.OK:
                log.exception("Exception calling application: %s", exc)
                return grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}"
        return context.status_code, context.status_details

    def _write(self, call: int, data: bytes) -> bool:
        """Queue a response; False once the call is over. Past QUEUED responses not yet sent
        (a slow reader), wait until half of them are."""
        queued = self._lib.pds_write(call, data, len(data))
        if queued < 0:
            return False
        return queued < QUEUED or bool(self._lib.pds_wait_below(call, QUEUED // 2))

    def _requests(self, call: int, parse: Callable[[bytes], Any]) -> Iterator[Any]:
        data, size = ctypes.c_char_p(), ctypes.c_size_t()
        while self._lib.pds_read(call, ctypes.byref(data), ctypes.byref(size)):
            yield parse(ctypes.string_at(data, size.value))

    def _handler(self, details: _CallDetails) -> grpc.RpcMethodHandler | None:
        def lookup(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            found = self._registered.get(d.method)
            for generic in self._generic if found is None else ():
                found = generic.service(d)
                if found is not None:
                    break
            return found

        def through(i: int, d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if i == len(self._interceptors):
                return lookup(d)
            return self._interceptors[i].intercept_service(
                functools.partial(through, i + 1), d)

        return through(0, details)
