"""Running one workload against one target: warm-up requests first (not recorded: prompts of
the measured requests' lengths that none of them repeats, so a prefix cache holds none of the
measured prompts), then the measured ones, closed loop (N in flight) or open loop (sent at
their arrival times, at most `max_inflight` at once), bounded by count and by time, with a
progress line on stderr."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TextIO

from pdserve.bench.loadgen.arrivals import Arrivals
from pdserve.bench.loadgen.stats import RequestRecord
from pdserve.bench.loadgen.targets import Target
from pdserve.bench.loadgen.workload import Shape, Vocabulary

WARMUP_SEED = 7_777_777  # added to the plan's seed: the warm-up prompts' own draw


@dataclass(frozen=True)
class Plan:
    shapes: list[Shape]
    vocabulary: Vocabulary
    arrivals: Arrivals
    seed: int = 0
    warmup: int = 2
    max_duration_s: float = 600.0
    timeout_s: float = 300.0
    max_inflight: int = 256


class Progress:
    """`label: 37/200 done, 2 failed, 12.3 s` on one stderr line, at most 4 times a second."""

    def __init__(self, label: str, total: int, out: TextIO = sys.stderr):
        self._label, self._total, self._out = label, total, out
        self._done = self._failed = 0
        self._start = time.monotonic()
        self._shown = 0.0
        self._lock = threading.Lock()
        self._tty = out.isatty()

    def tick(self, ok: bool) -> None:
        with self._lock:
            self._done += 1
            self._failed += 0 if ok else 1
            now = time.monotonic()
            if now - self._shown >= (0.25 if self._tty else 5.0) or self._done == self._total:
                self._shown = now
                end = "\r" if self._tty and self._done < self._total else "\n"
                self._out.write(f"{self._label}: {self._done}/{self._total} done, "
                                f"{self._failed} failed, {now - self._start:.1f} s{end}")
                self._out.flush()


def warm_up(target: Target, plan: Plan) -> None:
    """Send `plan.warmup` unrecorded requests, one at a time, of the first shapes' lengths with
    prompts of their own: sending the first measured prompts put them in the server's prefix
    cache, and those requests then measured a cache hit (2 of 8 in plan --validate's
    calibration)."""
    rng = random.Random(plan.seed + WARMUP_SEED)
    for shape in plan.shapes[:plan.warmup]:
        prompt = plan.vocabulary.prompt(shape.prompt_tokens, rng)
        target.send(RequestRecord(-1, len(prompt)), prompt, shape.output_tokens, plan.timeout_s)


def run(target: Target, plan: Plan, label: str = "bench serve", progress: bool = True
        ) -> tuple[list[RequestRecord], float]:
    """The measured requests' records and the measured wall time (s); `progress`: a progress
    line on stderr."""
    rng = random.Random(plan.seed)
    prompts = [plan.vocabulary.prompt(s.prompt_tokens, rng) for s in plan.shapes]
    warm_up(target, plan)
    records = [RequestRecord(i, len(p), s.output_tokens)
               for i, (p, s) in enumerate(zip(prompts, plan.shapes))]
    shown = Progress(f"{label} {target.name}", len(records)) if progress else None
    deadline = time.monotonic() + plan.max_duration_s
    start = time.perf_counter()

    def one(i: int) -> None:
        r = records[i]
        if time.monotonic() >= deadline:
            skip(i)
            return
        r.sent_at_s = time.perf_counter() - start
        target.send(r, prompts[i], plan.shapes[i].output_tokens, plan.timeout_s)
        if shown is not None:
            shown.tick(r.ok)

    def skip(i: int) -> None:
        records[i].error = "not sent: --max-duration reached"
        if shown is not None:
            shown.tick(False)

    if plan.arrivals.concurrency is not None:
        closed_loop(one, len(records), plan.arrivals.concurrency)
    else:
        _open_loop(one, skip, plan.arrivals.gaps_s(len(records), plan.seed + 1),
                   plan.max_inflight, deadline)
    return records, time.perf_counter() - start


def closed_loop(one: Callable[[int], None], count: int, concurrency: int) -> None:
    """`one(i)` for i in range(count), `concurrency` at a time, each index once."""
    next_index = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            one(i)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _open_loop(one: Callable[[int], None], skip: Callable[[int], None], gaps_s: list[float],
               max_inflight: int, deadline: float) -> None:
    """Each request at its arrival time; those due after `deadline` are skipped, never sent
    early (sending them at once made a burst of the arrivals left when the time ran out)."""
    with ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="bench") as pool:
        due = time.perf_counter()
        for i, gap in enumerate(gaps_s):
            due += gap
            wait = due - time.perf_counter()
            if time.monotonic() + max(0.0, wait) >= deadline:
                for rest in range(i, len(gaps_s)):
                    skip(rest)
                return
            if wait > 0:
                time.sleep(wait)  # pacing the arrival process, not synchronisation
            pool.submit(one, i)
