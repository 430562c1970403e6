"""One thread owns an Engine and steps it; other threads submit work and read outputs.

Workers (prefill, decode, co-located) call `submit(fn)` to run `fn(engine)` on the engine
under its lock (admission, abort, reservations) and read each sequence's outputs from the
queue they got from `start_sequence`. The loop sleeps only when there is nothing it can run.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from pdserve.engine.engine import Engine
from pdserve.engine.sequence import StepOutput

T = TypeVar("T")
# One sequence's results, in order: its step outputs, or the exception that ended it.
Outputs = queue.SimpleQueue[StepOutput | BaseException]
log = logging.getLogger("pdserve.engine.loop")


class EngineFailure(RuntimeError):
    """The engine raised inside a step; every sequence of that step ends with it."""


class SequenceAborted(RuntimeError):
    """Put on a sequence's queue when it was aborted, so whoever waits on it wakes up."""


class EngineLoop:
    def __init__(self, engine: Engine, *, tick_s: float = 0.05):
        self.engine = engine
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, Outputs] = {}
        # Threads waiting for the engine lock. A lock is not fair: the loop, releasing it after
        # a step and taking it again at once, would keep admissions and aborts out for many
        # steps while it has work (measured: co-located serving at 32 streams queued new
        # prompts ~850 ms p50). So the loop lets them in between steps.
        self._callers = 0
        self._callers_lock = threading.Lock()
        self._stopping = False
        # after each step that left work: the seconds until the next (tokens handed over,
        # callers let in), for metrics
        self.on_held: Callable[[float], None] | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @contextmanager
    def _engine(self) -> Iterator[None]:
        """The engine lock, for threads other than the loop (which lets them in first)."""
        with self._callers_lock:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._callers_lock:
                self._callers -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _let_callers_in(self, bound_s: float = 0.05) -> None:
        deadline = time.monotonic() + bound_s
        while self._callers and time.monotonic() < deadline:
            time.sleep(0)  # gives up the GIL; the caller takes the lock released after the step

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._engine():
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def submit(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` under the engine lock (between steps) and wake the loop."""
        with self._engine():
            result = fn(self.engine)
            self._wake.notify()
            return result

    def start_sequence(self, seq_id: str, fn: Callable[[Engine], T]
                       ) -> tuple[T, Outputs]:
        """Run `fn(engine)` (which adds `seq_id`) and subscribe to its outputs, atomically.

        Raises ValueError, touching nothing, when `seq_id` is already live here: a duplicate
        request id must never take over another request's outputs or pages.
        """
        with self._engine():
            if seq_id in self._queues:
                raise ValueError(f"sequence {seq_id!r} already exists")
            result = fn(self.engine)
            q: Outputs = queue.SimpleQueue()
            self._queues[seq_id] = q
            self._wake.notify()
            return result, q

    def abort(self, seq_id: str, reason: str = "aborted") -> bool:
        """Abort a sequence and wake its reader with `SequenceAborted`; False if unknown."""
        with self._engine():
            found = self.engine.abort(seq_id)
            q = self._queues.get(seq_id)
            if q is not None:
                q.put(SequenceAborted(f"{seq_id}: {reason}"))
            return found

    def publish(self, seq_id: str, item: StepOutput) -> None:
        """Put `item` on a sequence's queue from inside a step (an engine hook, on the loop's
        thread, which holds the lock), ahead of the step's outputs."""
        q = self._queues.get(seq_id)
        if q is not None:
            q.put(item)

    def unsubscribe(self, seq_id: str) -> None:
        with self._lock:
            self._queues.pop(seq_id, None)

    def _run(self) -> None:
        held = 0.0  # when the last step ended, if it left work
        while True:
            with self._wake:
                if self._stopping:
                    return
                if not self.engine.has_work():
                    self._wake.wait(self._tick_s)
                    held = 0.0
                    continue
                if held and self.on_held is not None:
                    self.on_held(time.perf_counter() - held)
                try:
                    results: list[tuple[str, StepOutput | BaseException]] = [
                        (out.seq_id, out) for out in self.engine.step()]
                except Exception as exc:  # a failed step must not leave callers waiting forever
                    log.exception("engine step failed")
                    results = list(self._fail_all(exc))
                if self.engine.stalled:
                    # Work is waiting for pages held elsewhere (a handoff, a reservation):
                    # sleep until something changes instead of spinning.
                    self._wake.wait(self._tick_s)
                targets = [(self._queues.get(seq_id), item) for seq_id, item in results]
                held = time.perf_counter() if self.on_held and not self.engine.stalled \
                    and self.engine.has_work() else 0.0
            for q, item in targets:
                if q is not None:
                    q.put(item)
            self._let_callers_in()

    def _fail_all(self, exc: Exception) -> list[tuple[str, BaseException]]:
        failed = [*self.engine.waiting, *self.engine.running]
        for seq in failed:
            self.engine.abort(seq.seq_id)
        return [(seq.seq_id, EngineFailure(f"engine step failed: {exc}")) for seq in failed]
