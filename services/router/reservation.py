"""The router's handle on pages a decode worker reserved for one attempt of a request.

The reservation's state lives on the decode worker (its lease book); the router holds only
this handle: the ticket to quote to the prefill worker and to the decode stream, and a way to
give the pages back (Decode.Abort), at most once. From Reserve until the decode stream starts
the handle is also held by the lease heartbeat (renewal.py), when the worker took a renewable
lease. The attempt that reserved it (attempts.py) releases it when the attempt fails, stops
its renewal once the sequence owns the pages; the lifecycle settles or releases it when the
request ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from pdserve.common import tracing
from pdserve.router.calls import OnThreadCall
from pdserve.router.mux import DecodeStreams, SequenceStream
from pdserve.router.renewal import LeaseKeeper
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.router")


class ReservationHandle:
    """The router's handle on pages reserved for it on a decode worker: the ticket to quote
    and a way to give them back. `release` (Decode.Abort) runs at most once; `settle` marks
    the sequence finished by decode itself, so nothing is left to free."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str,
                 reply: decode_pb2.ReserveResponse, abort_timeout_s: float,
                 on_done: Callable[[], None] = lambda: None,
                 keeper: LeaseKeeper | None = None):
        self.stub = stub
        self.address = address
        self.ticket: common_pb2.Ticket = reply.ticket
        self.destination: common_pb2.KVDestination = reply.destination
        self.cached_tokens: int = reply.cached_tokens  # prompt tokens the decode side holds
        self.prefilling_here: bool = reply.prefilling_here  # decode started the prompt itself
        self.placement = ""  # why this worker (the placement's explanation)
        self.sent_at = 0.0  # the router's clock when the Reserve call went out
        self.not_held = False  # a renewal found the reservation gone from the worker
        self.streams: DecodeStreams | None = None  # the worker's shared decode stream
        self.decode_call: Any = None  # else a Decode call on its thread (calls.WorkerCalls)
        self._abort_timeout_s = abort_timeout_s
        self._on_done = on_done  # once: settled, or its Abort answered (the worker is free)
        self._lock = threading.Lock()
        self._done = False
        # Renewed while held, when the worker took a renewable lease (older ones do not).
        self._keeper = keeper if keeper is not None and reply.renew_lease_ms > 0 else None
        if self._keeper is not None:
            self._keeper.hold(self)

    def mark_not_held(self) -> None:
        self.not_held = True

    def stop_renewing(self) -> None:
        """The decode stream started (the worker adopted the pages) or the handle is done."""
        if self._keeper is not None:
            self._keeper.drop(self)

    @property
    def worker(self) -> str:
        """The decode worker's own name when it gave one, else its address."""
        return self.ticket.decode_worker or self.address

    def open_decode(self, request: decode_pb2.DecodeRequest, span: tracing.Span
                    ) -> SequenceStream | Any:
        """The sequence's Decode messages, traced under `span`: on the worker's shared stream
        (DecodeMany) where the router keeps one, else on a Decode call of its own."""
        metadata = tracing.outgoing_metadata(span)
        if self.streams is not None:
            return self.streams.open(request, tracing.traceparent(span), metadata)
        if self.decode_call is not None:
            return OnThreadCall(self.decode_call(request, metadata=metadata))
        return self.stub.Decode(request, metadata=metadata)

    def settle(self) -> None:
        self.stop_renewing()
        with self._lock:
            if self._done:
                return
            self._done = True
        self._on_done()

    def release(self, reason: str, *, wait: bool = True) -> None:
        """Abort the ticket on the decode worker (frees its pages). Errors are logged only."""
        self.stop_renewing()
        with self._lock:
            if self._done:
                return
            self._done = True
        future = self.stub.Abort.future(decode_pb2.AbortRequest(ticket=self.ticket, reason=reason),
                                        timeout=self._abort_timeout_s)
        if wait:
            _log_abort(self, future)
            self._on_done()
        else:
            future.add_done_callback(self._aborted)

    def _aborted(self, future: grpc.Future) -> None:
        _log_abort(self, future)
        self._on_done()

    def release_nowait(self) -> None:
        self.release("client cancelled", wait=False)


def _log_abort(reservation: ReservationHandle, future: grpc.Future) -> None:
    try:
        future.result()
    except grpc.RpcError as exc:
        log.warning("Abort of %s on decode %s failed: %s %s", reservation.ticket.request_id,
                    reservation.address, exc.code().name, exc.details())
