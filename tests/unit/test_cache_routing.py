"""Cache-aware routing, its parts alone: the router's cache index (snapshots, changes, gaps,
epochs, speculative entries), the placement cost and its explanation, and a worker's cache
feed over a real engine loop."""

from __future__ import annotations

import itertools

import pytest
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.model import load_model
from pdserve.engine.sampling import SamplingParams
from pdserve.router.cache_index import CacheIndex
from pdserve.router.placement import DecodeLoad, PrefillLoad, Weights, place_decode, place_prefill
from pdserve.worker.cache_feed import CacheFeed

from tests.fakes import FakeClock

pytestmark = pytest.mark.unit


# ---- the index ----------------------------------------------------------------------------
def test_snapshot_then_changes_then_a_gap_drops_the_worker():
    index = CacheIndex()
    assert index.apply("d0", epoch=1, sequence=0, snapshot=True, stored=[1, 2, 3], removed=[])
    assert index.cached_pages("d0", [1, 2, 3, 4]) == 3
    assert index.apply("d0", 1, 1, False, stored=[4], removed=[2])
    assert index.cached_pages("d0", [1, 2, 3, 4]) == 1  # the chain breaks at the lost page
    assert index.cached_pages("d0", [1, 3, 4]) == 3
    assert not index.apply("d0", 1, 3, False, stored=[5], removed=[])  # 2 was missed
    assert index.cached_pages("d0", [1]) == 0 and index.known("d0") is None


def test_a_new_epoch_needs_its_snapshot_and_replaces_everything():
    index = CacheIndex()
    index.apply("d0", 1, 0, True, [1, 2], [])
    assert not index.apply("d0", 2, 1, False, [3], [])  # restarted: changes without snapshot
    assert index.cached_pages("d0", [1, 2]) == 0
    index.apply("d0", 2, 0, True, [7], [])
    assert index.cached_pages("d0", [1]) == 0 and index.cached_pages("d0", [7]) == 1
    assert index.known("d0").epoch == 2


def test_speculative_entries_last_a_short_while():
    clock = FakeClock()
    index = CacheIndex(speculative_s=2.0, clock=clock)
    index.speculate("d1", [5, 6])
    assert index.match(["d0", "d1"], [5, 6, 7]) == {"d0": 0, "d1": 2}
    clock.now = 2.5
    assert index.cached_pages("d1", [5, 6]) == 0


def test_dropping_a_worker_forgets_it():
    index = CacheIndex()
    index.apply("d0", 1, 0, True, [1], [])
    index.drop("d0")
    assert index.cached_pages("d0", [1]) == 0 and index.workers() == []


def test_the_change_log_merges_what_follows_a_cursor_it_still_reaches():
    from pdserve.common.cache_log import ChangeLog

    log = ChangeLog(max_batches=3)
    first = log.snapshot()
    assert first == 1 and not log.reaches(0) and log.reaches(first)
    log.append([10, 11], [])
    log.append([12], [10])
    log.append([10], [12])  # back again; 12 gone
    assert log.merged(first) == ([11, 10], [12])
    assert log.merged(3) == ([10], [12]) and log.merged(log.sequence) == ([], [])
    log.append([13], [])  # 4 batches: the first change batch (number 2) is dropped
    assert not log.reaches(first) and log.reaches(2) and not log.reaches(log.sequence + 1)
    log.clear()
    assert not log.reaches(log.sequence - 1) and log.snapshot() == 7


def test_holders_follow_every_worker_a_key_gains_and_loses():
    """One holder per key is stored as the worker itself, more as a set: either way holders()
    names exactly the workers whose last events (or snapshots) hold the key."""
    index = CacheIndex()
    index.apply("d0", 1, 0, True, [1, 2], [])
    index.apply("d1", 1, 0, True, [2, 3], [])
    index.apply("d2", 1, 0, True, [2], [])
    assert [index.holders(k) for k in (1, 2, 3, 4)] == [{"d0"}, {"d0", "d1", "d2"}, {"d1"}, set()]
    index.apply("d1", 1, 1, False, stored=[1], removed=[2, 3])
    assert [index.holders(k) for k in (1, 2, 3)] == [{"d0", "d1"}, {"d0", "d2"}, set()]
    index.drop("d2")
    index.apply("d0", 1, 1, False, stored=[2], removed=[])  # again: still once
    assert index.holders(2) == {"d0"}
    index.apply("d0", 1, 2, True, [9], [])  # a new snapshot replaces what d0 held
    assert [index.holders(k) for k in (1, 2, 9)] == [{"d1"}, set(), {"d0"}]
    index.drop("d1")
    assert index.holders(1) == set() and index.sizes() == {"d0": 1}


