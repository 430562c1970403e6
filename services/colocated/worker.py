"""The co-located worker: one engine doing both phases, behind the Prefill and Decode APIs.

It exists for comparison with the disaggregated path: the router drives it exactly as it
drives a prefill/decode pair (reserve, prefill, decode stream), but the prompt's KV is written
straight into the reserved pages and the sequence goes on decoding in the same batch, so the
handoff is `local` and moves no bytes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from pdserve.common.errors import Aborted, FailedPrecondition, InvalidArgument, Unavailable
from pdserve.common.metrics import count_outcome
from pdserve.decode.worker import DecodeEvent, DecodeWorker
from pdserve.engine.loop import SequenceAborted
from pdserve.engine.sampling import SamplingParams
from pdserve.prefill.worker import PREFILL_WAIT_S, PrefillResult
from pdserve.v1 import common_pb2


class ColocatedWorker(DecodeWorker):
    role = "colocated"

    def __init__(self, loop, *, worker_id: str, default_lease_ms: float = 30_000.0):
        super().__init__(loop, None, worker_id=worker_id, agent_address="local",
                         default_lease_ms=default_lease_ms)
        self.pool_id = "local"
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._streams_lock = threading.Lock()

    def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                ticket: common_pb2.Ticket, destination: common_pb2.KVDestination,
                cancelled: threading.Event | None = None) -> PrefillResult:
        with count_outcome(self.metrics.prefills):
            return self._prefill(request_id, token_ids, params, ticket)

    def _prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 ticket: common_pb2.Ticket) -> PrefillResult:
        received = time.perf_counter()
        self._take_reservation(ticket)
        key = (request_id, self.epoch)
        try:
            _, q = self.loop.start_sequence(request_id, lambda e: e.add_request(
                request_id, token_ids, params, reservation=key))
        except ValueError as exc:
            self.loop.submit(lambda e: e.release(key))
            raise InvalidArgument(str(exc)) from None
        try:
            out = q.get(timeout=PREFILL_WAIT_S)
        except queue.Empty:
            out = Unavailable(f"prefill of {request_id} did not finish in {PREFILL_WAIT_S:.0f}s")
        if isinstance(out, BaseException):
            self._forget(request_id)
            if isinstance(out, SequenceAborted):
                raise Aborted(f"prefill of {request_id} was cancelled")
            raise Unavailable(str(out))
        if out.finish_reason:
            self.loop.unsubscribe(request_id)
        else:
            with self._streams_lock:
                self._streams[request_id] = q
        queue_ms = max(0.0, (time.perf_counter() - received) * 1e3 - out.prefill_ms)
        report = common_pb2.TransferReport(transport="local")
        return PrefillResult(out.token, out.finish_reason, queue_ms, out.prefill_ms, report)

    def decode(self, ticket: common_pb2.Ticket, prompt_ids: list[int], first_token: int,
               params: SamplingParams) -> Iterator[DecodeEvent]:
        rid = ticket.request_id
        with self._streams_lock:
            q = self._streams.pop(rid, None)
        if q is None:
            raise FailedPrecondition(f"no prefilled sequence {rid} on {self.worker_id}")
        try:
            yield DecodeEvent([], "", 0.0)
            yield from self._stream(q, rid)
        finally:
            self.loop.unsubscribe(rid)
            self._abort_sequence(rid)

    def cancel(self, request_id: str) -> None:
        self._forget(request_id)

    def abort(self, ticket: common_pb2.Ticket) -> bool:
        if self._drop_reservation(ticket.request_id):
            return True
        return self._forget(ticket.request_id)

    def _forget(self, rid: str) -> bool:
        found = self._abort_sequence(rid)  # wakes a prefill still waiting on it
        with self._streams_lock:
            self._streams.pop(rid, None)
        self.loop.unsubscribe(rid)
        return found

    def stats(self) -> dict:
        return {**super().stats(), "role": "colocated"}
