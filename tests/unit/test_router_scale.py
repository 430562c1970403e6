"""What keeps one router's cost flat in the pool size: the cache index answers who holds a
prompt's first page without asking every worker, placement in a large pool weighs a sample
plus those holders, and a large pool's health/Stats reads go in rolling slices."""

from __future__ import annotations

import random

import pytest
from pdserve.router.cache_index import CacheIndex
from pdserve.router.candidates import candidates
from pdserve.router.check_schedule import CHECKS_PER_S, TICK_S, plan_round, tick_s

from tests.fakes import FakeClock

pytestmark = pytest.mark.unit


def test_holders_follow_snapshots_changes_drops_and_guesses():
    clock = FakeClock()
    index = CacheIndex(speculative_s=2.0, clock=clock)
    index.apply("d0", 1, 0, True, [1, 2], [])
    index.apply("d1", 1, 0, True, [1], [])
    assert index.holders(1) == {"d0", "d1"} and index.holders(2) == {"d0"}
    index.apply("d0", 1, 1, False, stored=[3], removed=[1])
    assert index.holders(1) == {"d1"} and index.holders(3) == {"d0"}
    index.apply("d1", 1, 0, True, [9], [])  # a new snapshot replaces what d1 held
    assert index.holders(1) == set() and index.holders(9) == {"d1"}
    index.drop("d0")
    assert index.holders(2) == set() and index.holders(3) == set()
    index.speculate("d5", [7, 8])  # just placed there: held for speculative_s
    assert index.holders(7) == {"d5"}
    clock.now += 2.5
    assert index.holders(7) == set()


class _Pool:
    def __init__(self, n: int):
        self.members = [f"w{i}" for i in range(n)]

    def healthy(self, role: str) -> list[str]:
        return self.members


class _Cache:
    def __init__(self, held: set[str]):
        self.held = held

    def holders(self, prompt_ids) -> set[str]:
        return self.held


def test_a_small_pool_is_weighed_whole():
    assert candidates(_Pool(32), "decode", 32, _Cache({"w1"}), [1, 2]) is None
    assert candidates(_Pool(500), "decode", 0, None, [1]) is None  # sampling off


def test_a_large_pool_weighs_a_sample_plus_the_prompts_holders_and_uses_everyone():
    pool, rng = _Pool(1000), random.Random(3)
    picked = candidates(pool, "decode", 32, _Cache({"w999", "w998"}), [1], rng)
    assert picked is not None and len(picked) <= 34 and {"w999", "w998"} <= set(picked)
    many = candidates(pool, "decode", 32, _Cache({f"w{i}" for i in range(500)}), [1], rng)
    assert many is not None and len(many) <= 64  # a hot prefix adds at most k holders
    seen: set[str] = set()
    for _ in range(400):
        seen.update(candidates(pool, "decode", 32, None, [1], rng) or [])
    assert len(seen) == 1000  # every worker gets weighed in turn


def test_a_small_pool_is_read_whole_each_interval():
    turn = plan_round(list(range(100)), 0, interval_s=1.0)
    assert turn.workers is None
    assert tick_s(100, 1.0, all_healthy=True, recheck_down_s=0.5) == 1.0
    assert tick_s(100, 1.0, all_healthy=False, recheck_down_s=0.5) == 0.5


