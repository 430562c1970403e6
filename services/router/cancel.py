"""Cancellation of one client call, reaching whatever the router is doing for it.

The servicer hands `CallScope.cancel` to `context.add_callback`, which gRPC runs when the
client's call ends for any reason (cancelled, deadline, or finished). While work for the call
is in flight (a Prefill call, a Decode stream, a held reservation) it is registered with
`guard(hook)`; `cancel()` runs every registered hook once. Hooks run on a gRPC thread, so they
must not block: cancel a call, start an Abort with `.future()`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

log = logging.getLogger("pdserve.router")


class ClientCancelled(Exception):
    """The client went away; stop the request's work and send nothing more."""

    code = grpc.StatusCode.CANCELLED  # what a trace span records


class CallScope:
    """The cancellation state of one client call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Run every registered hook (once); later `guard`s run their hook at once."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            _run(hook)

    def check(self) -> None:
        """Raise `ClientCancelled` if the call was cancelled."""
        if self._cancelled:
            raise ClientCancelled()

    @contextmanager
    def guard(self, hook: Callable[[], None]) -> Iterator[None]:
        """Run `hook` if the call is cancelled while inside (or already was)."""
        with self._lock:
            key = next(self._ids)
            if not self._cancelled:
                self._hooks[key] = hook
                hook = None  # type: ignore[assignment]
        if hook is not None:
            _run(hook)
        try:
            yield
        finally:
            with self._lock:
                self._hooks.pop(key, None)


def _run(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:
        log.exception("cancellation hook failed")
