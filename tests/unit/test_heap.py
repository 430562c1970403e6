"""The collector's pauses as /metrics reports them, the start-up heap frozen, and a measuring
client's run without collections."""

from __future__ import annotations

import gc
import threading

import pytest
from pdserve.common.heap import PAUSE_BUCKETS, freeze_startup_heap, gc_pauses, no_collection
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(gc_pauses())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_full_collection_is_counted_with_its_duration_under_generation_2():
    assert gc_pauses() is gc_pauses()  # one per process: gc.callbacks holds it once
    before = _samples()
    gc.collect()
    gc.collect()
    after = _samples()

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("pdserve_gc_pause_seconds_count", generation="2") == 2
    assert moved("pdserve_gc_pause_seconds_sum", generation="2") > 0
    for gen in "012":  # cumulative buckets ending at +Inf == the count
        counts = [after[("pdserve_gc_pause_seconds_bucket",
                         tuple(sorted({"generation": gen, "le": le}.items())))]
                  for le in [str(b) for b in PAUSE_BUCKETS] + ["+Inf"]]
        assert counts == sorted(counts)
        assert counts[-1] == after[("pdserve_gc_pause_seconds_count", (("generation", gen),))]


def test_freezing_the_start_up_heap_exempts_what_is_alive_and_says_how_much(caplog):
    alive = [[i] for i in range(5000)]  # tracked containers built "at start-up"
    try:
        with caplog.at_level("INFO", logger="pdserve.heap"):
            frozen = freeze_startup_heap("router")
        assert frozen >= len(alive) and gc.get_freeze_count() >= len(alive)
        walked = {id(x) for x in gc.get_objects()}  # every generation the collector walks
        assert not any(id(x) in walked for x in alive)
        # the gauge reads the count when scraped; frozen objects freed since (other threads
        # run in a test process) leave it, so it lies between the count frozen and the count now
        reported = _samples()[("pdserve_gc_frozen_objects", ())]
        assert len(alive) <= gc.get_freeze_count() <= reported <= frozen
        assert f"router: {frozen} start-up objects frozen" in caplog.text
    finally:
        gc.unfreeze()  # the rest of the test process collects as before


def test_no_collection_inside_and_the_collector_back_after_even_on_an_error():
    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_scrape_whose_own_allocations_start_collections_does_not_hang():
    # A collection can start inside any allocation, the scrape's own included; its callback
    # must not wait for anything the scrape holds (a lock there hung every /metrics).
    registry = CollectorRegistry()
    registry.register(gc_pauses())
    done = []

    def scrape() -> None:
        thresholds = gc.get_threshold()
        gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation
        try:
            for _ in range(50):
                generate_latest(registry)
        finally:
            gc.set_threshold(*thresholds)
        done.append(True)

    worker = threading.Thread(target=scrape, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done == [True]


def test_a_young_threshold_given_at_freeze_is_the_collectors_and_the_older_ones_stay():
    before = gc.get_threshold()
    try:
        freeze_startup_heap("test", young_threshold=20_000)
        assert gc.get_threshold() == (20_000, *before[1:])
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
