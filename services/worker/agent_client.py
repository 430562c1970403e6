"""The workers' side of the host's kvtransfer agent: plain types in and out, every call with
a deadline, gRPC errors turned into domain errors. `AgentWindow` is a decode worker's lease
book's `WriteWindow`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from pdserve.common import tracing, wire
from pdserve.common.errors import Aborted, ServiceError
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.common.tickets import TicketKey
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from pdserve.worker.leases import WindowClosed

log = logging.getLogger("pdserve.worker")


class AgentClient:
    """Calls to the local agent."""

    def __init__(self, address: str, timeout_s: float = 10.0,
                 security: ChannelSecurity | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, security)
        self.stub = kvtransfer_pb2_grpc.KVTransferStub(self._channel)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"kvtransfer agent at {self.address} not reachable "
                                  f"after {timeout_s:.0f}s (is `pdserve kvtransfer` running?)"
                                  ) from None

    def register_pool(self, worker_id: str, shm_name: str, num_pages: int, page_bytes: int,
                      fingerprint: LayoutFingerprint) -> tuple[str, int]:
        """Have the agent map this pool; returns (pool id, agent epoch)."""
        reply = self.stub.RegisterPool(kvtransfer_pb2.RegisterPoolRequest(
            worker_id=worker_id, shm_name=shm_name, num_pages=num_pages, page_bytes=page_bytes,
            fingerprint=wire.fingerprint_to_pb(fingerprint)), timeout=self.timeout_s,
            wait_for_ready=True)
        return reply.pool_id, reply.agent_epoch

    def epoch(self) -> int:
        """The agent's current epoch (GetAgentInfo); raises grpc.RpcError when unreachable."""
        reply = self.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(),
                                       timeout=self.timeout_s)
        return int(reply.epoch)

    def watch(self, epoch: int, on_restart: Callable[[], None],
              interval_s: float = 1.0) -> EpochWatch:
        """Call `on_restart` (re-register the pool) whenever the agent comes back with an
        epoch other than `epoch`: a restarted agent has forgotten every pool and ticket."""
        return EpochWatch(self, epoch, on_restart, interval_s)

    def window(self, pool_id: str) -> AgentWindow:
        """The write windows of a registered pool (a decode worker's lease book uses them)."""
        return AgentWindow(self, pool_id)

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> Send:
        """Start shipping pages; `result()` waits for the report, `cancel()` gives up. The
        agent's kv.send span continues the current trace."""
        return Send(self.stub.SendPages.future(kvtransfer_pb2.SendPagesRequest(
            ticket=wire.ticket_to_pb(ticket), src_pool_id=src_pool_id,
            src_page_ids=src_page_ids, destination=wire.destination_to_pb(destination),
            timeout_ms=timeout_s * 1e3), timeout=timeout_s + 1.0,
            metadata=tracing.outgoing_metadata()))

    def close(self) -> None:
        self._channel.close()


class EpochWatch:
    """A daemon thread asking the agent its epoch every `interval_s` (see AgentClient.watch).
    A failed re-registration is retried at the next check; errors are logged, never raised."""

    def __init__(self, agent: AgentClient, epoch: int, on_restart: Callable[[], None],
                 interval_s: float):
        self._agent = agent
        self.epoch = epoch
        self._on_restart = on_restart
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._unreachable = False
        self._thread = threading.Thread(target=self._run, name="agent-epoch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                epoch = self._agent.epoch()
            except grpc.RpcError as exc:
                if not self._unreachable:
                    log.warning("kvtransfer agent at %s unreachable: %s %s", self._agent.address,
                                exc.code().name, exc.details())
                self._unreachable = True
                continue
            self._unreachable = False
            if epoch == self.epoch:
                continue
            log.warning("kvtransfer agent at %s restarted (epoch %d -> %d): registering the "
                        "pool again", self._agent.address, self.epoch, epoch)
            try:
                self._on_restart()
                self.epoch = epoch
            except Exception as exc:
                log.warning("registering the pool with the restarted agent at %s failed: %s",
                            self._agent.address, exc)

    def stop(self) -> None:
        self._stop.set()


class Send:
    """A handoff in flight."""

    def __init__(self, future: grpc.Future):
        self._future = future

    def result(self) -> TransferReport:
        """The sending agent's report. Raises `Aborted` once cancelled, `ServiceError` with
        the agent's status when the handoff failed."""
        try:
            return wire.report_from_pb(self._future.result().report)
        except grpc.FutureCancelledError:
            raise Aborted("the KV handoff was cancelled") from None
        except grpc.RpcError as exc:
            raise ServiceError(f"KV handoff failed: {exc.details()}", exc.code().name) from None

    def cancel(self) -> None:
        self._future.cancel()


class AgentWindow:
    """A decode worker's write windows on its agent (the lease book's `WriteWindow`)."""

    def __init__(self, agent: AgentClient, pool_id: str):
        self._agent = agent
        self.pool_id = pool_id  # replaced when the pool is registered with a restarted agent

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        self._agent.stub.ExpectTransfer(kvtransfer_pb2.ExpectTransferRequest(
            ticket=wire.ticket_to_pb(key), pool_id=self.pool_id, page_ids=page_ids,
            lease_ms=lease_s * 1e3), timeout=self._agent.timeout_s)

    def close(self, key: TicketKey) -> WindowClosed:
        """CancelTransfer: answers once no write for the ticket is in flight. An agent that is
        gone (UNAVAILABLE) cannot write either: confirmed, nothing landed."""
        try:
            # The agent may wait for an in-flight write to stop before it answers (its
            # --cancel-wait-s); give it longer than that, so "timed out" means it could not.
            reply = self._agent.stub.CancelTransfer(kvtransfer_pb2.CancelTransferRequest(
                ticket=wire.ticket_to_pb(key)), timeout=2 * self._agent.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return WindowClosed(confirmed=True, landed=False)
            raise
        return WindowClosed(confirmed=True, landed=reply.was_complete)
