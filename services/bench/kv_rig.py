"""The rig `pdserve bench kv` measures on: real agent processes, and pools handed to them the
way workers hand theirs (a nameless segment's descriptor on the agent's local socket), with
the per-handoff calls made the way workers make them (expect on the receiving side, send on
the sending side, each one round trip on the local socket).

An agent may run inside a network namespace (`prefix`: `ip netns exec NS`); its local socket
is then a path in a directory of this process's choosing, so this process can still reach it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.bench.kv_baselines import RawTcp
from pdserve.bench.loadgen.procs import free_port
from pdserve.bench.netns import Link
from pdserve.common import localsock
from pdserve.common.handoff import (
    Destination,
    TransferReport,
    destination_to_json,
    fingerprint_to_json,
    report_from_json,
)
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import ChannelSecurity
from pdserve.common.shm import SharedSegment
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc


@dataclass
class AgentProc:
    address: str  # gRPC host:port
    socket: str  # its local socket
    proc: subprocess.Popen[bytes]


@contextmanager
def agent(flags: Sequence[str], *, prefix: Sequence[str] = (), host: str = "127.0.0.1",
          port: int = 0, local_socket: str = "", env: dict[str, str] | None = None
          ) -> Iterator[AgentProc]:
    """An agent process (`pdserve kvtransfer FLAGS`) until the block ends."""
    port = port or free_port()
    argv = [*prefix, sys.executable, "-m", "pdserve.kvtransfer.main", "--port", str(port),
            "--metrics-port", "-1", "--log-level", "WARNING", *flags]
    if local_socket:
        argv += ["--local-socket", local_socket]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    address = f"{host}:{port}"
    try:
        with _channel(address, flags) as channel:
            _wait_serving(channel, proc, address)
            info = kvtransfer_pb2_grpc.KVTransferStub(channel).GetAgentInfo(
                kvtransfer_pb2.GetAgentInfoRequest(), timeout=30)
        yield AgentProc(address, info.local_socket, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _channel(address: str, flags: Sequence[str]) -> grpc.Channel:
    """A channel to the agent: over mutual TLS with its own certificate when it has one."""
    if "--tls-ca" not in flags:
        return grpc.insecure_channel(address)
    arg = {name: flags[flags.index(name) + 1] for name in ("--tls-ca", "--tls-cert", "--tls-key")}
    security = ChannelSecurity(ca=arg["--tls-ca"], cert=arg["--tls-cert"], key=arg["--tls-key"])
    return grpc.secure_channel(address, security.credentials(), security.options())


def _wait_serving(channel: grpc.Channel, proc: subprocess.Popen[bytes], address: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent for {address} exited with {proc.returncode}")
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent at {address} not SERVING after 90s")
        time.sleep(0.1)  # bounded poll of a starting process


class Worker:
    """A stand-in for a worker on an agent's host: it registers a pool and makes the calls."""

    def __init__(self, agent: AgentProc, worker_id: str, segment: SharedSegment,
                 num_pages: int, fingerprint: LayoutFingerprint):
        self.agent = agent
        self._pool_conn = localsock.connect(agent.socket, 30)
        reply, _ = localsock.call(self._pool_conn, {
            "op": "register", "worker_id": worker_id, "num_pages": num_pages,
            "page_bytes": fingerprint.page_bytes,
            "fingerprint": fingerprint_to_json(fingerprint)}, fds=(segment.fd,))
        _check(reply)
        self.pool_id, self.agent_epoch = str(reply["pool_id"]), int(reply["agent_epoch"])
        self._conn = localsock.connect(agent.socket, 30)
        self._conn.settimeout(120)

    def expect(self, request_id: str, page_ids: list[int]) -> None:
        _check(localsock.call(self._conn, {
            "op": "expect", "ticket": {"request_id": request_id, "epoch": 1},
            "pool_id": self.pool_id, "page_ids": page_ids, "lease_ms": 60_000})[0])

    def send(self, request_id: str, page_ids: list[int], dest: Destination) -> TransferReport:
        reply, _ = localsock.call(self._conn, {
            "op": "send", "ticket": {"request_id": request_id, "epoch": 1},
            "src_pool_id": self.pool_id, "src_page_ids": page_ids,
            "destination": destination_to_json(dest), "timeout_ms": 60_000})
        _check(reply)
        return report_from_json(reply["report"])

    def destination(self, page_ids: list[int], fingerprint: LayoutFingerprint) -> Destination:
        return Destination(self.agent.address, self.agent_epoch, self.pool_id, tuple(page_ids),
                           fingerprint)

    def close(self) -> None:
        self._conn.close()
        self._pool_conn.close()


def _check(reply: dict[str, object]) -> None:
    if reply.get("error"):
        raise RuntimeError(f"{reply['error']}: {reply.get('message')}")


class Placement:
    """Where the bench's two agents and the raw TCP receiver run: all on this host."""

    note = "two agents on this host, raw TCP over loopback"
    hosts: tuple[str, ...] = ("127.0.0.1",)  # the agents' addresses (certificates name them)

    def sender(self, flags: Sequence[str]) -> AbstractContextManager[AgentProc]:
        return agent(flags)

    def receiver(self, flags: Sequence[str]) -> AbstractContextManager[AgentProc]:
        return agent(flags)

    def raw_tcp(self, nbytes: int) -> RawTcp:
        return RawTcp(nbytes)


class NetnsPlacement(Placement):
    """This process and the sending agent in network namespace a, the receiving agent and the
    raw TCP receiver in b: every byte crosses the veth between them (UCX over TCP on it)."""

    def __init__(self, link: Link, socket_dir: str):
        self.link = link
        self.note = (f"two network namespaces joined by a veth ({link.ip_a} -> {link.ip_b}), "
                     f"{link.cpus_note()}, the same-host copy off, raw TCP over the same link")
        self.hosts = (link.ip_a, link.ip_b)
        self._dir = socket_dir
        self._count = 0

    def _socket(self) -> str:
        self._count += 1
        return os.path.join(self._dir, f"agent-{self._count}.sock")

    def sender(self, flags: Sequence[str]) -> AbstractContextManager[AgentProc]:
        link = self.link
        return agent([*flags, "--advertise-host", link.ip_a], host=link.ip_a,
                     local_socket=self._socket(),
                     env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": link.dev_a})

    def receiver(self, flags: Sequence[str]) -> AbstractContextManager[AgentProc]:
        link = self.link
        return agent([*flags, "--advertise-host", link.ip_b], prefix=link.on_b(),
                     host=link.ip_b, local_socket=self._socket(),
                     env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": link.dev_b})

    def raw_tcp(self, nbytes: int) -> RawTcp:
        link = self.link
        proc = subprocess.Popen(link.on_b(sys.executable, "-m", "pdserve.bench.kv_baselines",
                                          link.ip_b, str(nbytes)),
                                stdout=subprocess.PIPE)
        assert proc.stdout is not None
        port = int(proc.stdout.readline() or 0)
        if not port:
            proc.kill()
            raise RuntimeError("the raw TCP receiver in the other namespace did not start")
        return RawTcp(nbytes, link.ip_b, port, receiver=proc)
