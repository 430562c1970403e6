"""The agent's local socket: its workers' fast lane, and the same-host path's receiving end.

One Unix socket per agent (`--local-socket`; pdserve.common.localsock for the framing). A
worker connects, checks the agent's token (`hello`), and hands over its pool: `register`
carries the nameless segment's descriptor, the agent maps it without a copy and keeps the
pool exactly as long as that connection lives: when the worker exits, whatever kills it, the
kernel closes the connection, the agent drops the pool and unmaps it, and the memory is gone
(nothing ever had a name in /dev/shm). The per-handoff calls go here too, one round trip on a
Unix socket instead of a gRPC call each: `expect`, `cancel`, `status` (decode) and `send`
(prefill). Peer agents on the same host send `shm_write` here (see shm.py), and so do prefill
workers of this host that hand pages to this agent's pools themselves
(pdserve.worker.samehost): their own agent tells them which destinations qualify and how
(`peer`: the same-host copy, or plain TCP to another host's agent), whether a destination
still lives while they wait on it (`alive`), and they tell it what they sent (`sent`, a note:
no reply).

Requests and replies are JSON objects; an error reply is {"error": class name, "code": gRPC
status name, "message": ...}. Only processes of this agent's user (or root) are served.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.common import localsock, tracing
from pdserve.common.handoff import (
    destination_from_json,
    fingerprint_from_json,
    report_to_json,
    ticket_from_json,
)
from pdserve.common.kv.errors import (
    BadRequest,
    KvTransferError,
    PeerUnavailable,
    StaleEpoch,
    status_name,
)
from pdserve.common.kv.spans import send_span
from pdserve.kvtransfer.pool import map_fd
from pdserve.kvtransfer.shm import ShmReceiver

if TYPE_CHECKING:
    from pdserve.kvtransfer.agent import Agent

log = logging.getLogger("pdserve.kvtransfer.local")
_FD_OPS = frozenset({"register", "shm_write"})
_NOTES = frozenset({"sent"})  # answered with nothing: the sender does not wait


def default_address(port: int) -> str:
    """The socket an agent listens on when none is configured: in the abstract namespace, so
    agents in two network namespaces never see each other's (two hosts, as they should be)."""
    return f"@pdserve-kvtransfer-{port or os.getpid()}"


class _Connection:
    """What one local connection holds: the pools registered on it, the peer pools mapped."""

    def __init__(self, agent: Agent, sock: socket.socket):
        self.pools: list[str] = []
        self.shm = ShmReceiver(lambda: agent.shm_sink, agent.native, sock.fileno(),
                               agent.native_write_landed)


