"""Python's cyclic garbage collector in a long-running service: its pauses kept short, and seen.

A full collection (generation 2) walks every object the collector tracks, holding the GIL,
so every request in flight in the process stalls until it ends. In the router in front of
1,000 workers at 100 req/s that was four full collections in 25 s of 40-170 ms each, most
finding no garbage at all: they walked what start-up built (the workers' channels and stubs,
the tokenizer, imported modules). `freeze_startup_heap()` moves everything alive once a
service has started out of the collector's sight (`gc.freeze`, as vLLM and SGLang do after
start-up); what it allocates later is still collected as before. Frozen, the router's full
collections took ~2 ms (docs/benchmarks.md).

`gc_pauses` reports how long each collection held the process, per generation, on every
/metrics endpoint (`pdserve_gc_pause_seconds`; `pdserve_gc_frozen_objects`): a latency spike
that lines up with a generation 2 pause is the collector, not the network.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("pdserve.heap")

PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


def freeze_startup_heap(service: str = "", young_threshold: int = 0) -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many objects are frozen. Call once start-up is done (model, tokenizer, pools built).

    `young_threshold` > 0: a young collection only after that many more allocations than
    deallocations of tracked objects (Python's default: 700; the older generations' stay).
    For a service whose requests make and drop many small objects (the router): with 700 it
    walks each request's live objects many times over while they are still in use."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    if young_threshold > 0:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
             service or "process", frozen, (time.perf_counter() - start) * 1e3)
    return frozen


class GcPauses(Collector):
    """A histogram of this process's collection pauses per generation, fed by `gc.callbacks`
    (one per process: `gc_pauses()`).

    No lock: a collection can start inside any allocation, `collect()`'s included, and its
    callback would then wait for a lock its own thread holds. The callback runs under the GIL;
    each generation's counts (and sum, last) are one list, copied whole when scraped."""

    def __init__(self) -> None:
        self._counts = {g: [0.0] * (len(PAUSE_BUCKETS) + 2) for g in GENERATIONS}
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        seconds, self._started = time.perf_counter() - self._started, None
        self.observe(int(info.get("generation", 0)), seconds)

    def observe(self, generation: int, seconds: float) -> None:
        counts = self._counts[generation]
        counts[next((i for i, edge in enumerate(PAUSE_BUCKETS) if seconds <= edge),
                    len(PAUSE_BUCKETS))] += 1
        counts[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "pdserve_gc_pause_seconds", "how long each garbage collection of this process "
            "held it (the GIL), by generation (2: a full collection)", labels=("generation",))
        for g in GENERATIONS:
            counts = list(self._counts[g])
            cumulative, buckets = 0.0, []
            for edge, count in zip((*PAUSE_BUCKETS, float("inf")), counts):
                cumulative += count
                buckets.append(("+Inf" if edge == float("inf") else str(edge), cumulative))
            family.add_metric((str(g),), buckets, counts[-1])
        yield family
        yield GaugeMetricFamily("pdserve_gc_frozen_objects", "objects exempt from garbage "
                                "collection (frozen once start-up was done)",
                                value=gc.get_freeze_count())


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No collection inside (after one before): for a client measuring a bounded run, whose
    own pauses would otherwise count as the latency of what it measures."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_pauses: GcPauses | None = None
_pauses_lock = threading.Lock()


def gc_pauses() -> GcPauses:
    """The process's one `GcPauses` (installed on first use)."""
    global _pauses
    with _pauses_lock:
        if _pauses is None:
            _pauses = GcPauses()
        return _pauses
