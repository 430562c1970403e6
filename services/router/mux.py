"""The router's decode streams: every sequence a router runs on one decode worker shares one
DecodeMany stream, whose messages carry an engine step's tokens for all of them.

    streams = DecodeStreams(stub, address)      # one per decode worker, connects when used
    seq = streams.open(request, traceparent, metadata)
    first = next(seq)                           # DecodeResponse, as a Decode call's
    for message in seq: ...                     # ends after the finish; errors as RpcError
    seq.cancel()                                # like call.cancel(): aborts it on the worker

A `SequenceStream` reads like the Decode call it replaces (iterator, `cancel()`, errors
raised as `grpc.RpcError` with `code()` and `details()`), so the lifecycle does not know
which it has. One reader thread per worker hands each update to its sequence: to a thread
blocked in `next`, or, where the reader parked instead (`park`, the HTTP front door's), by
running the relay of that token on the reader thread itself (`inline`), so a step's 32
tokens wake no thread per token (router CPU per token 0.144 -> 0.10 ms, scenario A; the
last update of a sequence resumes it on a pool thread: its end releases and logs); a gRPC
client's sequence handed to the native relay (`relay_natively`, router/native_relay.py) has
each update sent on to its client from the reader thread, in C++. The stream
failing ends every sequence on it with the stream's status, and the next `open` starts a
new stream. A worker without DecodeMany (UNIMPLEMENTED) gets a Decode call per sequence
from then on, those caught waiting included. A stream no sequence has used for IDLE_CLOSE_S is
closed by the pool's check round (`close_idle`); the next `open` starts a new one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pdserve.common.native_calls import StatusError
from pdserve.router import native_relay
from pdserve.router.native_relay import Outcome, Relay
from pdserve.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.router")

Metadata = tuple[tuple[str, str], ...] | None
_DELEGATED = object()  # queued where the messages go on on the sequence's own Decode call
# A stream with no sequence for this long is closed (`close_idle`, from the pool's check round):
# an open one holds three threads here (grpc's request feeder and channel poller, our reader)
# and one on the worker, which at hundreds of decode workers per router took the router's core.
IDLE_CLOSE_S = 2.0


class SequenceFailed(StatusError):
    """A sequence's status on a shared stream: what its own Decode call would have raised."""


def _status(name: str) -> grpc.StatusCode:
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)


