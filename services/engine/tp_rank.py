"""A tensor-parallel rank other than 0 (`python -m pdserve.engine.tp_rank RANK FD POOL_FD
SHARED_FD SPEC`), started by rank 0 (tp.py): join the group, map the shared all-reduce segment,
load this rank's shard, map its pool (rank 0 made it), say ready, then run every step rank 0
hands over until rank 0 hangs up."""

from __future__ import annotations

import datetime
import json
import logging
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pdserve.common.shm import SharedSegment
from pdserve.engine.pool import KVPool
from pdserve.engine.tp import (
    COLLECTIVE_TIMEOUT_S,
    Group,
    RankSpec,
    SharedReduce,
    receive_batch,
)
from torch.distributed import TCPStore  # type: ignore[attr-defined]

log = logging.getLogger("pdserve.engine.tp")


def main(argv: list[str]) -> int:
    rank, fd, pool_fd, shared_fd = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    spec = RankSpec(**json.loads(argv[4]))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    conn = socket.socket(fileno=fd)
    torch.set_num_threads(spec.threads)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=spec.size,
                            timeout=timeout)
    from pdserve.engine.model import load_model

    group = Group(rank, spec.size)
    if shared_fd >= 0:
        segment = SharedSegment.from_fd(shared_fd,
                                        SharedReduce.segment_bytes(spec.size, spec.slot_bytes))
        group.shared = SharedReduce(segment, rank, spec.size, spec.slot_bytes)
    model = load_model(Path(spec.model_dir), dtype=spec.dtype, device=spec.device,
                       model_id=spec.model_id, tp=group)
    pool = KVPool(model.fingerprint(spec.block_size), spec.num_pages, spec.device,
                  attach_fd=pool_fd)
    conn.sendall(b"R")
    steps = 0
    try:
        while (batch := receive_batch(conn, pool.device)) is not None:
            model(batch, pool.tensor)
            steps += 1
    except (RuntimeError, OSError) as exc:  # a collective broke: rank 0 or a peer is gone
        log.error("stopping after %d steps: %s", steps, exc)
        return 1
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