class LocalServer:
    def __init__(self, agent: Agent, address: str):
        self._agent = agent
        self.address = address
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-local-accept",
                                        daemon=True)
        self._ops: dict[str, Callable[[dict[str, Any], bytes, list[int], _Connection],
                                      dict[str, Any] | None]] = {
            "hello": self._hello, "register": self._register, "expect": self._expect,
            "cancel": self._cancel, "status": self._status, "send": self._send,
            "shm_write": lambda m, p, f, c: c.shm.write(m, p, f),
            "peer": self._peer, "alive": self._alive, "sent": self._sent,
        }

    def start(self) -> None:
        self._listener = localsock.listen(self.address)
        self._thread.start()
        log.info("local socket %s", self.address)

    def close(self) -> None:
        """Stop accepting, hang up on every connection (their pools are dropped)."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)
        if not self.address.startswith("@"):
            try:
                os.unlink(self.address)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-local-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.add(sock)
        state = _Connection(self._agent, sock)
        try:
            localsock.check_peer(sock)
            while not self._stopping.is_set():
                message, payload, fds = localsock.recv(sock)
                reply = self._dispatch(message, payload, fds, state)
                if reply is not None and message.get("op") not in _NOTES:  # None: sent
                    localsock.send(sock, reply)
        except PermissionError as exc:
            log.warning("refused a local connection: %s", exc)
        except (OSError, localsock.Closed, ValueError):
            pass  # the worker or peer went away (or spoke nonsense): drop what it held
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()
            state.shm.close()
            for pool_id in state.pools:
                self._agent.drop_pool(pool_id)

    def _dispatch(self, message: dict[str, Any], payload: bytes, fds: list[int],
                  state: _Connection) -> dict[str, Any] | None:
        """The reply to send (None: the op sent it itself)."""
        name = str(message.get("op"))
        if name not in _FD_OPS:  # only these take (and own) descriptors
            for fd in fds:
                os.close(fd)
            fds = []
        try:
            op = self._ops.get(name)
            if op is None:
                raise BadRequest(f"unknown local operation {name!r}")
            return op(message, payload, fds, state)
        except KvTransferError as exc:
            return _error(exc)
        except (KeyError, ValueError, TypeError) as exc:
            return _error(BadRequest(f"malformed {name} request: {exc!r}"))

    # ---- operations -------------------------------------------------------------------
    def _hello(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
               ) -> dict[str, Any]:
        a = self._agent
        return {"agent_id": a.agent_id, "epoch": a.epoch, "token": a.local_token.hex()}

    def _register(self, m: dict[str, Any], p: bytes, fds: list[int], c: _Connection
                  ) -> dict[str, Any]:
        try:
            if len(fds) != 1:
                raise BadRequest(f"register carries the pool's descriptor (got {len(fds)})")
            worker_id, num_pages, page_bytes = str(m["worker_id"]), int(m["num_pages"]), \
                int(m["page_bytes"])
            try:
                fingerprint = fingerprint_from_json(m["fingerprint"])
            except (KeyError, ValueError, TypeError) as exc:
                raise BadRequest(f"fingerprint: {exc}") from None
            if fingerprint is None:
                raise BadRequest("fingerprint is required")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        segment = map_fd(fds[0], num_pages, page_bytes, populate=True)  # owns the descriptor
        pool = self._agent.add_pool(worker_id, segment, num_pages, page_bytes, fingerprint)
        c.pools.append(pool.pool_id)
        return {"pool_id": pool.pool_id, "agent_epoch": self._agent.epoch,
                "agent_id": self._agent.agent_id}

    def _expect(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
                ) -> dict[str, Any]:
        epoch = self._agent.expect(_ticket(m), str(m["pool_id"]),
                                   [int(x) for x in m["page_ids"]], float(m["lease_ms"]))
        return {"agent_epoch": epoch}

    def _cancel(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
                ) -> dict[str, Any]:
        was_pending, was_complete = self._agent.cancel(_ticket(m))
        return {"was_pending": was_pending, "was_complete": was_complete}

    def _status(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
                ) -> dict[str, Any]:
        status = self._agent.status(_ticket(m))
        return {"complete": status.complete, "kv_bytes": status.kv_bytes,
                "completed_unix_ms": status.completed_unix_ms}

    def _send(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
              ) -> dict[str, Any]:
        key = _ticket(m)
        dest = destination_from_json(m["destination"])
        pages = [int(x) for x in m["src_page_ids"]]
        with send_span(self._agent.agent_id, key.request_id, dest.agent_address, len(pages),
                       tracing.context_from_traceparent(str(m.get("traceparent", "")))) as span:
            report = self._agent.send_pages(key, str(m["src_pool_id"]), pages, dest,
                                            float(m.get("timeout_ms", 0)))
            span.report(report)
        return {"report": report_to_json(report)}


    def _peer(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
              ) -> dict[str, Any]:
        """May a worker of this host send to the agent at `address` (epoch `epoch`) itself, and
        how? Over the same-host copy where this agent would use it; over the network
        transport (`tcp_address`) where that is plain TCP and the worker asks for it (`network`).
        Never when writes need a grant (under mutual TLS only agents hold grants). `remote`:
        the worker found that agent's local socket unreachable from this host; `same_host`
        false: the worker does not copy on this host itself."""
        a = self._agent
        address, epoch = str(m["address"]), int(m["epoch"])
        if a.ask_grants or epoch == a.epoch:
            return {"usable": False}
        peer = a.peers.lookup(address, epoch)
        if a.shm is not None and m.get("remote") and a.shm.usable(peer):
            a.shm.mark_remote(peer)
            log.info("agent %s at %s is not reachable on this host (a worker here cannot reach "
                     "its local socket %s): handoffs to it go over %s", peer.agent_id,
                     peer.address, peer.local_socket, a.transport.name)
        if m.get("same_host", True) and a.shm is not None and a.shm.usable(peer):
            return {"usable": True, "agent_id": peer.agent_id, "local_socket": peer.local_socket,
                    "local_token": peer.local_token.hex(), "sender": a.agent_id}
        terms = a.transport.lane_terms()
        if not m.get("network") or terms is None or peer.transport != a.transport.name:
            return {"usable": False}
        return {"usable": True, "agent_id": peer.agent_id, "sender": a.agent_id,
                "tcp_address": peer.contact.tcp_address, **terms}

    def _alive(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
               ) -> dict[str, Any]:
        """Is the agent at `address` still there at `epoch`? (A worker's own lane waiting on
        it asks now and then, as this agent's sender does.)"""
        try:
            self._agent.peers.check(str(m["address"]), int(m["epoch"]))
        except StaleEpoch as exc:
            return {"alive": False, "stale": True, "message": exc.message}
        except PeerUnavailable as exc:
            return {"alive": False, "stale": False, "message": exc.message}
        return {"alive": True, "stale": False, "message": ""}

    def _sent(self, m: dict[str, Any], p: bytes, f: list[int], c: _Connection
              ) -> dict[str, Any]:
        """A worker's note of a handoff it made itself: counted as this agent's own."""
        a = self._agent
        if m.get("ok"):
            a.metrics.sent(str(m["transport"]), int(m["kv_bytes"]), int(m["kv_pages"]),
                           float(m["seconds"]), str(m["peer"]))
        else:
            a.metrics.failed(str(m["cause"]), "send")
        return {}


def _ticket(m: dict[str, Any]) -> Any:
    key = ticket_from_json(m["ticket"])
    if not key.request_id:
        raise BadRequest("ticket.request_id is empty")
    return key


def _error(exc: KvTransferError) -> dict[str, Any]:
    return {"error": type(exc).__name__, "code": status_name(exc), "message": exc.message}
