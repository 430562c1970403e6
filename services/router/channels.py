"""The router's channels to its workers: two per worker address, shared by a co-located
worker's two roles. One carries the calls run on the reading thread (`calls.WorkerCalls`:
Reserve, Prefill, a sequence's Decode, Stats, Check), the other grpc's threaded calls (the
shared DecodeMany streams, CacheEvents, Abort, Renew). Not thread-safe: the pool's lock."""

from __future__ import annotations

import ctypes
from typing import Any, TypeAlias

import grpc
from pdserve.common.native_calls import NativeChannel
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.router.calls import ON_THREAD

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),        # notice a silent peer on a long decode stream
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 200),  # a restarted worker is seen again quickly
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # The router retries on another worker itself (attempts.py): grpc's retry machinery would
    # only copy every call's messages for a replay it never makes.
    ("grpc.enable_retries", 0),
    # Small messages: no bandwidth-delay pings to grow flow-control windows.
    ("grpc.http2.bdp_probe", 0),
)


Channel: TypeAlias = grpc.Channel | NativeChannel


class Channels:
    """`native`: the on-thread channels on the native library (native_calls.py); None: grpcio."""

    def __init__(self, security: ChannelSecurity | None, native: ctypes.CDLL | None = None):
        self._security = security
        self._native = native
        self._open: dict[str, tuple[grpc.Channel, Channel]] = {}

    def __contains__(self, address: str) -> bool:
        return address in self._open

    def get(self, address: str, tls_name: str) -> tuple[grpc.Channel, Channel]:
        """The address's (threaded, on-thread) channels, opened now if they are not open.
        `tls_name`: the name its certificate carries ("" = the address's host)."""
        if address not in self._open:
            options: tuple[tuple[str, Any], ...] = CHANNEL_OPTIONS
            if tls_name and self._security is not None and not self._security.server_name:
                options = (*options, ("grpc.ssl_target_name_override", tls_name))
            on_thread = (NativeChannel(self._native, address, self._security, options)
                         if self._native is not None else
                         open_channel(address, self._security, (*options, *ON_THREAD)))
            self._open[address] = (open_channel(address, self._security, options), on_thread)
        return self._open[address]

    def pop(self, address: str) -> list[Channel]:
        """Forget the address's channels; them, to close."""
        return list(self._open.pop(address, ()))

    def pop_all(self) -> list[Channel]:
        channels = [c for pair in self._open.values() for c in pair]
        self._open.clear()
        return channels
