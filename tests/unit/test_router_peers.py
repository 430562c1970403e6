"""`router.peers`: a router's placements sent to its peers, over real gRPC: with the API key
the peers ask for, not to itself once it has found itself among them, and a peer that does
not answer missing only its batch."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from pdserve.common.security import ApiKeyInterceptor, ApiKeys
from pdserve.router.cache_feed import FOLLOW_MAX_WORKERS, CacheFeeds, Followed
from pdserve.router.cache_index import CacheIndex
from pdserve.router.peers import PeerPlacements, PeersServicer
from pdserve.router.targets import parse_target
from pdserve.v1 import router_pb2_grpc

from tests.fakes import FakeClock
from tests.support import free_port

MEMBERS = [f"w{i}:1" for i in range(FOLLOW_MAX_WORKERS + 1)]


def _feeds() -> CacheFeeds:
    feeds = CacheFeeds(CacheIndex(clock=FakeClock()))
    feeds.sync([Followed(a, lambda request: None) for a in MEMBERS])  # polled: no streams
    return feeds


@pytest.fixture
def keyfile(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the routers' key\nsecret-1\n")
    return str(path)


def _serve(servicer: PeersServicer, keyfile: str) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=[ApiKeyInterceptor(ApiKeys.from_file(keyfile))])
    router_pb2_grpc.add_RouterPeersServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_placements_reach_the_peers_with_the_key_and_not_the_router_itself(keyfile):
    mine, theirs = _feeds(), _feeds()
    dead = f"127.0.0.1:{free_port()}"  # nobody listens
    other = PeersServicer(theirs, "other-router")
    other_server, other_address = _serve(other, keyfile)
    sender = PeerPlacements([parse_target(a) for a in (other_address, dead)], mine,
                            api_key_file=keyfile)
    self_server, self_address = _serve(sender.servicer, keyfile)
    sender._targets += (parse_target(self_address),)  # it is among its own peers
    try:
        mine.peer_placed("w0:1", (5, 16), [1])  # (a layout for w0, as if read from it)
        mine.speculate("w0:1", list(range(40)))  # this router's placement: 2 pages
        sender.send()
        keys = mine.prompt_keys("w0:1", list(range(40)))
        assert theirs.index.cached_pages("w0:1", keys) == 2 and other.received == 1
        assert (sender.sent, sender.failed) == (2, 1)  # the other and itself; the dead one
        assert sender.servicer.received == 0  # its own batch, recognised
        mine.speculate("w0:1", list(range(50)))
        sender.send()
        assert (sender.sent, sender.failed) == (3, 2) and other.received == 2  # not itself
        sender.send()  # nothing placed since: nothing sent
        assert (sender.sent, sender.failed) == (3, 2)
    finally:
        sender.close()
        other_server.stop(0)
        self_server.stop(0)


def test_without_the_key_a_peer_refuses(keyfile, tmp_path):
    theirs = _feeds()
    other = PeersServicer(theirs, "other-router")
    server, address = _serve(other, keyfile)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-key\n")
    mine = _feeds()
    sender = PeerPlacements([parse_target(address)], mine, api_key_file=str(wrong))
    try:
        mine.peer_placed("w0:1", (5, 16), [1])
        mine.speculate("w0:1", list(range(40)))
        sender.send()
        assert (sender.sent, sender.failed, other.received) == (0, 1, 0)
    finally:
        sender.close()
        server.stop(0)
