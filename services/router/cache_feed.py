"""The router's side of the workers' cache events, into the index: a stream per worker in a
pool up to FOLLOW_MAX_WORKERS, the workers' Stats reads in a larger one.

`CacheFeeds.sync(members)` (called after each health-check round) follows every healthy
member and stops following those that left: their entries leave the index at once. A broken
stream drops the worker's entries and is opened again (a new snapshot) after `retry_s`; a
worker that does not serve CacheEvents (older) is left out of cache-aware placement. The
prompt's page keys are computed here with the worker's own layout (the snapshot names it), so
workers of another model or block size never match.

A larger pool is followed without streams: each worker's Stats read (which the router makes
anyway, every worker every `members / CHECKS_PER_S` seconds: 10 s for 1,000) sends a cursor
and brings back the changes after it (`cursor`, `polled`); the index lags by up to a read
period, but costs no message of its own; so that the router does not forget its own
placements meanwhile, it counts them as held for a read period (and a second) instead of 2 s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from pdserve.common import wire
from pdserve.common.prefix import page_keys, root_key
from pdserve.router.cache_index import CacheIndex
from pdserve.router.check_schedule import CHECKS_PER_S
from pdserve.v1 import common_pb2

log = logging.getLogger("pdserve.router.cache")


@dataclass(frozen=True)
class Followed:
    """A worker to follow: its address and how to open its CacheEvents stream."""

    address: str
    open_stream: Callable[[common_pb2.CacheEventsRequest], grpc.Call]


# Following a worker's cache events holds a gRPC stream and a thread in the router: with 1,000
# simulated workers, 1,000 streams starved the router's own server (no request was served at
# all; docs/benchmarks.md, issue 24); on one asyncio loop instead they cost 19% more CPU a
# request and doubled the router-added p50. Larger pools are followed through their Stats.
FOLLOW_MAX_WORKERS = 128


class CacheFeeds:
    def __init__(self, index: CacheIndex | None = None, *, retry_s: float = 0.5,
                 heartbeat_ms: float = 1000.0):
        self.index = index or CacheIndex()
        self._retry_s = retry_s
        self._heartbeat_ms = heartbeat_ms
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._streams: dict[str, grpc.Call | None] = {}  # followed now (None: opening)
        self._layout: dict[str, tuple[int, int]] = {}   # worker -> (root key, block size)
        self._layouts: dict[tuple[int, int], int] = {}  # layout -> workers that have it
        self._unsupported: set[str] = set()
        self._too_many = False  # past FOLLOW_MAX_WORKERS: followed through Stats
        self._polled: set[str] = set()  # workers whose Stats brought entries
        self._guess_s = self.index.speculative_s  # a placement held until events say so
        # One request's placements (decode, prefill) and speculations all ask for the keys of
        # the same prompt, on the same thread: hashed once per layout, not once per question.
        self._recent = threading.local()
        self._members: frozenset[str] = frozenset()  # healthy workers, as of the last sync
        # Called with (worker, layout, keys) for each of this router's placements (peers.py).
        self.on_placed: Callable[[str, tuple[int, int], list[int]], None] | None = None

    def sync(self, members: Iterable[Followed]) -> None:
        """Follow these workers (start streams for new ones); stop following the rest. More
        than FOLLOW_MAX_WORKERS: no streams, their Stats reads bring their events."""
        wanted = {m.address: m for m in members}
        self._members = frozenset(wanted)
        with self._lock:
            left = self._polled - wanted.keys()
            self._polled -= left
        for address in left:
            self._forget(address)
        if len(wanted) > FOLLOW_MAX_WORKERS:
            if not self._too_many:
                log.info("%d workers: their cache events come with their Stats (more than %d "
                         "would take a stream and a thread each)", len(wanted),
                         FOLLOW_MAX_WORKERS)
            self._too_many = True
            self.index.speculative_s = max(self._guess_s, len(wanted) / CHECKS_PER_S + 1.0)
            wanted = {}
        else:
            self._too_many = False
            self.index.speculative_s = self._guess_s
        with self._lock:
            if self._stop.is_set():
                return
            gone = [a for a in self._streams if a not in wanted]
            calls = [self._streams.pop(a) for a in gone]
            new = [m for a, m in wanted.items()
                   if a not in self._streams and a not in self._unsupported]
            for m in new:
                self._streams[m.address] = None
        for address in gone:
            self._forget(address)
        for call in calls:
            if call is not None:
                call.cancel()
        for m in new:
            threading.Thread(target=self._follow, args=(m,), name=f"cache-feed-{m.address}",
                             daemon=True).start()

    # ---- a large pool's, through Stats -------------------------------------------------------
    def cursor(self, address: str) -> tuple[int, int] | None:
        """What a Stats read of `address` asks for: the changes after (epoch, batch) the index
        holds, (0, 0) for a snapshot; None while the pool is followed by streams."""
        if not self._too_many:
            return None
        known = self.index.known(address)
        return (0, 0) if known is None else (known.epoch, known.sequence)

    def stats_request(self, address: str) -> common_pb2.StatsRequest:
        """The Stats request for `address`: asking for its cache events past the cursor."""
        cursor = self.cursor(address)
        if cursor is None:
            return common_pb2.StatsRequest()
        return common_pb2.StatsRequest(cache_events=True, cache_epoch=cursor[0],
                                       cache_sequence=cursor[1])

    def polled(self, address: str, batch: common_pb2.CacheEventBatch) -> None:
        """The cache events a Stats read of `address` brought."""
        if not self._too_many or self._stop.is_set():
            return
        with self._lock:
            self._polled.add(address)
        if not self._apply(address, batch, since=None if batch.snapshot else batch.since):
            log.info("cache events of %s: gap or new epoch; a snapshot at its next read",
                     address)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._streams.values())
            self._streams.clear()
        for call in calls:
            if call is not None:
                call.cancel()

    # ---- queries ----------------------------------------------------------------------
    def prompt_keys(self, address: str, prompt_ids: Sequence[int]) -> list[int]:
        """The page keys of the prompt's full pages before its last token, as `address`
        names them (empty when its layout is not known yet)."""
        layout = self._layout.get(address)
        return [] if layout is None else self._keys(layout, prompt_ids)

    def _keys(self, layout: tuple[int, int], prompt_ids: Sequence[int]) -> list[int]:
        recent = self._recent.__dict__
        if recent.get("prompt") is not prompt_ids:
            recent["prompt"], recent["keys"] = prompt_ids, {}
        keys: list[int] | None = recent["keys"].get(layout)
        if keys is None:
            root, block_size = layout
            keys = recent["keys"][layout] = page_keys(root, prompt_ids, block_size,
                                                      (len(prompt_ids) - 1) // block_size)
        return keys

    def cached_pages(self, addresses: Iterable[str], prompt_ids: Sequence[int]
                     ) -> dict[str, int]:
        """Leading pages of the prompt each worker holds, as far as the index knows; a
        worker left out holds none (only the holders of its first page are looked up)."""
        held = self.holders(prompt_ids)
        return {address: self.index.cached_pages(address, self.prompt_keys(address, prompt_ids))
                for address in addresses if address in held}

    def holders(self, prompt_ids: Sequence[int]) -> set[str]:
        """Workers holding at least the prompt's first page, as far as the index knows (for
        every cache layout the workers announced; usually there is one)."""
        found: set[str] = set()
        for layout in list(self._layouts):
            keys = self._keys(layout, prompt_ids)
            if keys:
                found |= self.index.holders(keys[0])
        return found

    def speculate(self, address: str, prompt_ids: Sequence[int]) -> None:
        """This router placed the prompt on `address` (and tells its peers, `on_placed`)."""
        layout = self._layout.get(address)
        if layout is None:  # not read yet: nothing it could match
            return
        keys = self._keys(layout, prompt_ids)
        self.index.speculate(address, keys)
        if keys and self.on_placed is not None:
            self.on_placed(address, layout, keys)

    def peer_placed(self, address: str, layout: tuple[int, int], keys: Sequence[int]) -> None:
        """Another router placed a prompt with these page keys on `address`: held there as
        if this router had (a worker it does not serve, or of another layout now, is left
        out; one whose layout it has not read yet takes the peer's)."""
        if address not in self._members or not keys:
            return
        known = self._layout.get(address)
        if known is None:
            self._set_layout(address, layout)
            with self._lock:
                self._polled.add(address)  # so that it is forgotten when it leaves
        elif known != layout:
            return
        self.index.speculate(address, keys)

    # ---- one worker's stream --------------------------------------------------------------
    def _follow(self, worker: Followed) -> None:
        address = worker.address
        while not self._stop.is_set():
            with self._lock:
                if address not in self._streams:
                    return  # it left
                call = worker.open_stream(common_pb2.CacheEventsRequest(
                    heartbeat_ms=self._heartbeat_ms))
                self._streams[address] = call
            try:
                for batch in call:
                    if not self._apply(address, batch):
                        log.info("cache events of %s: gap or new epoch; resubscribing", address)
                        call.cancel()
                        break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("%s serves no cache events: placed by load only", address)
                    with self._lock:
                        self._unsupported.add(address)
                        self._streams.pop(address, None)
                    self._forget(address)
                    return
                log.debug("cache events of %s ended: %s", address, exc.code().name)
            self.index.drop(address)
            if self._stop.wait(self._retry_s):
                return

    def _apply(self, address: str, batch: common_pb2.CacheEventBatch,
               since: int | None = None) -> bool:
        """Into the index (a snapshot also names the worker's layout); False: a gap."""
        if batch.snapshot:
            fp = wire.fingerprint_from_pb(batch.fingerprint)
            if fp is not None:
                self._set_layout(address, (root_key(fp), fp.block_size))
        return self.index.apply(address, batch.epoch, batch.sequence, batch.snapshot,
                                batch.stored, batch.removed, since=since)

    def _forget(self, address: str) -> None:
        self.index.drop(address)
        self._set_layout(address, None)

    def _set_layout(self, address: str, layout: tuple[int, int] | None) -> None:
        """Record (None: forget) a worker's cache layout, counting workers per layout."""
        with self._lock:
            old = self._layout.pop(address, None)
            if old is not None:
                self._layouts[old] -= 1
                if not self._layouts[old]:
                    del self._layouts[old]
            if layout is not None:
                self._layout[address] = layout
                self._layouts[layout] = self._layouts.get(layout, 0) + 1