class SequenceStream:
    """One sequence's messages on a shared stream (or on its own call, see `delegate`)."""

    def __init__(self, streams: DecodeStreams, request: decode_pb2.DecodeRequest,
                 metadata: Metadata):
        self.request = request
        self.metadata = metadata  # for a Decode call of its own (delegate)
        self._streams = streams
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._resume: Callable[[bool], None] | None = None  # a parked reader (see `park`)
        self._call: Any = None  # a Decode call of its own, once delegated and reached
        self._delegated: Any = None  # that call, as soon as it is made
        self._over = False
        self._held: Any = None  # an item `take_ready` took out but left for `next`
        self._native: _NativeSink | None = None  # see `relay_natively`

    def put(self, item: decode_pb2.SequenceUpdate | BaseException | object, *,
            inline: bool = False) -> None:
        """Deliver `item`; a parked reader is resumed (`inline`: on this thread)."""
        with self._lock:
            sink = self._native
            if sink is not None and sink.outcome is None:
                sink.take(item)  # relayed here, in order behind what relay_natively took
                return
            self._items.put(item)
            resume, self._resume = self._resume, None
        if resume is not None:
            resume(inline)

    def relay_natively(self, relay: Relay, server_call: int) -> Outcome | None:
        """The rest of the sequence relayed by `relay` to the client's call `server_call`:
        each update sent on from the reader's thread as it arrives (no thread woken for it);
        returns once the sequence ended. None, with nothing taken, where it cannot be (a
        Decode call of its own, or the end already here)."""
        with self._lock:
            if self._over or self._call is not None or self._delegated is not None \
                    or self._held is not None:
                return None
            sink = self._native = _NativeSink(relay, server_call)
            while sink.outcome is None:
                try:
                    sink.take(self._items.get_nowait())
                except queue.Empty:
                    break
        sink.done.wait()
        assert sink.outcome is not None
        return sink.outcome

    def delegate(self, call: Any) -> None:
        """From now on the messages come from `call`, a Decode call of the sequence's own."""
        self._delegated = call
        self.put(_DELEGATED)

    def ready(self) -> bool:
        """`next` would not wait on the shared stream (an item is there, or it ended)."""
        return self._over or self._call is not None or self._held is not None \
            or not self._items.empty()

    def take_ready(self) -> decode_pb2.DecodeResponse | None:
        """The next message if it has arrived on the shared stream, without waiting; None
        when nothing has, or what came is for `next` to raise or end with (left there)."""
        if self._over or self._call is not None or self._held is not None:
            return None
        try:
            item = self._items.get_nowait()
        except queue.Empty:
            return None
        if item is _DELEGATED or isinstance(item, BaseException) or (
                item.last and (item.error_code or not item.HasField("message"))):
            self._held = item
            return None
        self._over = item.last
        return item.message  # type: ignore[no-any-return]

    def park(self, resume: Callable[[bool], None]) -> bool:
        """Instead of blocking in `next`: have `resume(inline)` called once an item arrives
        (inline: on the delivering thread, which may go on reading there). False, with
        nothing asked, when `next` would not wait."""
        with self._lock:
            if self.ready():
                return False
            self._resume = resume
            return True

    def __iter__(self) -> Iterator[decode_pb2.DecodeResponse]:
        return self

    def __next__(self) -> decode_pb2.DecodeResponse:
        if self._call is not None:
            return next(self._call)  # type: ignore[no-any-return]
        if self._over:
            raise StopIteration
        item, self._held = self._held, None
        if item is None:
            item = self._items.get()
        if item is _DELEGATED:
            self._call = self._delegated
            return next(self._call)  # type: ignore[no-any-return]
        if isinstance(item, BaseException):
            self._over = True
            raise item
        if item.last:
            self._over = True
            if item.error_code:
                raise SequenceFailed(_status(item.error_code), item.error_message)
            if not item.HasField("message"):
                raise StopIteration
        return item.message  # type: ignore[no-any-return]

    def cancel(self) -> None:
        """Stop the sequence (a no-op once it ended): the worker aborts it; a reader waiting
        here gets CANCELLED."""
        call = self._call or self._delegated
        if call is not None:
            call.cancel()
            return
        if self._streams.cancel(self):
            self.put(SequenceFailed(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))


