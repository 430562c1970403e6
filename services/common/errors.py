"""Domain errors shared by every pdserve service: a failure with a status name.

Workers, the router's lifecycle and the agents raise these; each front door maps them in one
place: the gRPC server bootstrap turns `code` into `grpc.StatusCode[code]`, an HTTP front door
into an HTTP status. Nothing here imports grpc, so the engine-facing code can raise them too.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A failure with a status: raise a subclass (or pass `code`, a gRPC status name)."""

    code: str = "INTERNAL"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Aborted(ServiceError):
    code = "ABORTED"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    code = "PERMISSION_DENIED"


class Cancelled(ServiceError):
    code = "CANCELLED"