def test_past_its_cap_the_index_levels_the_largest_workers_by_least_recent_use():
    """max_pages bounds the router's memory: over it, the workers holding the most lose their
    least recently stored or placed pages until 5% below the cap (5,000 at most); the index stays
    consistent (holders, sizes) and a prompt placed on a worker keeps its pages."""
    index = CacheIndex(max_pages=100)
    index.apply("d0", 1, 0, True, list(range(0, 60)), [])
    index.apply("d1", 1, 0, True, list(range(100, 130)), [])
    index.speculate("d0", [0, 1, 2, 3])  # placed here: now d0's most recent pages
    assert index.total() == 90 and index.evicted == 0
    index.apply("d1", 1, 1, False, stored=list(range(130, 150)), removed=[])  # 110 > 100
    # down to 95: d0 (60) and d1 (50) levelled to 47 each, 16 pages gone
    assert index.sizes() == {"d0": 47, "d1": 47} and index.total() == 94
    assert index.evicted == 16
    assert index.cached_pages("d0", [0, 1, 2, 3]) == 4  # touched by the placement: kept
    assert index.holders(16) == set() and index.holders(17) == {"d0"}  # d0's 13 oldest gone
    assert index.holders(102) == set() and index.holders(103) == {"d1"}  # d1's 3 oldest
    index.apply("d1", 1, 2, False, stored=[], removed=[149])  # removing an evicted key is fine
    index.apply("d1", 1, 3, False, stored=[100], removed=[])  # stored again: most recent
    assert index.holders(100) == {"d1"} and index.total() == sum(index.sizes().values()) == 94
    index.drop("d0")
    assert index.total() == index.sizes()["d1"]
    with pytest.raises(ValueError, match="max_pages=0"):
        CacheIndex(max_pages=0)


def test_the_routers_index_cap_is_a_flag_with_a_clear_refusal(capsys):
    from pdserve.common.config import parse_config
    from pdserve.router.config import RouterConfig

    need = ["--prefill", "p:1", "--decode", "d:1"]
    assert parse_config(RouterConfig, "router", need).cache_index_max_pages == 4_000_000
    cfg = parse_config(RouterConfig, "router", need,
                       env={"PDSERVE_ROUTER_CACHE_INDEX_MAX_PAGES": "5000"})
    assert cfg.cache_index_max_pages == 5000
    with pytest.raises(SystemExit) as exit_info:
        parse_config(RouterConfig, "router", [*need, "--cache-index-max-pages", "0"])
    assert exit_info.value.code == 2 and "cache_index_max_pages" in capsys.readouterr().err


def test_another_routers_placements_count_as_held_for_the_workers_this_one_serves(capsys):
    """`--peers`: what a peer placed is held in this router's index as its own placements are
    (a large pool: no streams opened here), for its members only, in the layout it knows."""
    from pdserve.common.config import parse_config
    from pdserve.router.cache_feed import FOLLOW_MAX_WORKERS, CacheFeeds, Followed
    from pdserve.router.config import RouterConfig

    feeds = CacheFeeds(CacheIndex(clock=FakeClock()))
    members = [f"w{i}:1" for i in range(FOLLOW_MAX_WORKERS + 1)]
    feeds.sync([Followed(a, lambda request: None) for a in members])  # polled: no streams
    told: list[tuple[str, tuple[int, int], list[int]]] = []
    feeds.on_placed = lambda *placed: told.append(placed)
    feeds.peer_placed("w0:1", (77, 16), [1, 2, 3])
    assert feeds.index.cached_pages("w0:1", [1, 2, 3, 4]) == 3
    assert feeds.prompt_keys("w0:1", list(range(40))) != []  # its layout, from the peer
    feeds.peer_placed("w0:1", (78, 16), [5])   # another layout than the one known: left out
    feeds.peer_placed("gone:1", (77, 16), [5])  # not one of this router's workers
    assert feeds.index.cached_pages("w0:1", [5]) == 0
    assert feeds.index.cached_pages("gone:1", [5]) == 0 and told == []  # not passed on
    feeds.speculate("w1:1", list(range(40)))  # its layout unknown: nothing to tell
    feeds.peer_placed("w1:1", (77, 16), [9])
    feeds.speculate("w1:1", list(range(40)))  # now this router's own placement: told
    assert [(w, layout, len(keys)) for w, layout, keys in told] == [("w1:1", (77, 16), 2)]

    need = ["--prefill", "p:1", "--decode", "d:1"]
    assert parse_config(RouterConfig, "router", [*need, "--peers", "dns:///routers:50051,r:1"]
                        ).peers == ("dns:///routers:50051", "r:1")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(RouterConfig, "router", [*need, "--peers", "http://r:1"])
    assert exit_info.value.code == 2 and "peers='http://r:1'" in capsys.readouterr().err