class _NativeSink:
    """A sequence's updates into its native relay (native_relay.py), until an outcome."""

    def __init__(self, relay: Relay, server_call: int):
        self.relay, self.server_call = relay, server_call
        self.outcome: Outcome | None = None
        self.done = threading.Event()

    def take(self, item: decode_pb2.SequenceUpdate | BaseException | object) -> None:
        relay = self.relay
        if isinstance(item, decode_pb2.SequenceUpdate):
            if item.last and item.error_code:
                self._end(relay.outcome(native_relay.FAILED, _status(item.error_code).value[0],
                                        item.error_message))
                return
            code = native_relay.NO_FINISH
            if item.HasField("message"):
                message = item.message
                code = relay.feed(self.server_call, message.token_ids, message.finish_reason)
            if code >= 0 or item.last:
                self._end(relay.outcome(native_relay.NO_FINISH if code < 0 else code))
        elif isinstance(item, grpc.RpcError):
            self._end(relay.outcome(native_relay.FAILED, item.code().value[0], item.details()))
        else:  # the stream was handed to a Decode call of its own: not after a first message
            self._end(relay.outcome(native_relay.FAILED, grpc.StatusCode.UNAVAILABLE.value[0],
                                    "the shared decode stream moved to a Decode call"))

    def _end(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.done.set()


class DecodeStreams:
    """The shared DecodeMany stream to one decode worker (thread-safe)."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str):
        self._stub = stub
        self._address = address
        self._lock = threading.Lock()
        self._live: dict[str, SequenceStream] = {}
        self._requests: queue.SimpleQueue[decode_pb2.DecodeManyRequest | None] | None = None
        self._call: Any = None
        self._unsupported = False  # the worker has no DecodeMany: a call per sequence
        self._idle_since: float | None = None  # the stream is open and carries no sequence

    def open(self, request: decode_pb2.DecodeRequest, traceparent: str,
             metadata: Metadata) -> SequenceStream | Any:
        """Start the sequence of `request` on the shared stream; its message stream."""
        seq = SequenceStream(self, request, metadata)
        with self._lock:
            if not self._unsupported:
                if self._requests is None:
                    self._connect()
                assert self._requests is not None
                self._live[request.ticket.request_id] = seq
                self._idle_since = None
                self._requests.put(decode_pb2.DecodeManyRequest(start=request,
                                                                traceparent=traceparent))
                return seq
        return self._stub.Decode(request, metadata=metadata)

    def cancel(self, seq: SequenceStream) -> bool:
        """Forget `seq` and ask the worker to abort it; False when it had already ended."""
        rid = seq.request.ticket.request_id
        with self._lock:
            if self._live.get(rid) is not seq:
                return False
            del self._live[rid]
            if self._requests is not None:
                self._requests.put(decode_pb2.DecodeManyRequest(cancel=seq.request.ticket))
                self._note_idle()
        return True

    def close_idle(self, idle_s: float = IDLE_CLOSE_S) -> bool:
        """End the stream if no sequence has been on it for `idle_s`: its request side is
        closed, so the worker ends it; the next `open` starts a new one. True if it did."""
        with self._lock:
            if (self._requests is None or self._live or self._idle_since is None
                    or time.monotonic() - self._idle_since < idle_s):
                return False
            requests, self._requests, self._call = self._requests, None, None
            self._idle_since = None
        requests.put(None)
        return True

    def _note_idle(self) -> None:  # lock held
        if not self._live:
            self._idle_since = time.monotonic()

    def close(self) -> None:
        """End the stream (the router is stopping): the worker aborts what is left on it."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _connect(self) -> None:  # lock held
        requests: queue.SimpleQueue[decode_pb2.DecodeManyRequest | None] = queue.SimpleQueue()
        call = self._stub.DecodeMany(iter(requests.get, None))
        self._requests, self._call = requests, call
        threading.Thread(target=self._read, args=(call, requests), daemon=True,
                         name=f"router-decode-many-{self._address}"[:40]).start()

    def _read(self, call: Any, requests: queue.SimpleQueue[Any]) -> None:
        """Hand each update to its sequence until the stream ends; then end those left."""
        error = SequenceFailed(grpc.StatusCode.UNAVAILABLE,
                               f"decode {self._address} ended the shared decode stream")
        try:
            for response in call:
                for update in response.updates:
                    rid = update.request_id
                    with self._lock:
                        seq = self._live.pop(rid, None) if update.last else self._live.get(rid)
                        if update.last and self._requests is requests:
                            self._note_idle()
                    if seq is not None:  # a sequence's tokens are relayed on this thread;
                        seq.put(update, inline=not update.last)  # its end on the pool's
        except grpc.RpcError as exc:
            error = SequenceFailed(exc.code(), exc.details() or "")
        with self._lock:
            if self._requests is not requests:  # closed while idle (`close_idle`): the
                requests.put(None)              # sequences now in `_live` are a new stream's
                log.debug("decode %s: idle shared decode stream closed", self._address)
                return
            self._requests, self._call = None, None
            orphans, self._live = list(self._live.values()), {}
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unsupported = True
        requests.put(None)  # ends the request side
        if self._unsupported:
            log.info("decode %s has no DecodeMany: one Decode call per sequence", self._address)
            for seq in orphans:
                seq.delegate(self._stub.Decode(seq.request, metadata=seq.metadata))
            return
        log.info("decode %s: shared decode stream ended (%s); %d sequences on it fail",
                 self._address, error.code().name, len(orphans))
        for seq in orphans:
            seq.put(error)
