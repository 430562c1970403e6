"""Domain errors of the kvtransfer agent.

Each class is one kind of failure; the servicer turns the families into gRPC status codes
(`BadRequest` -> INVALID_ARGUMENT, `NotFound` -> NOT_FOUND, `Refused` -> FAILED_PRECONDITION,
`TransferTimeout` -> DEADLINE_EXCEEDED, `PeerUnavailable` -> UNAVAILABLE). A receiving agent
sends the class name and message back to the sender over the data path, so the sender raises
the same class (`from_wire`) and the prefill worker sees the receiver's reason.
"""

from __future__ import annotations


class KvTransferError(Exception):
    """Base of every agent error; `message` names what is wrong."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(KvTransferError):
    """The request itself is malformed (bad page ids, sizes, missing fields)."""


class LayoutMismatch(BadRequest):
    """Source and destination pools differ in layout; the message names the fields."""


class NotFound(KvTransferError):
    """An unknown pool or ticket."""


class UnknownPool(NotFound):
    pass


class UnknownTicket(NotFound):
    pass


class Refused(KvTransferError):
    """The request is well formed but the state forbids it (FAILED_PRECONDITION)."""


class TicketExpired(Refused):
    pass


class TicketCancelled(Refused):
    pass


class TicketBusy(Refused):
    """A write for the ticket is already in flight or has already landed."""


class StaleEpoch(Refused):
    """The destination agent restarted since the pages were reserved."""


class TransportMismatch(Refused):
    pass


class Unauthorized(Refused):
    """Mutual TLS is on and the write (or grant) is not one this agent granted to its peer."""


class TransferTimeout(KvTransferError):
    """A bounded wait on the data path ran out."""


class PeerUnavailable(KvTransferError):
    """The peer agent cannot be reached. `retryable` is true when nothing was accepted by the
    receiver yet, so the same handoff may be tried again on a fresh connection."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class SegmentUnavailable(KvTransferError):
    """The same-host path cannot be used for this peer (its socket is unreachable or belongs
    to another agent, or the sender's pool cannot be mapped there): fall back to the network."""


def _kinds() -> dict[str, type[KvTransferError]]:
    found: dict[str, type[KvTransferError]] = {}
    todo: list[type[KvTransferError]] = [KvTransferError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def from_wire(kind: str, message: str) -> KvTransferError:
    """The error a peer reported as (`kind`, `message`); unknown kinds become the base class."""
    cls = _kinds().get(kind, KvTransferError)
    return PeerUnavailable(message) if cls is PeerUnavailable else cls(message)


_CAUSES: tuple[tuple[type[KvTransferError], str], ...] = (  # subclasses before their bases
    (StaleEpoch, "stale_epoch"), (TicketExpired, "expired"), (TicketCancelled, "cancelled"),
    (TicketBusy, "busy"), (Unauthorized, "unauthorized"),
    (TransportMismatch, "transport_mismatch"), (Refused, "refused"),
    (LayoutMismatch, "layout_mismatch"), (BadRequest, "bad_request"),
    (UnknownPool, "unknown_pool"), (UnknownTicket, "unknown_ticket"), (NotFound, "not_found"),
    (TransferTimeout, "timeout"), (PeerUnavailable, "unreachable"),
    (SegmentUnavailable, "segment_unavailable"),
)


def cause(exc: BaseException) -> str:
    """A failure's short name for metrics labels (`stale_epoch`, `timeout`, `unreachable`,
    ...); `internal` for anything that is not a KvTransferError subclass listed here."""
    for kind, name in _CAUSES:
        if isinstance(exc, kind):
            return name
    return "internal"


_STATUS: tuple[tuple[type[KvTransferError], str], ...] = (
    (BadRequest, "INVALID_ARGUMENT"), (Unauthorized, "PERMISSION_DENIED"),
    (NotFound, "NOT_FOUND"), (Refused, "FAILED_PRECONDITION"),
    (TransferTimeout, "DEADLINE_EXCEEDED"), (PeerUnavailable, "UNAVAILABLE"),
)


def status_name(exc: KvTransferError) -> str:
    """The gRPC status code name an error maps to (INVALID_ARGUMENT, ...; INTERNAL otherwise)."""
    for kind, name in _STATUS:
        if isinstance(exc, kind):
            return name
    return "INTERNAL"
