"""One request's lifecycle, a blocking generator, run on a worker thread and read from asyncio.

    stream = EventStream(run, scope, loop)       # run: () -> Iterator[StreamEvent | Parked]
    stream.start(executor, context)              # a pool thread iterates run()
    while events := await stream.batch():        # every event that arrived since the last call
        ...
    stream.cancel()                              # client gone: CallScope.cancel() -> workers

Where the lifecycle parks (`Parked`: its next token has not come on the decode worker's
shared stream), the thread lets go and the stream resumes it: the shared stream's reader
thread relays each token itself, for every sequence on it, with no thread woken per token
(`inline`); anything else resumes it on a pool thread. One thread at a time iterates it.

Each event is appended to a list under a lock, and the event loop is woken only when the
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
from pdserve.router.started import Parked

log = logging.getLogger("pdserve.router")


class EventStream:
    """The events of one request, handed from its worker thread to the event loop."""

    def __init__(self, run: Callable[[], Iterator[StreamEvent | Parked]], scope: CallScope,
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
        self._executor: Executor | None = None
        self._context = contextvars.Context()
        self._source: Iterator[StreamEvent | Parked] = iter(())

    def start(self, executor: Executor, context: contextvars.Context) -> None:
        """Run the lifecycle on one of `executor`'s threads, in `context` (the caller's trace).
        Raises RuntimeError when the executor is shut down."""
        self._executor, self._context = executor, context
        self._source = self._run()
        executor.submit(self._drive)

    def _drive(self) -> None:
        """Iterate the lifecycle until it ends or parks (see `Parked`)."""
        while True:
            parked = self._context.run(self._advance)
            if parked is None or parked.park(self._resume):
                return

    def _resume(self, inline: bool) -> None:
        if inline:  # on the shared decode stream's reader: relay the token right here
            self._drive()
            return
        try:
            assert self._executor is not None  # started
            self._executor.submit(self._drive)
        except RuntimeError:  # shut down (the router is stopping): finish on a thread of its own
            threading.Thread(target=self._drive, name="router-http-finish", daemon=True).start()

    def _advance(self) -> Parked | None:
        error: BaseException | None = None
        try:
            for event in self._source:
                if isinstance(event, Parked):
                    return event
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
        return None

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
