"""One unary call to a worker on a request's path, and how its failure is sorted: a retry
elsewhere (`Retry`), the client's own answer (`ResourceExhausted`, `ServiceError`), or the
client gone (`ClientCancelled`); every error names the peer and the phase."""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from pdserve.common import tracing
from pdserve.common.errors import ResourceExhausted, ServiceError
from pdserve.router.cancel import CallScope, ClientCancelled

RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})
# Decode failing before its first message: the worker died, or the handoff's lease or data
# did not hold. Nothing was streamed, so another attempt is still allowed.
DECODE_START_RETRYABLE = RETRYABLE | {"FAILED_PRECONDITION"}


class Suspects(Protocol):
    def suspect(self, address: str) -> None: ...


class Retry(Exception):
    """One attempt failed in a way another attempt may not."""

    def __init__(self, message: str, prefill: str | None = None, decode: str | None = None,
                 code: str = "UNAVAILABLE"):
        super().__init__(message)
        self.prefill = prefill
        self.decode = decode
        self.code = code  # the status the attempt's span records

    @property
    def refused(self) -> bool:
        """The peer could not be reached at all (nothing was sent: its address is dead)."""
        return self.code == "UNAVAILABLE" and any(
            text in str(self) for text in ("failed to connect", "Connection refused"))


def unary_call(pool: Suspects, scope: CallScope, span_name: str,
               method: grpc.UnaryUnaryMultiCallable, request: Any, timeout_s: float, peer: str,
               phase: str, address: str, *, prefill: str | None = None,
               decode: str | None = None, placement: str = "") -> Any:
    """One unary call that client cancellation interrupts; errors sorted by what to do and
    named by the `peer` and the `phase` they happened in.

    Traced as a client span (router.reserve, router.prefill) whose context the call
    carries, so the worker's span is its child."""
    with tracing.span(span_name, kind=tracing.CLIENT, worker=address,
                      request_id=getattr(request, "request_id", ""), placement=placement):
        scope.check()
        future = method.future(request, timeout=timeout_s,
                               metadata=tracing.outgoing_metadata())
        with scope.guard(future.cancel):
            try:
                return future.result()
            except grpc.FutureCancelledError:
                raise ClientCancelled() from None
            except grpc.RpcError as exc:
                if scope.cancelled:
                    raise ClientCancelled() from None
                code, details = exc.code().name, exc.details()
        where = f"{peer} ({phase})"
        if code == "DEADLINE_EXCEEDED" and details == "Deadline Exceeded":
            details = f"no answer within {timeout_s:g} s"
        if code == "UNAVAILABLE":
            pool.suspect(address)  # re-check its health now, not at the next round
        if code == "RESOURCE_EXHAUSTED":
            raise ResourceExhausted(f"{where}: {details}")
        if code in RETRYABLE:
            raise Retry(f"{where}: {code} {details}", prefill=prefill, decode=decode,
                         code=code)
        raise ServiceError(f"{where}: {details}", code)
