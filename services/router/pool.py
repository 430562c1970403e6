"""The router's view of its prefill and decode workers: membership, channels, health, load.

Membership is dynamic: `set_members(role, addresses)` (called by discovery, or once with
fixed addresses) adds the workers that are new and retires those that are gone. A new worker
gets requests only once a health check said SERVING (the checker looks at it at once). A
retired worker gets no new requests; the calls it has in flight (a Prefill, a reservation with
its Decode stream and Abort) finish, and its channel is closed after the last one. A worker
whose address comes back is a member again (checked again first).

A background thread checks every member each `interval_s` (its Stats, which say whether it is
SERVING; grpc.health.v1 Check too for a worker whose Stats do not), each call bounded, all at
once (a large pool in rolling slices: check_schedule.py). Between checks the router keeps the
loads current itself: prompt tokens in flight per prefill worker, each decode worker's cached
Stats adjusted after every reservation it grants.

The per-request path takes the pool's lock for a few dictionary operations only: reading
loads, and `acquire` / `release` around each call to a worker."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from pdserve.common.metrics import WorkerCounts
from pdserve.common.security import ChannelSecurity
from pdserve.router.cache_feed import CacheFeeds, Followed
from pdserve.router.calls import WorkerCalls, reply
from pdserve.router.channels import Channel, Channels
from pdserve.router.check_schedule import DOWN_PER_TICK, plan_round, tick_s
from pdserve.router.mux import DecodeStreams
from pdserve.router.placement import DecodeLoad, PrefillLoad
from pdserve.router.worker import Worker
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdserve.router.pool")

_SERVING = health_pb2.HealthCheckResponse.SERVING
ROLES = ("prefill", "decode")
RECHECK_DOWN_S = 0.5


class WorkerPool:
    """All workers of both roles, kept checked by a background thread (thread-safe)."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (), *,
                 interval_s: float = 1.0, timeout_s: float = 1.0,
                 security: ChannelSecurity | None = None,
                 on_checked: Callable[[list[Followed]], None] | None = None,
                 cache: CacheFeeds | None = None, shared_decode_stream: bool = True,
                 native_calls: ctypes.CDLL | None = None):
        self.interval_s = interval_s
        self._on_checked = on_checked  # after each round: the healthy members (cache feeds)
        self._cache = cache  # a large pool's cache events, read with its Stats
        self.timeout_s = timeout_s
        self._security = security
        self._shared_decode_stream = shared_decode_stream  # DecodeMany, not a call per sequence
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._checked = threading.Event()  # set once the first round has run
        self._workers: dict[tuple[str, str], Worker] = {}  # by (role, address), retired too
        self._healthy: dict[str, list[str]] = {}  # role -> healthy members (see healthy())
        self._max_len: tuple[int | None] | None = None  # max_model_len() until a change
        self._suspects: set[str] = set()  # read at the next tick (check_schedule.py)
        # The cache feeds follow the healthy members after a change, else once an interval
        # (a large pool's ticks come many times an interval: following 1,000 workers took
        # 1.5-2.5 ms a time).
        self._follow_due = True
        self._followed_at = 0.0
        self._rotation = 0
        # a co-located worker's roles share them; native_calls: native_grpc.choose()
        self._channels = Channels(security, native_calls)
        self._joins = dict.fromkeys(ROLES, 0)
        self._leaves = dict.fromkeys(ROLES, 0)
        for role, addresses in zip(ROLES, (prefill, decode)):
            if addresses:
                self.set_members(role, addresses)

    # --- membership -------------------------------------------------------------------------

    def set_members(self, role: str, addresses: Sequence[str] | Mapping[str, str]) -> None:
        """Make `addresses` the workers of `role`. A mapping gives, per address, the name its
        TLS certificate must carry ("" = the address's host; --tls-server-name wins)."""
        names = addresses if isinstance(addresses, Mapping) else dict.fromkeys(addresses, "")
        stub_cls = prefill_pb2_grpc.PrefillStub if role == "prefill" else \
            decode_pb2_grpc.DecodeStub
        idle: list[Worker] = []
        with self._lock:
            for address, tls_name in names.items():
                worker = self._workers.get((role, address))
                if worker is not None and worker.member:
                    continue
                if worker is not None:  # back before its last call ended: check it again
                    worker.member, worker.healthy, worker.checked = True, False, False
                else:
                    channel, calls = self._channels.get(address, tls_name)
                    stub = stub_cls(channel)
                    self._workers[(role, address)] = Worker(
                        address, role, channel, stub, WorkerCalls(calls, role),
                        streams=DecodeStreams(stub, address) if role == "decode"
                        and self._shared_decode_stream else None)
                self._joins[role] += 1
                log.info("%s worker %s joins (used once SERVING)", role, address)
            for (r, address), worker in self._workers.items():
                if r == role and worker.member and address not in names:
                    worker.member = False
                    self._leaves[role] += 1
                    log.info("%s worker %s leaves: no new requests, %d calls in flight",
                             role, address, worker.calls)
                    if worker.calls == 0:
                        idle.append(worker)
            closing = [c for w in idle for c in self._drop(w)]
            self._changed()
        self._close(closing)
        self._wake.set()  # newcomers are checked now, not at the next round

    def _drop(self, worker: Worker) -> list[Channel]:
        """Forget a retired worker whose calls ended (lock held); its channels when no other
        role uses them."""
        del self._workers[(worker.role, worker.address)]
        if any(w.address == worker.address for w in self._workers.values()):
            return []
        log.info("%s worker %s left: its calls ended, channel closed", worker.role,
                 worker.address)
        return self._channels.pop(worker.address)

    @staticmethod
    def _close(channels: list[Channel]) -> None:
        # Not on the caller's thread: `release` may run in a gRPC callback of that channel.
        for channel in channels:
            threading.Thread(target=channel.close, name="router-pool-close", daemon=True).start()

    def acquire(self, role: str, address: str, prompt_tokens: int = 0) -> Worker | None:
        """The worker for a new call, counted in use until `release`; None when it is no
        longer a member. `prompt_tokens`: counted as in flight on a prefill worker."""
        with self._lock:
            worker = self._workers.get((role, address))
            if worker is None or not worker.member:
                return None
            worker.calls += 1
            worker.inflight_prompt_tokens += prompt_tokens
            worker.placed += role == "prefill"  # (decode: counted when a Reserve is granted)
            return worker

    def release(self, worker: Worker, prompt_tokens: int = 0) -> None:
        """A call that `acquire` counted ended; a retired worker's last one closes it."""
        with self._lock:
            worker.calls -= 1
            worker.inflight_prompt_tokens -= prompt_tokens
            drop = (not worker.member and worker.calls == 0
                    and self._workers.get((worker.role, worker.address)) is worker)
            channels = self._drop(worker) if drop else []
        self._close(channels)

    # --- checking -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background checks (the first round runs at once)."""
        self._thread = threading.Thread(target=self._run, name="router-pool", daemon=True)
        self._thread.start()

    def wait_checked(self, timeout_s: float | None = None) -> bool:
        """Block until the first round has run (each call in it is bounded by `timeout_s`
        of the pool), or `timeout_s` passes; True when it has."""
        return self._checked.wait(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            with self._lock:
                members = [w for w in self._workers.values() if w.member]
                urgent = [w for w in members if w.address in self._suspects or not w.checked]
                now = time.monotonic()  # and the longest-down ones, a slice a tick
                urgent += sorted((w for w in members if w.checked and not w.healthy
                                  and now - w.checked_at >= RECHECK_DOWN_S),
                                 key=lambda w: w.checked_at)[:DOWN_PER_TICK]
            turn = plan_round(members, self._rotation, self.interval_s, urgent)
            self._rotation = turn.next_start
            try:
                self.check_now(turn.workers)
            except Exception:  # a checker that stops would freeze membership: never
                log.exception("worker health check round failed; checking again")
            self._checked.set()
            self._wake.wait(tick_s(len(members), self.interval_s,
                                   all(w.healthy for w in members), RECHECK_DOWN_S))

    def check_now(self, workers: list[Worker] | None = None) -> None:
        """One round: Stats (and Check, see `_ask`) of `workers` (all members), all in flight
        at once, read in turn on this thread."""
        if workers is None:
            with self._lock:
                workers = [w for w in self._workers.values() if w.member]
        calls = [self._ask(w) for w in workers]
        for worker, call in zip(workers, calls):
            if call is None:
                continue
            check, stat = call
            fresh: common_pb2.WorkerStats | None = None
            error = "not SERVING"
            try:
                fresh = reply(stat)
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            if fresh is not None and fresh.HasField("cache"):
                if self._cache is not None and worker.member:
                    self._cache.polled(worker.address, fresh.cache)
                fresh.ClearField("cache")  # kept below: its keys are the index's now
            if check is None:  # Stats says what Check would; an older worker's: Check next round
                healthy = fresh is not None and (fresh.serving if fresh.HasField("serving")
                                                 else worker.healthy)
            else:
                try:
                    healthy, error = reply(check).status == _SERVING, "not SERVING"
                except grpc.RpcError as exc:
                    healthy, error = False, f"{exc.code().name}: {exc.details()}"
            with self._lock:
                if worker.address in self._suspects:  # drawn again (or not) from now on
                    self._suspects.discard(worker.address)
                    self._changed()
                if not worker.member:
                    continue
                if healthy != worker.healthy:
                    self._changed()
                    log.info("%s worker %s is %s", worker.role, worker.address,
                             "healthy" if healthy else f"unhealthy ({error})")
                worker.healthy, worker.checked, worker.checked_at = healthy, True, time.monotonic()
                worker.last_error = "" if healthy else error
                if fresh is not None:
                    if worker.stats is None or \
                            worker.stats.max_model_len != fresh.max_model_len:
                        self._changed()
                    worker.stats = fresh
        for worker in workers:  # streams no sequence used for a while: their threads back
            if worker.streams is not None:
                worker.streams.close_idle()
        now = time.monotonic()
        if self._on_checked is not None and (
                self._follow_due or now - self._followed_at >= self.interval_s):
            self._follow_due, self._followed_at = False, now
            self._on_checked(self.followable())

    def followable(self) -> list[Followed]:
        """Healthy members, one per address (a co-located worker serves both roles), with a
        way to open their cache-event stream."""
        with self._lock:
            found = {w.address: Followed(w.address, w.stub.CacheEvents)
                     for w in sorted(self._workers.values(), key=lambda w: w.role)
                     if w.member and w.healthy}
        return list(found.values())

    def _ask(self, worker: Worker) -> tuple[Any, Any] | None:
        """Start `worker`'s Stats call, and its health Check unless its last Stats said
        `serving` (one call, not two); None when its channel closed since the round began."""
        t = self.timeout_s
        try:
            check = None if worker.stats is not None and worker.stats.HasField("serving") \
                else worker.unary.check(health_pb2.HealthCheckRequest(), timeout=t)
            return check, worker.unary.stats(self._stats_request(worker), timeout=t)
        except ValueError:  # grpc: "Cannot invoke RPC: Channel closed!"
            log.debug("%s worker %s left during a check round", worker.role, worker.address)
            return None

    def _stats_request(self, worker: Worker) -> common_pb2.StatsRequest:
        """With the worker's cache events when the feeds read them this way (once per
        address: a co-located worker's prefill role asks)."""
        if self._cache is None or (worker.role == "decode"
                                   and ("prefill", worker.address) in self._workers):
            return common_pb2.StatsRequest()
        return self._cache.stats_request(worker.address)

    def close(self) -> None:
        """Stop checking and close every channel."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1)
        with self._lock:
            channels = self._channels.pop_all()
        for channel in channels:
            channel.close()

    # --- what placement, the lifecycle and metrics read -----------------------------------

    def ready(self) -> bool:
        """At least one healthy prefill and one healthy decode worker."""
        with self._lock:
            roles = {w.role for w in self._workers.values() if w.healthy and w.member}
        return roles >= set(ROLES)

    def unready_reason(self) -> str:
        """Why `ready()` is false ("" when it is true): the roles without a healthy worker,
        with what their members last answered."""
        with self._lock:
            members = [w for w in self._workers.values() if w.member]
        missing = []
        for role in ROLES:
            mine = [w for w in members if w.role == role]
            if any(w.healthy for w in mine):
                continue
            if not mine:
                missing.append(f"no {role} worker known yet")
                continue
            seen = "; ".join(f"{w.address}: {w.last_error or 'not checked yet'}"
                             for w in mine[:3])
            more = f"; {len(mine) - 3} more" if len(mine) > 3 else ""
            missing.append(f"no healthy {role} worker ({seen}{more})")
        return "; ".join(missing)

    def max_model_len(self) -> int | None:
        """The longest sequence every healthy worker serves (the least they report in Stats);
        None before any has reported it. Kept between changes: every request asks, and a scan
        of 1,000 workers cost it ~0.1 ms."""
        with self._lock:
            if self._max_len is None:
                reported = [w.stats.max_model_len for w in self._workers.values()
                            if w.member and w.healthy and w.stats is not None
                            and w.stats.max_model_len > 0]
                self._max_len = (min(reported, default=None),)
            return self._max_len[0]

    def _changed(self) -> None:
        """Membership, health or a worker's context changed (lock held): what is kept
        between changes is found again."""
        self._healthy.clear()
        self._max_len = None
        self._follow_due = True

    def addresses(self, role: str) -> list[str]:
        """The members of `role` (healthy or not), in the order they joined."""
        with self._lock:
            return [w.address for w in self._workers.values() if w.role == role and w.member]

    def counts(self) -> dict[str, WorkerCounts]:
        """Per role: healthy members, members, retired workers with calls still in flight,
        and the joins and leaves so far."""
        with self._lock:
            workers = list(self._workers.values())
            return {role: WorkerCounts(
                healthy=sum(w.healthy and w.member for w in workers if w.role == role),
                members=sum(w.member for w in workers if w.role == role),
                leaving=sum(not w.member for w in workers if w.role == role),
                joins=self._joins[role], leaves=self._leaves[role]) for role in ROLES}

    def healthy(self, role: str) -> list[str]:
        """The healthy members of `role` not suspected down since their last check (kept
        between changes: placement in a large pool draws from it)."""
        with self._lock:
            found = self._healthy.get(role)
            if found is None:
                found = self._healthy[role] = [
                    w.address for w in self._workers.values() if w.role == role and w.member
                    and w.healthy and w.address not in self._suspects]
            return found

    def _members(self, role: str, among: Collection[str] | None) -> list[Worker]:
        if among is None:
            return [w for w in self._workers.values() if w.role == role and w.member]
        return [w for a in among if (w := self._workers.get((role, a))) and w.member]

    def prefill_loads(self, among: Collection[str] | None = None) -> list[PrefillLoad]:
        """Health and pending prompt tokens of every prefill member (or those `among`)."""
        with self._lock:
            return [w.prefill_load() for w in self._members("prefill", among)]

    def decode_loads(self, among: Collection[str] | None = None) -> list[DecodeLoad]:
        """Health and last (locally adjusted) Stats of every decode member (or those `among`)."""
        with self._lock:
            return [w.decode_load() for w in self._members("decode", among)]

    # --- what the lifecycle reports back --------------------------------------------------

    def suspect(self, address: str) -> None:
        """A call to `address` failed as if the worker were down: check it now (a small
        pool: every worker); until then it is not drawn for placement in a large pool."""
        log.debug("worker %s suspected down; checking now", address)
        with self._lock:
            self._suspects.add(address)
            self._changed()
        self._wake.set()

    def note_reserved(self, worker: Worker, num_pages: int) -> None:
        """A decode worker granted a reservation: adjust its cached Stats until the next check."""
        with self._lock:
            worker.placed += 1
            if worker.stats is not None:
                stats = common_pb2.WorkerStats()
                stats.CopyFrom(worker.stats)
                stats.free_pages = max(0, stats.free_pages - num_pages)
                stats.reserved_tickets += 1
                worker.stats = stats