# ---- placement ----------------------------------------------------------------------------
def _decode(address: str, sequences: int = 0, free: int | None = 1000) -> DecodeLoad:
    return DecodeLoad(address, True, free_pages=free, running_sequences=sequences)


def test_a_busy_worker_holding_a_long_prefix_wins_over_an_idle_one():
    workers = [_decode("idle"), _decode("holder", sequences=3)]
    placed = place_decode(workers, 640, {"holder": 36})  # 576 of 640 tokens held
    assert placed.ranked == ["holder", "idle"] and placed.decided_by == "locality"
    assert "holder cached=576 load=3" in placed.explain()


def test_load_decides_when_the_prefix_is_short():
    workers = [_decode("idle"), _decode("holder", sequences=3)]
    placed = place_decode(workers, 100, {"holder": 2})
    assert placed.ranked == ["idle", "holder"] and placed.decided_by == "load"


def test_a_hot_prefix_cannot_pile_everything_onto_one_worker():
    """Over the busy line (1.5 x the least loaded + 4) the holder is passed over."""
    workers = [_decode("a", sequences=2), _decode("holder", sequences=8)]
    placed = place_decode(workers, 2000, {"holder": 120}, Weights())
    assert placed.ranked == ["a", "holder"] and placed.decided_by == "room"
    assert placed.candidates[1].note == "busy"
    loose = Weights(max_imbalance=10.0)
    assert place_decode(workers, 2000, {"holder": 120}, loose).ranked[0] == "holder"


def test_room_is_counted_for_the_pages_a_worker_lacks():
    workers = [_decode("holder", free=3), _decode("empty", free=1000)]
    # 20 pages of prompt, 18 held: the holder needs 2 free pages, and has 3.
    assert place_decode(workers, 320, {"holder": 18}).ranked[0] == "holder"
    assert place_decode(workers, 320, {"holder": 10}).candidates[0].address == "empty"


def test_a_retry_goes_elsewhere_and_prefill_weighs_its_queue():
    workers = [_decode("a"), _decode("b")]
    assert place_decode(workers, 100, {"a": 6}, avoid={"a"}).ranked == ["b", "a"]
    prefills = [PrefillLoad("p0", True, queued_prompt_tokens=900), PrefillLoad("p1", True)]
    # p0 holds 800 of 1000 tokens but has 900 queued: 200 + 900 > 1000 on the idle p1.
    assert place_prefill(prefills, 1000, {"p0": 50}).ranked == ["p1", "p0"]
    assert place_prefill(prefills, 1000, {"p0": 62}).ranked == ["p0", "p1"]  # 8 + 900
    busy_free = [PrefillLoad("p0", True, queued_prompt_tokens=10), PrefillLoad("p1", True)]
    assert place_prefill(busy_free, 1000, {"p0": 60}).ranked[0] == "p0"


# ---- a worker's feed --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


