"""`pdserve.v1.Router`: a thin servicer over `Lifecycle` (errors become statuses in the
server bootstrap's interceptor)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from pdserve.router.cancel import CallScope
from pdserve.router.lifecycle import Lifecycle
from pdserve.v1 import router_pb2, router_pb2_grpc


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate: hand the request and its cancellation to the lifecycle, relay its stream."""

    def __init__(self, lifecycle: Lifecycle):
        self._lifecycle = lifecycle

    def Generate(self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[router_pb2.GenerateResponse]:
        scope = CallScope()
        if not context.add_callback(scope.cancel):  # the call already ended
            scope.cancel()
        yield from self._lifecycle.generate(request, scope)
