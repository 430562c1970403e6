"""The router's view of its prefill and decode workers: channels, health, load.

A background thread checks every worker each `interval_s` (grpc.health.v1 Check and the
worker's Stats, both with a bounded timeout, all workers at once). Between checks the router
keeps the loads current itself: prompt tokens in flight per prefill worker, and each decode
worker's cached Stats adjusted after every reservation it grants.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.router.placement import DecodeLoad, PrefillLoad
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdserve.router.pool")

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),        # notice a silent peer on a long decode stream
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 200),  # a restarted worker is seen again quickly
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Worker:
    """One worker: its channel and stubs, and the router's latest knowledge of it."""

    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.Channel
    stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    stats: common_pb2.WorkerStats | None = None
    inflight_prompt_tokens: int = 0
    last_error: str = field(default="", repr=False)


RECHECK_DOWN_S = 0.5


class WorkerPool:
    """All workers of both roles, kept checked by a background thread."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 interval_s: float = 1.0, timeout_s: float = 1.0,
                 security: ChannelSecurity | None = None):
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers: dict[tuple[str, str], Worker] = {}  # by (role, address)
        channels: dict[str, grpc.Channel] = {}  # a co-located worker serves both roles
        for role, addresses, stub_cls in (("prefill", prefill, prefill_pb2_grpc.PrefillStub),
                                          ("decode", decode, decode_pb2_grpc.DecodeStub)):
            for address in addresses:
                channel = channels.get(address) or open_channel(address, security,
                                                                CHANNEL_OPTIONS)
                channels[address] = channel
                self._workers[(role, address)] = Worker(address, role, channel, stub_cls(channel),
                                                        health_pb2_grpc.HealthStub(channel))
        self._channels = list(channels.values())

    # --- checking -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background checks (the first round runs at once)."""
        self._thread = threading.Thread(target=self._run, name="router-pool", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check_now()
            with self._lock:
                all_healthy = all(w.healthy for w in self._workers.values())
            # A worker that is down (or still starting) is looked at again soon, so it rejoins
            # quickly; healthy ones every interval.
            self._wake.wait(self.interval_s if all_healthy
                            else min(self.interval_s, RECHECK_DOWN_S))
            self._wake.clear()

    def check_now(self) -> None:
        """One round: health Check and Stats of every worker, in parallel, bounded."""
        workers = list(self._workers.values())
        checks = [w.health.Check.future(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
                  for w in workers]
        stats = [w.stub.Stats.future(common_pb2.StatsRequest(), timeout=self.timeout_s)
                 for w in workers]
        for worker, check, stat in zip(workers, checks, stats):
            try:
                healthy, error = check.result().status == _SERVING, "not SERVING"
            except grpc.RpcError as exc:
                healthy, error = False, f"{exc.code().name}: {exc.details()}"
            try:
                fresh: common_pb2.WorkerStats | None = stat.result()
            except grpc.RpcError:
                fresh = None
            with self._lock:
                if healthy != worker.healthy:
                    log.info("%s worker %s is %s", worker.role, worker.address,
                             "healthy" if healthy else f"unhealthy ({error})")
                worker.healthy = healthy
                worker.last_error = "" if healthy else error
                if fresh is not None:
                    worker.stats = fresh

    def close(self) -> None:
        """Stop checking and close every channel."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1)
        for channel in self._channels:
            channel.close()

    # --- what placement and the lifecycle read --------------------------------------------

    def ready(self) -> bool:
        """At least one healthy prefill and one healthy decode worker."""
        with self._lock:
            roles = {w.role for w in self._workers.values() if w.healthy}
        return roles >= {"prefill", "decode"}

    def prefill_loads(self) -> list[PrefillLoad]:
        """Every prefill worker's health and pending prompt tokens."""
        with self._lock:
            return [PrefillLoad(w.address, w.healthy,
                                w.stats.queued_prompt_tokens if w.stats else 0,
                                w.inflight_prompt_tokens)
                    for w in self._workers.values() if w.role == "prefill"]

    def decode_loads(self) -> list[DecodeLoad]:
        """Every decode worker's health and its last known (locally adjusted) Stats."""
        with self._lock:
            return [self._decode_load(w) for w in self._workers.values() if w.role == "decode"]

    @staticmethod
    def _decode_load(w: Worker) -> DecodeLoad:
        load = DecodeLoad(w.address, w.healthy)
        if w.stats is None:
            return load
        s = w.stats
        return replace(load, free_pages=s.free_pages, running_sequences=s.running_sequences,
                       waiting_sequences=s.waiting_sequences, reserved_tickets=s.reserved_tickets,
                       block_size=s.fingerprint.block_size or load.block_size)

    def prefill_stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        stub = self._workers[("prefill", address)].stub
        assert isinstance(stub, prefill_pb2_grpc.PrefillStub)
        return stub

    def decode_stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        stub = self._workers[("decode", address)].stub
        assert isinstance(stub, decode_pb2_grpc.DecodeStub)
        return stub

    # --- what the lifecycle reports back --------------------------------------------------

    def suspect(self, address: str) -> None:
        """A call to `address` failed as if the worker were down: check every worker now."""
        log.debug("worker %s suspected down; checking now", address)
        self._wake.set()

    def note_reserved(self, address: str, num_pages: int) -> None:
        """A decode worker granted a reservation: adjust its cached Stats until the next check."""
        with self._lock:
            worker = self._workers[("decode", address)]
            if worker.stats is not None:
                stats = common_pb2.WorkerStats()
                stats.CopyFrom(worker.stats)
                stats.free_pages = max(0, stats.free_pages - num_pages)
                stats.reserved_tickets += 1
                worker.stats = stats

    @contextmanager
    def prefill_work(self, address: str, num_prompt_tokens: int) -> Iterator[None]:
        """Count `num_prompt_tokens` as in flight on a prefill worker while inside."""
        with self._lock:
            self._workers[("prefill", address)].inflight_prompt_tokens += num_prompt_tokens
        try:
            yield
        finally:
            with self._lock:
                self._workers[("prefill", address)].inflight_prompt_tokens -= num_prompt_tokens