def _runner(loop: EngineLoop):
    """run(prompt): one greedy sequence of 2 tokens through the loop, to its end."""
    ids = itertools.count()

    def run(prompt: list[int]) -> None:
        rid = f"r{next(ids)}"
        _, outputs = loop.start_sequence(rid, lambda e: e.add_request(
            rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        for _ in range(100):
            if outputs.get(timeout=10).finish_reason:
                break
        loop.unsubscribe(rid)

    return run


def test_the_feed_starts_with_a_snapshot_then_sends_changes_in_order(tiny):
    engine = Engine(tiny, EngineConfig(num_pages=8, chunk_size=64))
    loop = EngineLoop(engine).start()
    feed = CacheFeed(loop, period_s=0.005)
    run = _runner(loop)

    try:
        run(list(range(10, 43)))  # 33 tokens: 2 full pages cached before anyone subscribes
        stream = feed.stream(heartbeat_s=5.0)
        first = next(stream)
        assert first.snapshot and first.sequence == 0 and len(first.stored) == 2
        run(list(range(100, 133)))  # 2 new pages stored
        change = next(stream)
        assert change.sequence == 1 and len(change.stored) == 2 and not change.removed
        run(list(range(200, 290)))  # 90 tokens need 6 pages: evicts cached ones
        seen, removed = 2, []
        while seen < 5:
            batch = next(stream)
            assert batch.sequence == seen
            removed += batch.removed
            seen += 1 if batch.stored or batch.removed else 0
            if removed:
                break
        assert set(removed) <= set(first.stored) | set(change.stored) and removed
        assert feed.num_subscribers == 1
        stream.close()
        assert feed.num_subscribers == 0
    finally:
        feed.close()
        loop.stop()
        engine.close()


def test_a_router_reading_stats_gets_the_changes_since_its_cursor(tiny):
    """The log routers of a large pool read through Stats: a snapshot first (numbered), then
    the changes after the cursor merged (a page stored and then evicted only removed), a
    snapshot again for a cursor older than the log keeps; the index applies each in turn."""
    from pdserve.worker import cache_feed

    engine = Engine(tiny, EngineConfig(num_pages=8, chunk_size=64))
    loop = EngineLoop(engine).start()
    feed = CacheFeed(loop, period_s=0.005, log_batches=2)
    index = CacheIndex()
    run = _runner(loop)

    def delivered(since: int) -> cache_feed.CacheBatch:  # the engine's events in the log
        loop.submit(feed._deliver)
        return feed.poll(since)

    def apply(batch: cache_feed.CacheBatch) -> bool:
        return index.apply("w", 7, batch.sequence, batch.snapshot, batch.stored, batch.removed,
                           since=None if batch.snapshot else batch.since)

    try:
        run(list(range(10, 43)))  # 2 full pages, before anyone reads
        first = feed.poll(0)
        assert first.snapshot and first.sequence >= 1 and len(first.stored) == 2
        assert apply(first) and index.sizes() == {"w": 2}
        quiet = delivered(first.sequence)
        assert (quiet.snapshot, quiet.since, quiet.stored, quiet.removed) == \
            (False, first.sequence, [], [])
        run(list(range(100, 133)))  # 2 pages more
        more = delivered(first.sequence)
        assert not more.snapshot and more.since == first.sequence and len(more.stored) == 2
        assert apply(more) and index.sizes() == {"w": 4}
        run(list(range(200, 290)))  # 6 pages: evicts cached ones
        evicted = delivered(more.sequence)
        assert set(evicted.removed) <= set(first.stored) | set(more.stored) and evicted.removed
        assert not set(evicted.stored) & set(evicted.removed)
        assert apply(evicted)
        assert index.sizes()["w"] == 4 + len(evicted.stored) - len(evicted.removed)
        assert not apply(more)  # replayed: not what follows the index's cursor
        # Two more change batches, and the log (2 batches here) no longer reaches back.
        run(list(range(300, 333)))
        loop.submit(feed._deliver)
        run(list(range(400, 433)))
        again = delivered(first.sequence)
        assert again.snapshot and again.sequence > evicted.sequence
    finally:
        feed.close()
        loop.stop()
        engine.close()


def test_a_burst_sees_the_requests_this_router_already_placed():
    """Stats lag a burst: what this router has in flight on a worker counts as its load."""
    stale = [DecodeLoad("d0", True, free_pages=100, inflight=3),
             DecodeLoad("d1", True, free_pages=100, inflight=0)]
    assert place_decode(stale, 100).ranked == ["d1", "d0"]
    assert DecodeLoad("d", True, running_sequences=5, inflight=2).sequences == 5
