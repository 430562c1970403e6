"""Router replicas tell each other where they placed prompts (`--peers`).

A router's prefix-cache index learns a worker's pages from the worker's own cache events: at
once in a pool of up to 128 workers (a stream each), with its Stats reads in a larger one, up
to `workers / 100` seconds apart (10 s with 1,000). A router counts its own placements as held
meanwhile; another replica did not know them, so a conversation's next turn reaching it within
those seconds was placed away from its cached history, and a prefix sent to several replicas
at once was computed on several workers.

With `--peers` (the replicas, e.g. `dns:///pdserve-router-peers:50051`, a headless Service),
each router sends what it placed (the worker, its cache layout, the prompt's page keys) to every
peer each SEND_INTERVAL_S in one Placed call, and counts what the others placed as held, as it
does its own. A router that finds itself among its peers (a name listing every replica) knows
it by the id in the answer and skips that address from then on. A peer that does not answer
misses that batch: the workers' own events still come.

    peers = PeerPlacements(cfg.targets("peers"), feeds, security=...)
    router_pb2_grpc.add_RouterPeersServicer_to_server(peers.servicer, server)
    peers.start() ... peers.close()
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import grpc
from pdserve.common.security import AUTH_HEADER, ChannelSecurity, first_api_key, open_channel
from pdserve.router.cache_feed import CacheFeeds
from pdserve.router.calls import ON_THREAD, on_thread, reply
from pdserve.router.targets import Lookups, Resolver, Target, system_resolver
from pdserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("pdserve.router.peers")

SEND_INTERVAL_S = 0.1   # how often placements go out (batched)
RESOLVE_S = 10.0        # how often dns:/// peer targets are looked up again
CALL_TIMEOUT_S = 1.0
MAX_PENDING = 20_000    # placements kept for the next send; past it the oldest go


class PeerPlacements:
    """This router's side: collects its placements (`placed`) and sends them to its peers."""

    def __init__(self, targets: Sequence[Target], feeds: CacheFeeds, *,
                 security: ChannelSecurity | None = None, api_key_file: str = "",
                 resolve: Resolver = system_resolver, interval_s: float = SEND_INTERVAL_S):
        self.router_id = uuid.uuid4().hex
        self.sent = self.failed = 0  # batches, per peer
        self._targets = tuple(targets)
        self._security = security
        self._api_key_file = api_key_file  # the peers ask for a key as the public API does
        self._lookups = Lookups(resolve)  # a failing name keeps its last answer
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: list[router_pb2.PlacedPages] = []
        self._calls: dict[str, tuple[grpc.Channel, grpc.UnaryStreamMultiCallable]] = {}
        self._itself: set[str] = set()
        self._addresses: list[str] = []
        self._resolved_at = -RESOLVE_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-peers", daemon=True)
        self.servicer = PeersServicer(feeds, self.router_id)  # the other routers' placements
        feeds.on_placed = self.placed

    def counts(self) -> tuple[int, int, int]:
        """Batches sent and failed (per peer), placements received from other routers."""
        return self.sent, self.failed, self.servicer.received

    def placed(self, worker: str, layout: tuple[int, int], keys: list[int]) -> None:
        pages = router_pb2.PlacedPages(worker=worker, root_key=layout[0], block_size=layout[1],
                                       page_keys=keys)
        with self._lock:
            self._pending.append(pages)
            if len(self._pending) > MAX_PENDING:
                del self._pending[:len(self._pending) - MAX_PENDING]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=CALL_TIMEOUT_S + 1)
        for channel, _ in self._calls.values():
            channel.close()
        self._calls.clear()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.send()
            except Exception:  # a sender that stops would leave the peers blind: never
                log.exception("sending placements to the router's peers failed")

    def send(self) -> None:
        """One round: what was placed since the last, to every peer at once."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        batch = router_pb2.PlacedBatch(router_id=self.router_id, placed=pending)
        metadata = self._metadata()
        calls = [(address, method(batch, timeout=CALL_TIMEOUT_S, metadata=metadata))
                 for address, method in self._peers()]
        for address, call in calls:  # in flight together, read in turn
            try:
                ack = reply(call)
            except grpc.RpcError as exc:
                self.failed += 1
                log.debug("peer %s missed %d placements: %s %s", address, len(pending),
                          exc.code().name, exc.details())
                continue
            self.sent += 1
            if ack.router_id == self.router_id:
                log.info("peer %s is this router: not sent to from now on", address)
                self._itself.add(address)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        if not self._api_key_file:
            return None
        try:  # read each time: the file may have been rotated since
            return ((AUTH_HEADER, f"Bearer {first_api_key(self._api_key_file)}"),)
        except (OSError, ValueError) as exc:
            log.warning("placements sent to the peers without an API key: %s", exc)
            return None

    def _peers(self) -> list[tuple[str, grpc.UnaryStreamMultiCallable]]:
        now = time.monotonic()
        if now - self._resolved_at >= RESOLVE_S:
            self._resolved_at = now
            self._addresses = self._lookup()
            for gone in set(self._calls) - set(self._addresses):
                self._calls.pop(gone)[0].close()
        found = []
        for address in self._addresses:
            if address in self._itself:
                continue
            if address not in self._calls:
                channel = open_channel(address, self._security, ON_THREAD)
                self._calls[address] = (channel, on_thread(
                    channel, "/pdserve.v1.RouterPeers/Placed", router_pb2.PlacedBatch,
                    router_pb2.PlacedAck))
            found.append((address, self._calls[address][1]))
        return found

    def _lookup(self) -> list[str]:
        addresses: list[str] = []
        for target in self._targets:
            addresses += (self._lookups.lookup(target, "peer", "routers") if target.dns
                          else [target.address])
        return list(dict.fromkeys(addresses))


class PeersServicer(router_pb2_grpc.RouterPeersServicer):
    """The other side: another router's placements into this router's index."""

    def __init__(self, feeds: CacheFeeds, router_id: str):
        self._feeds = feeds
        self._router_id = router_id
        self.received = 0  # placements, from other routers

    def Placed(self, request: router_pb2.PlacedBatch, context: grpc.ServicerContext
               ) -> router_pb2.PlacedAck:
        if request.router_id != self._router_id:
            for p in request.placed:
                self._feeds.peer_placed(p.worker, (p.root_key, p.block_size), p.page_keys)
            self.received += len(request.placed)
        return router_pb2.PlacedAck(router_id=self._router_id)
