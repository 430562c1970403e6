"""`pdserve colocated`: one engine serving both Prefill and Decode (the comparison baseline)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pdserve.common.config import METRICS_PORT_HELP, option
from pdserve.common.worker_main import run_worker
from pdserve.common.workerconfig import WorkerConfig


@dataclass(frozen=True)
class ColocatedConfig(WorkerConfig):
    port: int = option(50091, "gRPC port (serves pdserve.v1.Prefill and pdserve.v1.Decode)")
    metrics_port: int = option(9091, METRICS_PORT_HELP)
    lease_ms: float = option(30_000.0, "how long reserved pages wait for their prefill (ms)")


def main(argv: list[str] | None = None) -> int:
    from pdserve.colocated.worker import ColocatedWorker
    from pdserve.decode.servicer import DecodeServicer
    from pdserve.prefill.servicer import PrefillServicer
    from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

    def make(cfg: ColocatedConfig, loop, agent, worker_id: str) -> ColocatedWorker:
        return ColocatedWorker(loop, worker_id=worker_id, default_lease_ms=cfg.lease_ms)

    def register(worker: ColocatedWorker):
        def add(server) -> None:
            decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
            prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
        return add

    return run_worker("colocated", ColocatedConfig, argv, make, register, __doc__)


if __name__ == "__main__":
    sys.exit(main())
