"""A pdserve stack whose processes a test can kill -9 and restart one by one.

Unlike `pdserve up` (which stops everything when one process dies), every service here is its
own `ServiceProcess` (its own process group, its own log): host A's agent and the prefill
workers, host B's agent and the decode workers, and the router, on loopback with free ports.
Fail points (pdserve.common.failpoints) are given per process. `close()` stops whatever is
still running and removes the logs, also when the test failed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pdserve.common.health import wait_serving
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

from tests.support import ServiceProcess, free_port, wait_for


@dataclass
class Node:
    name: str  # router, prefill-0, decode-0, agent-a, agent-b
    address: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: ServiceProcess | None = None
    logs: list[str] = field(default_factory=list)  # output of earlier incarnations

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None


class FaultStack:
    """agent-a + prefill-N on "host A", agent-b + decode-N on "host B", a router in front."""

    def __init__(self, model_dir: Path, *, transport: str = "tcp", prefill: int = 1,
                 decode: int = 1, num_pages: int = 64, router_args: tuple[str, ...] = (),
                 prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                 agent_args: tuple[str, ...] = (),
                 node_args: dict[str, tuple[str, ...]] | None = None):
        """`node_args`: more flags for one node by name (`prefill-0`), after its role's."""
        py = [sys.executable, "-m"]
        extra = node_args or {}
        common = ["--metrics-port", "-1", "--grace-s", "2", "--log-level", "INFO"]
        # A small pool serves a context it holds (--max-model-len): checked at start.
        worker = ["--model", "tiny", "--num-pages", str(num_pages),
                  "--max-model-len", str(num_pages * 16), "--threads", "1",
                  "--max-num-seqs", "64", *common]
        self.nodes: dict[str, Node] = {}
        agents = {}
        for host in "ab":
            port = free_port()
            agents[host] = f"127.0.0.1:{port}"
            self._add(f"agent-{host}", agents[host], [
                *py, "pdserve.kvtransfer.main", "--port", str(port), "--transport", transport,
                "--agent-id", f"host-{host}", "--cancel-wait-s", "3", *common, *agent_args])
        for i in range(decode):
            port = free_port()
            self._add(f"decode-{i}", f"127.0.0.1:{port}", [
                *py, "pdserve.decode.main", "--port", str(port), "--kv-agent", agents["b"],
                *worker, *decode_args, *extra.get(f"decode-{i}", ())])
        for i in range(prefill):
            port = free_port()
            self._add(f"prefill-{i}", f"127.0.0.1:{port}", [
                *py, "pdserve.prefill.main", "--port", str(port), "--kv-agent", agents["a"],
                *worker, *prefill_args, *extra.get(f"prefill-{i}", ())])
        port, http_port = free_port(), free_port()
        self.http = f"127.0.0.1:{http_port}"  # the router's OpenAI-compatible HTTP API
        self._add("router", f"127.0.0.1:{port}", [
            *py, "pdserve.router.main", "--port", str(port), "--http-port", str(http_port),
            "--model", str(model_dir),
            "--prefill", ",".join(n.address for n in self.workers("prefill")),
            "--decode", ",".join(n.address for n in self.workers("decode")),
            "--health-interval-s", "0.25", *common, *router_args])
        self._channels: dict[str, grpc.Channel] = {}
        self.spawned: list[int] = []  # every pid this stack started, killed ones included

    def _add(self, name: str, address: str, argv: list[str]) -> None:
        self.nodes[name] = Node(name, address, argv)

    def workers(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.name.startswith(role)]

    @property
    def router(self) -> str:
        return self.nodes["router"].address

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, failpoints: dict[str, str] | None = None, timeout_s: float = 180.0) -> None:
        """Start every process at once (each with its fail points), wait until all serve."""
        for node in self.nodes.values():
            self._spawn(node, (failpoints or {}).get(node.name, ""))
        for node in self.nodes.values():
            self.wait_serving(node.name, timeout_s)

    def _spawn(self, node: Node, failpoints: str) -> None:
        env = {"PDSERVE_FAILPOINTS": failpoints} if failpoints else {}
        node.env = env
        node.proc = ServiceProcess(node.argv, {**env, "OTEL_SDK_DISABLED": "true"})
        self.spawned.append(node.proc.proc.pid)

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        node = self.nodes[name]
        assert node.proc is not None
        try:
            wait_serving(node.address, timeout_s, node.proc.proc)
        except Exception as exc:
            raise RuntimeError(f"{name} did not come up: {exc}\n{self.log(name)[-3000:]}") \
                from exc

    def kill(self, name: str) -> None:
        """kill -9 the process (its whole group) and reap it."""
        node = self.nodes[name]
        assert node.proc is not None
        node.proc.signal(signal.SIGKILL)
        node.proc.proc.wait(timeout=30)

    def restart(self, name: str, failpoints: str = "", wait: bool = True) -> None:
        """Kill (if alive) and start the process again with the same flags."""
        node = self.nodes[name]
        if node.alive():
            self.kill(name)
        self._retire_log(node)
        self._spawn(node, failpoints)
        if wait:
            self.wait_serving(name)

    def _retire_log(self, node: Node) -> None:
        if node.proc is not None:
            node.proc.stop()  # its log file read into memory and removed
            node.logs.append(node.proc.output())
            node.proc = None

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        for node in reversed(list(self.nodes.values())):
            if node.proc is not None:
                node.proc.stop(timeout_s=10)
                self._retire_log(node)

    def log(self, name: str) -> str:
        node = self.nodes[name]
        return "".join(node.logs) + (node.proc.output() if node.proc else "")

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-2500:]}" for name in self.nodes)

    def segments(self) -> set[str]:
        """/dev/shm/pdserve-* segments of any process this stack ever started (named ones
        carry their creator's pid)."""
        return {name for name in shm_segments()
                if any(f"-{pid}-" in name for pid in self.spawned)}

    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes.values() if n.alive()]

    # ---- calls ----------------------------------------------------------------------------
    def channel(self, name: str) -> grpc.Channel:
        address = self.nodes[name].address
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        return self._channels[address]

    def stats(self, name: str) -> common_pb2.WorkerStats:
        stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub = (
            prefill_pb2_grpc.PrefillStub(self.channel(name)) if name.startswith("prefill")
            else decode_pb2_grpc.DecodeStub(self.channel(name)))
        return stub.Stats(common_pb2.StatsRequest(), timeout=10)

    def free_pages(self) -> dict[str, int]:
        """Free pages of every live worker."""
        return {n.name: self.stats(n.name).free_pages
                for role in ("prefill", "decode") for n in self.workers(role) if n.alive()}

    def pages_back(self, start: dict[str, int], timeout_s: float) -> bool:
        """Every live worker's free pages at their starting count (bounded poll) and no
        reservation left on any decode worker."""
        def back() -> bool:
            now = self.free_pages()
            held = sum(self.stats(n.name).reserved_tickets
                       for n in self.workers("decode") if n.alive())
            return held == 0 and all(now[k] == start[k] for k in now if k in start)
        return wait_for(back, timeout_s)

    def stream(self, **fields: object) -> Stream:
        """Start a Generate call read by a thread; `Stream.join()` for its outcome."""
        call = router_pb2_grpc.RouterStub(self.channel("router")).Generate(
            router_pb2.GenerateRequest(**fields), timeout=120)
        return Stream(call)


class Stream:
    """One Generate call: its token ids, and how it ended (OK or the status and details)."""

    def __init__(self, call: grpc.Call):
        self.call = call
        self.tokens: list[int] = []
        self.finish = ""
        self.code = ""
        self.details = ""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                kind = message.WhichOneof("kind")
                if kind == "delta":
                    self.tokens += message.delta.token_ids
                elif kind == "finish":
                    self.finish = message.finish.finish_reason
            self.code = "OK"
        except grpc.RpcError as exc:
            self.code, self.details = exc.code().name, exc.details() or ""

    def join(self, timeout_s: float = 120.0) -> Stream:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "stream did not end"
        return self

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        self.call.cancel()


def shm_segments() -> set[str]:
    """The pdserve shared-memory segments on this machine (pools are /dev/shm/pdserve-*)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("pdserve")}
    except FileNotFoundError:
        return set()


def iter_pids(pids: list[int]) -> Iterator[int]:
    """The pids of `pids` that still exist."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        yield pid
