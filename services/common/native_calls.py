"""Calls on gRPC's C++ core (native_grpc.py, csrc/grpc_calls.cc) as grpcio's multi-callables
make them: the router's calls to its workers. The same methods and messages (serialized here);
~150 us of CPU a unary call against grpcio's ~300 (Zen 3). Every event of every call is taken by
one C++ thread; the Python thread that waits for a call sleeps on it with the GIL released.
Cancellation, deadlines, metadata, TLS and the channel options are grpc's own.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from pdserve.common.security import ChannelSecurity

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # gRPC's numbers -> codes


class StatusError(grpc.RpcError):
    """A call's failure as grpcio's calls report theirs (a native call's, a sequence's on a
    shared stream: router/mux.py)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class NativeCall:
    """One call: iterate it on one thread (its messages, then its error if it failed);
    `cancel()` it from any."""

    def __init__(self, lib: ctypes.CDLL, handle: int, parse: Callable[[bytes], Any]):
        self._lib, self._parse = lib, parse
        self._handle: int | None = handle
        self._lock = threading.Lock()  # the handle's end against a cancel from elsewhere

    def __iter__(self) -> NativeCall:
        return self

    def __next__(self) -> Any:
        handle = self._handle
        if handle is None:
            raise StopIteration
        data, size = ctypes.c_char_p(), ctypes.c_size_t()
        if self._lib.pdn_next(handle, ctypes.byref(data), ctypes.byref(size)):
            return self._parse(ctypes.string_at(data, size.value))
        details = ctypes.c_char_p()
        code = self._lib.pdn_status(handle, ctypes.byref(details))
        text = (details.value or b"").decode(errors="replace")
        self._free()
        if code != 0:
            raise StatusError(STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN), text)
        raise StopIteration

    def cancel(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._lib.pdn_cancel(self._handle)

    @property
    def handle(self) -> int | None:
        """The C++ call, for a reader in C++ (router/native_relay.py) while this one holds it;
        None once it was read to its end here."""
        return self._handle

    def _free(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.pdn_free(handle)

    def __del__(self) -> None:  # dropped unread: cancelled, and freed once its last event is in
        self._free()


class NativeMethod:
    """A method of a `NativeChannel`, called as grpcio's multi-callables are."""

    def __init__(self, channel: NativeChannel, path: str, serialize: Callable[[Any], bytes],
                 parse: Callable[[bytes], Any], stream: bool):
        self._channel, self._path = channel, path.encode()
        self._serialize, self._parse, self._stream = serialize, parse, stream

    def __call__(self, request: Any, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> NativeCall:
        handle = self._channel.handle()
        data = self._serialize(request)
        pairs = "".join(f"{k}\n{v}\n" for k, v in metadata or ()).encode()
        lib = self._channel.lib
        call = lib.pdn_start(handle, self._path, data, len(data), timeout or 0.0, pairs,
                             int(self._stream))
        return NativeCall(lib, call, self._parse)


class NativeChannel:
    """A channel to one worker on the native library: TLS when `security` is given."""

    def __init__(self, lib: ctypes.CDLL, target: str, security: ChannelSecurity | None,
                 options: Sequence[tuple[str, Any]] = ()):
        self.lib = lib
        lines = [f"{key}={value}" for key, value in
                 (*options, *(security.options() if security else ()))]
        pems = security.pems() if security is not None else (None, None, None)
        self._handle: int | None = lib.pdn_channel(target.encode(), "\n".join(lines).encode(),
                                                   *(p or b"" for p in pems),
                                                   int(security is not None))

    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("Cannot invoke RPC: Channel closed!")  # as grpcio says it
        return self._handle

    def method(self, path: str, serialize: Callable[[Any], bytes],
               parse: Callable[[bytes], Any], stream: bool = False) -> NativeMethod:
        return NativeMethod(self, path, serialize, parse, stream)

    def close(self) -> None:
        """No new calls; those in flight finish (they hold the channel)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self.lib.pdn_channel_free(handle)
