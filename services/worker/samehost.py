"""A prefill worker's own same-host lane: the decode side's agent copies the pages straight
out of this worker's pool, with this host's agent out of the way.

Through the agents, a handoff on one host wakes four processes in turn (this worker -> its
agent -> the destination agent -> its agent -> this worker), each wake-up 0.1-0.2 ms on a
small machine, around a copy that takes tens of microseconds for a page. When the destination
agent shares this host, the worker speaks the same-host path's `shm_write` to it itself
(pdserve.kvtransfer.shm): two wake-ups. The receiving agent maps this pool read-only once per
connection and checks every write exactly as it does its peers' (ticket and epoch, pool,
layout, pages; a cancel stops the copy), so the guarantees are the same-host path's.

Which destinations qualify is this host's agent's call, asked once per destination agent and
epoch (`peer` on its local socket): only those it would copy to itself (their local socket
reachable here, not proven remote) and only without mutual TLS (writes then need a grant,
which only agents hold). Anything that makes the lane unusable (the socket unreachable or
another agent's, the pool not mappable there) sends through the agent instead, and so does a
connection that breaks: the agent retries, or names what is wrong. A refusal by the
destination (stale epoch, cancelled ticket, bad pages) is the handoff's error, with the status
the agent would give it. The agent still counts what this worker sent (`sent`, a note with no
reply), and this worker's kv.send span stands in for the agent's.

The same lane also takes handoffs to other hosts' agents over plain TCP where this host's agent
offers that route (`LaneOptions.network`; the sending itself is pdserve.worker.netlane's): a
destination whose local socket proves unreachable from here is asked for again as remote.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pdserve.common import failpoints, tracing
from pdserve.common.errors import Aborted, ServiceError
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.kv.errors import (
    KvTransferError,
    PeerUnavailable,
    SegmentUnavailable,
    cause,
    status_name,
)
from pdserve.common.kv.relayout import ColumnSpec
from pdserve.common.kv.runs import PageRun, coalesce
from pdserve.common.kv.samehost import open_connection, raise_refusal, request_copy, write_message
from pdserve.common.kv.spans import send_span
from pdserve.common.kv.tcpwire import Prepared
from pdserve.common.kv.wire import MAX_RUNS, WriteHeader, expect_same
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.lanesend import Fallback, LaneSend, Route, Started, UseAgent
from pdserve.worker.netlane import TcpLane

log = logging.getLogger("pdserve.worker.samehost")
MAX_IDLE_PER_PEER = 4
MAX_ROUTES = 1024  # destination agents (x epochs) remembered


@dataclass(frozen=True)
class Relayout:
    """What makes a lane's writes re-lay pages out between tensor-parallel splits
    (pdserve.common.kv.relayout): the source pools (key and read-only descriptor each, the
    key as its own lane names it) and the columns each destination row takes from them."""

    sources: Sequence[tuple[str, int]]
    columns: Sequence[ColumnSpec]
    row_bytes: int


@dataclass(frozen=True)
class LaneOptions:
    """Which lanes a worker's pools get: `same_host` (to this host's other agents, the
    same-host copy), `network` (to other hosts' agents, over TCP where this host's agent
    offers it); `on_sent(transport)` is told each handoff a lane sent itself."""

    same_host: bool = True
    network: bool = False
    on_sent: Callable[[str], None] = lambda transport: None


class SameHostLane:
    """`send` as `AgentClient.send` has it, taking the lane where it can (thread-safe)."""

    def __init__(self, agent: AgentClient, pool_fd: int, num_pages: int, page_bytes: int,
                 fingerprint: LayoutFingerprint, worker_id: str,
                 relayout: Relayout | None = None, options: LaneOptions = LaneOptions()):
        """`options.network` is ignored for re-laid-out writes: across hosts those go packed,
        through the agent."""
        self._agent = agent
        self._options = options
        self._relayout = relayout
        self._tcp = (TcpLane(agent, pool_fd, num_pages, page_bytes)
                     if options.network and relayout is None else None)
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        self._fingerprint = fingerprint
        self.pool_key = f"worker:{worker_id}:{os.getpid()}"  # the receiver's name for the map
        self.readonly_fd = os.open(f"/proc/self/fd/{pool_fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, int], Route | None] = {}
        # idle connections, and the pools each has carried (their descriptors went with it)
        self._idle: dict[str, list[tuple[socket.socket, set[str]]]] = {}
        self.copied = 0  # handoffs this lane made itself (the rest went through the agent)

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float,
             fallback: Callable[[], Fallback] | None = None) -> Fallback:
        """The part over the lane, or `fallback()` (default: through the agent) when the lane
        cannot take it."""
        fallback = fallback or functools.partial(self._agent.send, ticket, src_pool_id,
                                                 src_page_ids, destination, timeout_s)
        # The route is found (and the fallback's request made) when the part goes.
        return LaneSend(self, ticket, src_page_ids, destination, timeout_s, fallback)

    def known_route(self, dest: Destination) -> Route | None:
        """The route to the destination's agent if already known (never asks the agent)."""
        with self._lock:
            return self._routes.get((dest.agent_address, dest.agent_epoch))

    def route(self, dest: Destination, remote: bool = False) -> Route | None:
        """The lane to the destination's agent, or None (send through this host's agent).
        `remote`: its local socket proved unreachable from here (ask for the network route)."""
        key = (dest.agent_address, dest.agent_epoch)
        with self._lock:
            if key in self._routes and not remote:
                return self._routes[key]
        try:
            reply = self._agent.call({"op": "peer", "address": dest.agent_address,
                                      "epoch": dest.agent_epoch, "remote": remote,
                                      "same_host": self._options.same_host,
                                      "network": self._tcp is not None}, "the lane's route")
        except ServiceError as exc:  # not remembered: the agent path names what is wrong
            log.debug("no route of its own to %s: %s", dest.agent_address, exc)
            return None
        route = None
        if reply.get("usable") and reply.get("tcp_address"):
            route = Route(str(reply["agent_id"]), "", b"", str(reply["sender"]),
                          str(reply["tcp_address"]), int(reply["write_bytes"]),
                          int(reply["buffer_bytes"]))
        elif reply.get("usable") and not remote:
            route = Route(str(reply["agent_id"]), str(reply["local_socket"]),
                          bytes.fromhex(str(reply["local_token"])), str(reply["sender"]))
        self._remember(key, route)
        return route

    def _remember(self, key: tuple[str, int], route: Route | None) -> None:
        with self._lock:
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = route

    def prepare(self, s: LaneSend) -> Started | None:
        """An eager TCP handoff made ready to go (runs, header, a connection), for the engine's
        thread to write when its KV is ready (`Started.prepared.push`); `copy` finishes it.
        None where `copy` does more than write (no TCP route, tracing, failpoints) or will
        refuse it."""
        if self._tcp is None or not s.route.tcp_address or tracing.enabled() \
                or failpoints.active():
            return None
        try:
            runs = self._runs(s)
        except (UseAgent, KvTransferError):
            return None
        header = self._header(s, runs)
        prepared = self._tcp.prepare(
            self._tcp.sender(s.route.write_bytes, s.route.buffer_bytes), s.route.tcp_address,
            header, runs, s.timeout_s)
        return None if prepared is None else Started(runs, header, prepared)

    def _runs(self, s: LaneSend) -> list[PageRun]:
        """The handoff's runs; UseAgent (the agent names a bad request), or KvTransferError
        for a layout the destination does not share (caught before any I/O, as the agent
        does)."""
        try:
            runs = coalesce(s.src_page_ids, s.dest.page_ids)
        except ValueError:
            raise UseAgent() from None
        if not runs or len(runs) > MAX_RUNS:
            raise UseAgent()
        if s.dest.fingerprint is not None:
            expect_same(self._fingerprint, s.dest.fingerprint, "source", "destination")
        return runs

    def _header(self, s: LaneSend, runs: list[PageRun]) -> WriteHeader:
        return WriteHeader(
            xfer_id=random.getrandbits(36), ticket=s.ticket, dst_agent_epoch=s.dest.agent_epoch,
            dst_pool_id=s.dest.pool_id, fingerprint=self._fingerprint,
            page_bytes=self._page_bytes, dst_runs=tuple((r.dst_start, r.num_pages) for r in runs),
            timeout_ms=s.timeout_s * 1e3, traceparent=tracing.traceparent(),
            sender=s.route.sender)

    def copy(self, s: LaneSend) -> TransferReport:
        """One handoff over the lane (finishing one `prepare` made ready, which `begin` may have
        started); UseAgent when it cannot take it."""
        begun = s.started()
        started = (begun.prepared.pushed_at if begun else 0.0) or time.perf_counter()
        if begun is None:
            failpoints.hit("kv.send", s.ticket.request_id)
            try:
                runs = self._runs(s)
            except KvTransferError as exc:
                self._fail(exc)
        route, dest = s.route, s.dest
        transport = "tcp" if route.tcp_address else "shm"
        with send_span(route.sender, s.ticket.request_id, dest.agent_address,
                       len(s.src_page_ids)) as span:
            if begun is not None:
                runs, header, prepared = begun.runs, begun.header, begun.prepared
            else:
                header, prepared = self._header(s, runs), None
            if route.tcp_address:
                self._over_tcp(s, header, runs, prepared)
            else:
                self._over_shm(s, header, runs)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            report = TransferReport(elapsed_ms, header.kv_bytes, len(s.src_page_ids),
                                    transport, len(runs), elapsed_ms)
            span.report(report)
        with self._lock:
            self.copied += 1
        self._options.on_sent(transport)
        s.note = {"op": "sent", "ok": True, "transport": transport, "kv_bytes": report.kv_bytes,
                  "kv_pages": report.kv_pages, "seconds": elapsed_ms / 1e3,
                  "peer": route.agent_id}  # told to this host's agent in `settle`
        return report

    def _over_shm(self, s: LaneSend, header: WriteHeader, runs: list[PageRun]) -> None:
        route, dest = s.route, s.dest
        sock, carried = self._checkout(s)
        s.attach(sock)
        reusable = False
        try:
            message, fds, keys = self._message(runs, carried)
            reply = request_copy(sock, message, header, fds, time.monotonic() + s.timeout_s,
                                 lambda: None, f"agent {route.agent_id}")
            carried |= keys
            reusable = True
        except PeerUnavailable as exc:  # the connection broke: the agent sorts it out
            if s.cancelled:
                raise Aborted("the KV handoff was cancelled") from None
            log.info("same-host lane to agent %s: %s; sending through the agent",
                     route.agent_id, exc.message)
            raise UseAgent() from None
        except KvTransferError as exc:  # timed out
            self._fail(exc)
        finally:
            s.attach(None)
            self._checkin(route, sock, carried, reusable and not s.cancelled)
        try:
            raise_refusal(reply)
        except SegmentUnavailable as exc:
            self._remember((dest.agent_address, dest.agent_epoch), None)
            log.info("agent %s cannot copy from this worker's pool (%s): handoffs to it go "
                     "through this host's agent", route.agent_id, exc.message)
            raise UseAgent() from None
        except KvTransferError as exc:
            self._fail(exc)

    def _over_tcp(self, s: LaneSend, header: WriteHeader, runs: list[PageRun],
                  begun: Prepared | None = None) -> None:
        assert self._tcp is not None
        route, dest = s.route, s.dest
        sender = self._tcp.sender(route.write_bytes, route.buffer_bytes)
        try:
            self._tcp.send(sender, route.tcp_address, header, runs, s.timeout_s,
                           dest.agent_address, s.attach, begun)
        except PeerUnavailable as exc:
            if s.cancelled:
                raise Aborted("the KV handoff was cancelled") from None
            sender.forget(route.tcp_address)
            if not exc.retryable:
                self._fail(exc)
            # nothing was acknowledged (typically an idle connection gone stale): the agent
            # tries again on a fresh connection, or names what is wrong
            log.info("lane to agent %s: %s; sending through this host's agent",
                     route.agent_id, exc.message)
            raise UseAgent() from None
        except KvTransferError as exc:  # a refusal, a stale epoch, or timed out
            self._fail(exc)

    def _fail(self, exc: KvTransferError) -> NoReturn:
        """The handoff's error, as the agent would have given it (and counted by it)."""
        self._agent.note({"op": "sent", "ok": False, "cause": cause(exc)})
        raise ServiceError(f"KV handoff failed: {exc.message}", status_name(exc)) from None

    def _message(self, runs: list[PageRun], carried: set[str]
                 ) -> tuple[dict[str, Any], tuple[int, ...], set[str]]:
        """The shm_write for `runs`, the descriptors of the pools the connection has not carried
        yet, and the pools it carries after."""
        message = write_message(self.pool_key, self._num_pages, runs)
        r = self._relayout
        if r is None:
            fds = () if self.pool_key in carried else (self.readonly_fd,)
            return message, fds, {self.pool_key}
        new = [(key, fd) for key, fd in r.sources if key not in carried]
        message.update(columns=[c.to_json() for c in r.columns], row_bytes=r.row_bytes,
                       maps=[key for key, _ in new])
        return message, tuple(fd for _, fd in new), {key for key, _ in r.sources}

    def note(self, message: dict[str, object]) -> None:
        self._agent.note(message)

    def _checkout(self, s: LaneSend) -> tuple[socket.socket, set[str]]:
        """A connection to the route's agent, and the pools it has carried (a pool's descriptor
        goes with the first write from it)."""
        with self._lock:
            idle = self._idle.get(s.route.local_socket)
            if idle:
                return idle.pop()
        try:
            return open_connection(s.route.local_socket, s.route.token,
                                   lambda: s.route.token), set()
        except SegmentUnavailable as exc:
            log.info("agent %s is not reachable on this host (%s): handoffs to it go through "
                     "this host's agent%s", s.route.agent_id, exc.message,
                     " or over the network" if self._tcp is not None else "")
            if self._tcp is not None:
                self.route(s.dest, remote=True)  # the network route next time, if offered
            else:
                self._remember((s.dest.agent_address, s.dest.agent_epoch), None)
            raise UseAgent() from None

    def _checkin(self, route: Route, sock: socket.socket, carried: set[str], reusable: bool
                 ) -> None:
        with self._lock:
            idle = self._idle.setdefault(route.local_socket, [])
            if reusable and len(idle) < MAX_IDLE_PER_PEER:
                idle.append((sock, carried))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _ in conns:
                sock.close()
        if self._tcp is not None:
            self._tcp.close()
        os.close(self.readonly_fd)