def test_a_large_pool_is_read_in_rolling_slices_plus_the_urgent_ones():
    members = list(range(1000))
    size = int(CHECKS_PER_S * TICK_S)
    turn = plan_round(members, 0, 1.0)
    assert turn.workers == list(range(size)) and turn.next_start == size
    read: list[int] = []
    start = 0
    for _ in range(-(-1000 // size)):  # ticks in one period
        turn = plan_round(members, start, 1.0)
        assert turn.workers is not None
        read += turn.workers
        start = turn.next_start
    assert sorted(set(read)) == members  # everyone once per period
    assert 1000 / CHECKS_PER_S == pytest.approx(len(read) / size * TICK_S, rel=0.1)
    start = 1000 - size + 2  # a slice that wraps around
    wrap = plan_round(members, start, 1.0, urgent=[members[0], members[999], members[500]])
    assert wrap.workers == [*range(start, 1000), *range(size - 1000 + start), 500]  # urgent once
    assert tick_s(1000, 1.0, all_healthy=True, recheck_down_s=0.5) == TICK_S


def test_a_suspected_worker_is_not_drawn_until_its_check_answers():
    from pdserve.router.pool import WorkerPool

    addresses = [f"127.0.0.1:{p}" for p in range(1, 301)]  # nothing listens there
    pool = WorkerPool(decode=addresses, timeout_s=1.0)
    try:
        for worker in pool._workers.values():
            worker.healthy = True
        assert len(pool.healthy("decode")) == 300
        pool.suspect(addresses[5])  # a call to it just failed UNAVAILABLE
        assert addresses[5] not in pool.healthy("decode")
        assert len(pool.healthy("decode")) == 299
        pool.check_now([pool._workers[("decode", addresses[5])]])  # its check: refused
        assert addresses[5] not in pool.healthy("decode")
        assert pool._suspects == set()  # answered: no longer suspected, now unhealthy
    finally:
        pool.close()


def test_the_cache_feeds_follow_after_a_change_and_else_once_an_interval():
    """A large pool's ticks come 20 times a second: following its 1,000 members each time
    cost more than reading them."""
    from pdserve.router.pool import WorkerPool

    addresses = [f"127.0.0.1:{p}" for p in range(1, 4)]  # nothing listens there
    followed: list[list[object]] = []
    pool = WorkerPool(decode=addresses, timeout_s=1.0, interval_s=600.0,
                      on_checked=followed.append)
    try:
        pool.check_now()  # the first round: followed
        pool.check_now()  # nothing changed, the interval has not passed: not again
        assert len(followed) == 1
        pool.suspect(addresses[0])  # a change: followed after the next round
        pool.check_now()
        assert len(followed) == 2
        pool._followed_at -= 600.0  # an interval later
        pool.check_now()
        assert len(followed) == 3
    finally:
        pool.close()


def test_the_context_served_is_kept_between_changes_and_found_again_after_one():
    from pdserve.router.pool import WorkerPool
    from pdserve.v1 import common_pb2

    addresses = [f"127.0.0.1:{p}" for p in range(1, 201)]  # nothing listens there
    pool = WorkerPool(decode=addresses, timeout_s=1.0)
    try:
        assert pool.max_model_len() is None  # nobody has reported it yet
        workers = [pool._workers[("decode", a)] for a in addresses]
        for i, worker in enumerate(workers):
            worker.healthy = True
            worker.stats = common_pb2.WorkerStats(max_model_len=4096 - i)
        pool._changed()  # (set behind the pool's back above)
        assert pool.max_model_len() == 4096 - 199
        workers[-1].stats = common_pb2.WorkerStats(max_model_len=10)
        assert pool.max_model_len() == 4096 - 199  # kept: no change the pool saw
        pool.check_now([workers[-1]])  # its check: refused, so it no longer counts
        assert pool.max_model_len() == 4096 - 198
    finally:
        pool.close()


class _EndedStream:
    def __iter__(self):
        return iter(())

    def cancel(self) -> None:
        pass


def test_past_the_limit_cache_events_come_with_stats_not_streams():
    """Past FOLLOW_MAX_WORKERS no stream is opened: Stats reads ask for the changes after the
    index's cursor (a snapshot first), a worker that left is forgotten, and the router's own
    placements count as held for a read period (not 2 s) until a read says so."""
    import threading

    from pdserve.router.cache_feed import FOLLOW_MAX_WORKERS, CacheFeeds, Followed
    from pdserve.router.cache_index import CacheIndex
    from pdserve.v1 import common_pb2

    from tests.fakes import FakeClock

    opened: set[str] = set()
    both = threading.Event()

    def opener(address):
        def open_stream(request):
            opened.add(address)
            if len(opened) == 2:
                both.set()
            return _EndedStream()  # the feed waits retry_s before asking again
        return open_stream

    clock = FakeClock()
    feeds = CacheFeeds(CacheIndex(clock=clock), retry_s=60)
    try:
        n = 2 * FOLLOW_MAX_WORKERS  # read 100 a second: each every n / 100 s
        many = [Followed(f"w{i}", opener(f"w{i}")) for i in range(n)]
        feeds.sync(many)
        assert feeds._streams == {} and feeds._too_many and opened == set()
        assert feeds.cursor("w3") == (0, 0)  # a snapshot first
        feeds.polled("w3", common_pb2.CacheEventBatch(epoch=9, sequence=4, snapshot=True,
                                                      stored=[11, 12], block_size=16))
        assert feeds.cursor("w3") == (9, 4) and feeds.index.holders(11) == {"w3"}
        feeds.polled("w3", common_pb2.CacheEventBatch(epoch=9, sequence=7, since=4,
                                                      stored=[13], removed=[11]))
        assert feeds.cursor("w3") == (9, 7) and feeds.index.sizes() == {"w3": 2}
        feeds.polled("w3", common_pb2.CacheEventBatch(epoch=9, sequence=9, since=5))  # a gap
        assert feeds.cursor("w3") == (0, 0) and feeds.index.sizes() == {}
        feeds.polled("w5", common_pb2.CacheEventBatch(epoch=2, sequence=1, snapshot=True,
                                                      stored=[21]))
        feeds.index.speculate("w6", [31])
        clock.now += n / 100  # within a read period (and a second): still held
        assert feeds.index.holders(31) == {"w6"}
        clock.now += 1.5
        assert feeds.index.holders(31) == set()
        feeds.sync(many[6:])  # w5 left: its entries go
        assert feeds.index.holders(21) == set()
        feeds.sync(many[:2])  # the pool shrank: followed by streams again, guesses for 2 s
        assert both.wait(10) and opened == {"w0", "w1"} and not feeds._too_many
        assert feeds.cursor("w0") is None and feeds.index.speculative_s == 2.0
    finally:
        feeds.close()
