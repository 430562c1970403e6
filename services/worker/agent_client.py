"""The workers' side of the host's kvtransfer agent: plain types in and out, every call with
a deadline, errors turned into domain errors. `AgentWindow` is a decode worker's lease book's
`WriteWindow`.

Everything per handoff goes over the agent's local socket (pdserve.common.localsock; the
agent's end is pdserve.kvtransfer.local): one round trip on a Unix socket per call, no gRPC.
gRPC is used once, to ask the agent (`--kv-agent`) where its socket is and for its token; the
socket (the advertised one, or `--kv-agent-socket`) must answer with that token.

The pool is handed over as its segment's descriptor on a connection kept open for the
worker's life: the agent keeps the pool exactly as long as that connection, so when this
process dies, whatever kills it, the agent unmaps the pool and its memory is freed. When the
agent goes away instead, a watcher registers the pool again with the agent that comes back
(new pool id and epoch; `on_registered` tells the worker).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from pdserve.common import localsock, tracing
from pdserve.common.errors import ServiceError, Unavailable
from pdserve.common.handoff import (
    Destination,
    destination_to_json,
    fingerprint_to_json,
    ticket_to_json,
)
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.common.tickets import TicketKey
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from pdserve.worker.agent_calls import AgentWindow, Call, Send, raise_for

log = logging.getLogger("pdserve.worker.agent")
MAX_IDLE = 8
RECONNECT_MAX_S = 2.0


@dataclass(frozen=True)
class PoolSpec:
    """What `register_pool` hands the agent (kept to register again after an agent restart)."""

    worker_id: str
    fd: int
    num_pages: int
    page_bytes: int
    fingerprint: LayoutFingerprint


class AgentClient:
    """Calls to the local agent."""

    def __init__(self, address: str, timeout_s: float = 10.0,
                 security: ChannelSecurity | None = None, socket_address: str = ""):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, security)
        self.stub = kvtransfer_pb2_grpc.KVTransferStub(self._channel)
        self._socket_override = socket_address
        self.socket_address = ""
        self._token = b""
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._spec: PoolSpec | None = None
        self._pool_conn: socket.socket | None = None
        self._notes: socket.socket | None = None  # `note`'s connection
        self._notes_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._on_registered: Callable[[str, int], None] = lambda pool_id, epoch: None
        self.pool_id = ""
        self.agent_epoch = 0

    # ---- start-up ---------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the agent answers, and learn (and check) its local socket."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"kvtransfer agent at {self.address} not reachable "
                                  f"after {timeout_s:.0f}s (is `pdserve kvtransfer` running?)"
                                  ) from None
        self._locate()

    def _locate(self) -> None:
        info = self.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(),
                                      timeout=self.timeout_s, wait_for_ready=True)
        address = self._socket_override or info.local_socket
        if not address:
            raise ConnectionError(f"kvtransfer agent at {self.address} has no local socket")
        sock = self._connect(address)
        try:
            hello, _ = localsock.call(sock, {"op": "hello"})
        finally:
            sock.close()
        if bytes.fromhex(str(hello.get("token", ""))) != info.local_token:
            raise ConnectionError(f"the local socket {address} belongs to another agent "
                                  f"({hello.get('agent_id')}) than the one at {self.address} "
                                  f"({info.agent_id}): --kv-agent-socket must be that agent's "
                                  "--local-socket")
        with self._lock:
            self.socket_address, self._token = address, info.local_token
            idle, self._idle = self._idle, []
        for old in idle:
            old.close()

    def _connect(self, address: str) -> socket.socket:
        try:
            return localsock.connect(address, self.timeout_s)
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"cannot reach the kvtransfer agent's local socket {address}: "
                                  f"{exc}; the worker and its agent must share it (same host; "
                                  "in Kubernetes, the socket's directory in a volume both "
                                  "containers mount)") from None

    def register_pool(self, worker_id: str, fd: int, num_pages: int, page_bytes: int,
                      fingerprint: LayoutFingerprint,
                      on_registered: Callable[[str, int], None] | None = None
                      ) -> tuple[str, int]:
        """Hand the pool's segment to the agent; returns (pool id, agent epoch). The pool is
        registered again, and `on_registered(pool_id, epoch)` called, after an agent restart."""
        self._spec = PoolSpec(worker_id, fd, num_pages, page_bytes, fingerprint)
        if on_registered is not None:
            self._on_registered = on_registered
        self._register()
        self._watcher = threading.Thread(target=self._watch, name="kv-agent-watch", daemon=True)
        self._watcher.start()
        return self.pool_id, self.agent_epoch

    def _register(self) -> None:
        spec = self._spec
        assert spec is not None
        conn = self._connect(self.socket_address)
        try:
            reply, _ = localsock.call(conn, {
                "op": "register", "worker_id": spec.worker_id, "num_pages": spec.num_pages,
                "page_bytes": spec.page_bytes,
                "fingerprint": fingerprint_to_json(spec.fingerprint)}, fds=(spec.fd,))
            raise_for(reply, "RegisterPool")
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)  # from now on it only waits for the agent to go away
        with self._lock:
            old, self._pool_conn = self._pool_conn, conn
            self.pool_id, self.agent_epoch = str(reply["pool_id"]), int(reply["agent_epoch"])
        if old is not None:
            old.close()
        self._on_registered(self.pool_id, self.agent_epoch)

    def _watch(self) -> None:
        """Register again whenever the agent's end of the pool connection goes away."""
        while not self._stopping.is_set():
            conn = self._pool_conn
            try:
                assert conn is not None
                localsock.recv(conn)  # the agent never writes here: returns only at its end
            except (OSError, localsock.Closed, ValueError, AssertionError):
                pass
            if self._stopping.is_set():
                return
            log.warning("kvtransfer agent %s went away; registering the pool again when it "
                        "is back", self.address)
            delay = 0.05
            while not self._stopping.wait(delay):
                try:
                    self._locate()
                    self._register()
                    log.info("pool registered again with the agent at %s: %s (epoch %d)",
                             self.address, self.pool_id, self.agent_epoch)
                    break
                except (ConnectionError, grpc.RpcError, ServiceError, OSError,
                        localsock.Closed, ValueError) as exc:
                    log.debug("agent not back yet: %s", exc)
                    delay = min(2 * delay, RECONNECT_MAX_S)

    # ---- calls ------------------------------------------------------------------------
    def call(self, message: dict[str, Any], what: str,
             timeout_s: float | None = None) -> dict[str, Any]:
        """One request on a pooled connection; raises ServiceError with the agent's status
        (UNAVAILABLE when the agent cannot be reached)."""
        return Call(self, message, what, timeout_s).result()

    def checkout(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            address = self.socket_address
        if not address:
            raise Unavailable(f"kvtransfer agent at {self.address}: not connected yet")
        try:
            return self._connect(address)
        except ConnectionError as exc:
            raise Unavailable(str(exc)) from None

    def checkin(self, conn: socket.socket, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._stopping.is_set() and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def window(self) -> AgentWindow:
        """The write windows of the registered pool (a decode worker's lease book uses them)."""
        return AgentWindow(self)

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> Send:
        """A handoff to run (`result()` runs it and waits for the report, `cancel()` from
        another thread gives up). The agent's kv.send span continues the current trace."""
        return Send(Call(self, {
            "op": "send", "ticket": ticket_to_json(ticket), "src_pool_id": src_pool_id,
            "src_page_ids": src_page_ids, "destination": destination_to_json(destination),
            "timeout_ms": timeout_s * 1e3, "traceparent": tracing.traceparent()},
            "KV handoff", timeout_s + 1.0))

    def note(self, message: dict[str, Any]) -> None:
        """Tell the agent something that needs no answer (`sent`): written, not waited for;
        lost, with a debug line, when the agent cannot be reached."""
        with self._notes_lock:
            try:
                if self._notes is None:
                    self._notes = self.checkout()
                localsock.send(self._notes, message)
            except (OSError, ServiceError) as exc:
                log.debug("note to the agent lost: %s", exc)
                if self._notes is not None:
                    self._notes.close()
                    self._notes = None

    def close(self) -> None:
        self._stopping.set()
        with self._lock:
            idle, self._idle = self._idle, []
            pool_conn, self._pool_conn = self._pool_conn, None
        with self._notes_lock:
            notes, self._notes = self._notes, None
        for conn in idle + ([notes] if notes is not None else []):
            conn.close()
        if pool_conn is not None:
            try:
                pool_conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            pool_conn.close()
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
        self._channel.close()
