"""`pdserve decode`: a decode worker (paged KV pool, continuous batching, token streaming)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pdserve.common.config import METRICS_PORT_HELP, option, require
from pdserve.common.worker_main import run_worker
from pdserve.common.workerconfig import WorkerConfig


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    port: int = option(50071, "gRPC port")
    metrics_port: int = option(9071, METRICS_PORT_HELP)
    lease_ms: float = option(30_000.0, "how long reserved pages wait for their KV handoff (ms)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.lease_ms > 0, "lease_ms", self.lease_ms, "> 0")


def main(argv: list[str] | None = None) -> int:
    from pdserve.decode.servicer import DecodeServicer
    from pdserve.decode.worker import DecodeWorker
    from pdserve.v1 import decode_pb2_grpc

    def make(cfg: DecodeConfig, loop, agent, worker_id: str) -> DecodeWorker:
        return DecodeWorker(loop, agent, worker_id=worker_id, agent_address=cfg.kv_agent,
                            default_lease_ms=cfg.lease_ms)

    def register(worker: DecodeWorker):
        return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)

    return run_worker("decode", DecodeConfig, argv, make, register, __doc__)


if __name__ == "__main__":
    sys.exit(main())
