"""One request's lifecycle, a blocking generator, run on a worker thread and read from asyncio.

    stream = EventStream(run, scope, loop)       # run: () -> Iterator[StreamEvent]
    stream.start(executor, context)              # the thread iterates run() to its end
    while events := await stream.batch():        # every event that arrived since the last call
        ...
    stream.cancel()                              # client gone: CallScope.cancel() -> workers

The thread appends each event to a list under a lock and wakes the event loop only when the
reader is waiting, so a reader that falls behind takes many events per wake-up (one
`call_soon_threadsafe` per batch, not per token). The lifecycle's error, if any, is raised by
`batch()` once every event before it was read.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from pdserve.router.api import Finish, StreamEvent
from pdserve.router.cancel import CallScope

log = logging.getLogger("pdserve.router")


class EventStream:
    """The events of one request, handed from its worker thread to the event loop."""

    def __init__(self, run: Callable[[], Iterator[StreamEvent]], scope: CallScope,
                 loop: asyncio.AbstractEventLoop):
        self._run = run
        self._scope = scope
        self._loop = loop
        self._lock = threading.Lock()
        self._events: list[StreamEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: BaseException | None = None
        self.finished = False  # a Finish event was produced: the request succeeded

    def start(self, executor: Executor, context: contextvars.Context) -> None:
        """Run the lifecycle on one of `executor`'s threads, in `context` (the caller's trace).
        Raises RuntimeError when the executor is shut down."""
        executor.submit(context.run, self._produce)

    def _produce(self) -> None:
        error: BaseException | None = None
        try:
            for event in self._run():
                if isinstance(event, Finish):
                    self.finished = True
                self._push(event)
        except BaseException as exc:  # handed to the reader, which maps it to a response
            error = exc
        with self._lock:
            self._ended, self._error = True, error
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    def _push(self, event: StreamEvent) -> None:
        with self._lock:
            self._events.append(event)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    async def batch(self) -> list[StreamEvent]:
        """The events produced since the last call, waiting for one if there is none; [] at
        the end of the stream. Raises the lifecycle's error after its last event."""
        while True:
            with self._lock:
                if self._events:
                    events, self._events = self._events, []
                    return events
                if self._ended:
                    error, self._error = self._error, None
                    if error is not None:
                        raise error
                    return []
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def cancel(self) -> None:
        """The client went away: cancel the request's work, unless it already finished.
        Idempotent; never blocks."""
        if not self.finished:
            self._scope.cancel()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
