"""A KV pool never outlives its owner, whatever kills it (real processes, kill -9): a worker's
pool is a nameless segment (nothing in /dev/shm at any time) that its agent maps from a
descriptor; when the worker is killed the agent unmaps it, and a restarted worker registers
again; when the agent is killed the worker keeps its pool and registers it with the agent
that comes back."""

from __future__ import annotations

import signal
import sys

import grpc
import pytest
from pdserve.common.health import wait_serving
from pdserve.common.shm import leftover_segments, memfd_mappings
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from tests.support import ServiceProcess, free_port, wait_for

pytestmark = pytest.mark.service


def _pool_ids(address: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        return list(kvtransfer_pb2_grpc.KVTransferStub(ch).GetAgentInfo(
            kvtransfer_pb2.GetAgentInfoRequest(), timeout=10).pool_ids)


def _named_segments_of(*procs: ServiceProcess) -> list[str]:
    return [s for p in procs for s in leftover_segments(p.proc.pid)]


def test_kill_9_of_a_worker_or_its_agent_leaves_no_segment_behind(tiny_model_dir) -> None:
    agent_port, worker_port = free_port(), free_port()
    agent_addr, worker_addr = f"127.0.0.1:{agent_port}", f"127.0.0.1:{worker_port}"
    agent_argv = [sys.executable, "-m", "pdserve.kvtransfer.main", "--port", str(agent_port),
                  "--metrics-port", "-1"]
    worker_argv = [sys.executable, "-m", "pdserve.decode.main", "--port", str(worker_port),
                   "--kv-agent", agent_addr, "--kv-cache-mb", "8", "--no-warmup",
                   "--metrics-port", "-1"]
    procs: list[ServiceProcess] = []

    def start(argv: list[str], address: str) -> ServiceProcess:
        proc = ServiceProcess(argv)
        procs.append(proc)
        wait_serving(address, 90, proc.proc)
        return proc

    def kill_9(proc: ServiceProcess) -> None:
        proc.signal(signal.SIGKILL)
        proc.proc.wait(timeout=30)

    try:
        agent = start(agent_argv, agent_addr)
        worker = start(worker_argv, worker_addr)
        (pool_id,) = _pool_ids(agent_addr)
        assert memfd_mappings(agent.proc.pid) == 1 and memfd_mappings(worker.proc.pid) >= 1
        assert _named_segments_of(*procs) == []

        kill_9(worker)
        assert wait_for(lambda: _pool_ids(agent_addr) == [], timeout_s=10)
        assert memfd_mappings(agent.proc.pid) == 0  # unmapped: the memory is gone
        worker = start(worker_argv, worker_addr)  # a restarted worker registers again
        (new_pool,) = _pool_ids(agent_addr)
        assert new_pool != pool_id and memfd_mappings(agent.proc.pid) == 1

        kill_9(agent)
        assert worker.proc.poll() is None and _named_segments_of(*procs) == []
        agent = start(agent_argv, agent_addr)  # back at the same address: registered again
        assert wait_for(lambda: len(_pool_ids(agent_addr)) == 1, timeout_s=15), \
            worker.output()[-3000:]
        assert "registered again" in worker.output()
        assert memfd_mappings(agent.proc.pid) == 1
        wait_serving(worker_addr, 10, worker.proc)
        assert _named_segments_of(*procs) == []
    finally:
        for proc in reversed(procs):
            proc.stop()
