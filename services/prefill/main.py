"""`pdserve prefill`: a prefill worker (prompt → KV pages + first token, pages shipped to
decode)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.config import METRICS_PORT_HELP, option, require
from pdserve.worker.config import WorkerConfig

if TYPE_CHECKING:
    import grpc
    from pdserve.engine.loop import EngineLoop
    from pdserve.prefill.worker import PrefillWorker


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    port: int = option(50061, "gRPC port")
    metrics_port: int = option(9061, METRICS_PORT_HELP)
    transfer_timeout_s: float = option(30.0, "longest a KV handoff may take before it fails (s)")
    pipeline_handoff: bool = option(True, "ship the pages each prompt chunk completes while the "
                                          "next chunk computes (off: all pages after the last "
                                          "chunk)")
    same_host_lane: bool = option(True, "on one host, hand the pages to the decode side's "
                                        "agent directly (it copies them out of this worker's "
                                        "pool; off: through this host's agent)")
    network_lane: bool = option(True, "to another host's agent over plain TCP, send the pages "
                                      "from this worker's pool onto the connection itself "
                                      "(off: through this host's agent)")
    prefill_wait_s: float = option(300.0, "longest a prompt may wait and run before its "
                                          "Prefill call fails (s)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.transfer_timeout_s > 0, "transfer_timeout_s", self.transfer_timeout_s, "> 0")
        require(self.prefill_wait_s > 0, "prefill_wait_s", self.prefill_wait_s, "> 0")


def main(argv: list[str] | None = None) -> int:
    from pdserve.prefill.worker import PrefillWorker
    from pdserve.v1 import prefill_pb2_grpc
    from pdserve.worker.main import connect_agent, run_worker
    from pdserve.worker.servicers import PrefillServicer

    def make(cfg: PrefillConfig, loop: EngineLoop, worker_id: str) -> PrefillWorker:
        return PrefillWorker(loop, connect_agent(cfg), worker_id=worker_id,
                             transfer_timeout_s=cfg.transfer_timeout_s,
                             prefill_wait_s=cfg.prefill_wait_s,
                             pipeline_handoff=cfg.pipeline_handoff,
                             same_host_lane=cfg.same_host_lane,
                             network_lane=cfg.network_lane,
                             connect=lambda: connect_agent(cfg))

    def servicers(worker: PrefillWorker) -> Callable[[grpc.Server], None]:
        return lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(
            PrefillServicer(worker), server)

    return run_worker("prefill", PrefillConfig, argv, make, servicers, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
