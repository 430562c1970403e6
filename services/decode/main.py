"""`pdserve decode`: a decode worker (paged KV pool, continuous batching, token streaming)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.config import METRICS_PORT_HELP, option, require
from pdserve.worker.config import WorkerConfig

if TYPE_CHECKING:
    import grpc
    from pdserve.decode.worker import DecodeWorker
    from pdserve.engine.loop import EngineLoop


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    port: int = option(50071, "gRPC port")
    metrics_port: int = option(9071, METRICS_PORT_HELP)
    lease_ms: float = option(30_000.0, "how long reserved pages wait for their KV handoff (ms)")
    # The prompts a decode worker computes are the short uncached parts the router leaves it
    # (--remote-prefill-min-tokens): one per step gives each its first token a step sooner
    # than packing them, and keeps the batch's steps short (measured in docs/benchmarks.md).
    # Those prompts ride beside the batch in chunks this small: a 128-token prompt in one step
    # held every running sequence's next token ~3x a decode step (scenario B, bench-7m); in
    # 64-token chunks the ITL p99 fell to 0.44x of co-located's, the prompt's TTFT unchanged
    # (32: the same ITL, +11 ms TTFT). With nothing decoding a prompt takes the whole step.
    chunk_size: int = option(64, "prompt tokens per step while sequences decode (with none "
                                 "decoding, up to --max-prefill-tokens)")
    prompts_beside_decodes: int = option(1, "prompts one step computes while sequences decode "
                                            "(0: as many as --max-prefill-tokens holds)")
    token_wait_s: float = option(120.0, "longest a stream waits for its next token before "
                                        "failing (s)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.lease_ms > 0, "lease_ms", self.lease_ms, "> 0")
        require(self.prompts_beside_decodes >= 0, "prompts_beside_decodes",
                self.prompts_beside_decodes, ">= 0 (0 = no limit)")
        require(self.token_wait_s > 0, "token_wait_s", self.token_wait_s, "> 0")


def main(argv: list[str] | None = None) -> int:
    from pdserve.decode.worker import DecodeWorker
    from pdserve.v1 import decode_pb2_grpc
    from pdserve.worker.main import connect_agent, run_worker
    from pdserve.worker.servicers import DecodeServicer

    def make(cfg: DecodeConfig, loop: EngineLoop, worker_id: str) -> DecodeWorker:
        return DecodeWorker(loop, connect_agent(cfg), worker_id=worker_id,
                            agent_address=cfg.kv_agent_for_peers,
                            default_lease_s=cfg.lease_ms / 1e3, token_wait_s=cfg.token_wait_s,
                            connect=lambda: connect_agent(cfg))

    def servicers(worker: DecodeWorker) -> Callable[[grpc.Server], None]:
        return lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(
            DecodeServicer(worker), server)

    return run_worker("decode", DecodeConfig, argv, make, servicers, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
