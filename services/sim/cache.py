"""A simulated worker's prefix cache: the page keys of the prompts it computed (prefill) or
holds (decode), announced on CacheEvents the way real workers announce theirs.

Keys are pdserve.common.prefix's chained page keys over the prompt's full pages before its
last token, seeded by one fingerprint every simulated worker shares, so the router's cache
index and cache-aware placement run against a simulated pool as against a real one. The
newest `num_pages` pages are kept (the oldest evicted first). A stream starts with a snapshot,
then sends each change as its own batch, and an empty batch when nothing changed for the
requested heartbeat. Read through Stats instead (`poll`), the changes come from one numbered
log, merged, as a real worker's (pdserve.worker.cache_feed) give them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

import grpc
from pdserve.common import wire
from pdserve.common.cache_log import ChangeLog
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.prefix import page_keys, root_key
from pdserve.sim.profile import SimProfile
from pdserve.v1 import common_pb2

DEFAULT_HEARTBEAT_MS = 1000.0


def fingerprint(profile: SimProfile) -> LayoutFingerprint:
    """The layout every simulated worker of this profile announces (bench-7m's shape)."""
    return LayoutFingerprint(model_id="pdserve-sim", model_revision="1", dtype="float32",
                             num_layers=4, num_kv_heads=2, head_dim=32,
                             block_size=profile.block_size)


class SimCache:
    def __init__(self, name: str, profile: SimProfile):
        self.name = name
        self._fingerprint = fingerprint(profile)
        self._root = root_key(self._fingerprint)
        self._block = profile.block_size
        self._capacity = profile.num_pages
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._epoch = time.time_ns()
        self._streams: set[asyncio.Queue[tuple[list[int], list[int]]]] = set()
        self._log = ChangeLog()  # what routers reading Stats get

    def _prompt_keys(self, prompt: Sequence[int]) -> list[int]:
        return page_keys(self._root, prompt, self._block, (len(prompt) - 1) // self._block)

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """Prompt tokens its leading pages held here cover."""
        held = 0
        for key in self._prompt_keys(prompt):
            if key not in self._keys:
                break
            held += 1
        return held * self._block

    def add(self, prompt: Sequence[int]) -> None:
        """The prompt's pages are now held here (the newest); announce what changed."""
        stored = []
        for key in self._prompt_keys(prompt):
            if key not in self._keys:
                stored.append(key)
            self._keys[key] = None
            self._keys.move_to_end(key)
        removed = []
        while len(self._keys) > self._capacity:
            removed.append(self._keys.popitem(last=False)[0])
        if stored or removed:
            for stream in self._streams:
                stream.put_nowait((stored, removed))
            self._log.append(stored, removed)

    def poll(self, request: common_pb2.StatsRequest) -> common_pb2.CacheEventBatch:
        """What Stats brings a router asking for cache events: the changes after its
        cursor merged, or a snapshot (cursor 0, another epoch, or older than the log)."""
        since = request.cache_sequence if request.cache_epoch == self._epoch else 0
        if not self._log.reaches(since):
            return common_pb2.CacheEventBatch(
                worker_id=self.name, epoch=self._epoch, sequence=self._log.snapshot(),
                snapshot=True, stored=list(self._keys), block_size=self._block,
                fingerprint=wire.fingerprint_to_pb(self._fingerprint))
        stored, removed = self._log.merged(since)
        return common_pb2.CacheEventBatch(worker_id=self.name, epoch=self._epoch,
                                          sequence=self._log.sequence, stored=stored,
                                          removed=removed, block_size=self._block, since=since)

    async def events(self, request: common_pb2.CacheEventsRequest,
                     context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[common_pb2.CacheEventBatch]:
        changes: asyncio.Queue[tuple[list[int], list[int]]] = asyncio.Queue()
        self._streams.add(changes)
        heartbeat_s = (request.heartbeat_ms or DEFAULT_HEARTBEAT_MS) / 1e3
        try:
            yield common_pb2.CacheEventBatch(
                worker_id=self.name, epoch=self._epoch, sequence=0, snapshot=True,
                stored=list(self._keys), block_size=self._block,
                fingerprint=wire.fingerprint_to_pb(self._fingerprint))
            sequence = 0
            while True:
                try:
                    stored, removed = await asyncio.wait_for(changes.get(), heartbeat_s)
                except asyncio.TimeoutError:
                    stored, removed = [], []
                sequence += 1
                yield common_pb2.CacheEventBatch(worker_id=self.name, epoch=self._epoch,
                                                 sequence=sequence, stored=stored,
                                                 removed=removed, block_size=self._block)
        finally:
            self._streams.discard(changes)
