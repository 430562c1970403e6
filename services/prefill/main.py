"""`pdserve prefill`: a prefill worker (prompt → KV pages + first token, pages shipped to decode)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pdserve.common.config import METRICS_PORT_HELP, option, require
from pdserve.common.worker_main import run_worker
from pdserve.common.workerconfig import WorkerConfig


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    port: int = option(50061, "gRPC port")
    metrics_port: int = option(9061, METRICS_PORT_HELP)
    transfer_timeout_s: float = option(30.0, "longest a KV handoff may take before it fails (s)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.transfer_timeout_s > 0, "transfer_timeout_s", self.transfer_timeout_s, "> 0")


def main(argv: list[str] | None = None) -> int:
    from pdserve.prefill.servicer import PrefillServicer
    from pdserve.prefill.worker import PrefillWorker
    from pdserve.v1 import prefill_pb2_grpc

    def make(cfg: PrefillConfig, loop, agent, worker_id: str) -> PrefillWorker:
        return PrefillWorker(loop, agent, worker_id=worker_id, transfer_timeout_s=cfg.transfer_timeout_s)

    def register(worker: PrefillWorker):
        return lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)

    return run_worker("prefill", PrefillConfig, argv, make, register, __doc__)


if __name__ == "__main__":
    sys.exit(main())
