"""The same-host path: the receiving agent copies pages straight out of the sender's pool.

Two agents are on one host when the sender can reach the receiver's local socket (published
in its AgentInfo) and finds there the receiver's `local_token` (also published, over gRPC):
then the socket is really that agent's, on this kernel, and a descriptor can cross it.
Nothing is configured: agents in two network namespaces of one machine are two hosts unless
the socket really is shared (an abstract-namespace socket never is; a path is when both see
the same file).

    sender agent                                        receiving agent
    hello ─────────────── local socket ─────────────▶  its token  (mismatch: not this host)
    shm_write(src runs, WriteHeader) [+ read-only fd] ▶  map the sender's pool read-only once
                                                        per connection; accept (ticket, epoch,
                                                        layout, pages, grant) -> one memory copy
                                                        per run into the reserved pages,
                                  ◀───────────────────  stopping at a cancel; finish; reply

Every guarantee of the other transports holds, because the write goes through the same sink
(`accept` / `finish`): nothing lands before `accept`, nothing after `finish`, a cancel waits
for the copy to stop. A peer that cannot be used (socket unreachable, token mismatch, the
pool not mappable there) raises SegmentUnavailable: the agent falls back to UCX / TCP and
remembers the peer as remote for that epoch. The receiver's mapping of a sender's pool lives
as long as the connection it came on; the sender closes its connections that carried a pool
when the pool goes, so no mapping outlives its worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pdserve.common import fastcopy
from pdserve.common.kv.errors import (
    BadRequest,
    KvTransferError,
    SegmentUnavailable,
    TicketCancelled,
    TransferTimeout,
)
from pdserve.common.kv.relayout import copy_run, parse_columns
from pdserve.common.kv.runs import PageRun
from pdserve.common.kv.samehost import (
    open_connection,
    raise_refusal,
    request_copy,
    write_message,
)
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.shm import SharedSegment
from pdserve.kvtransfer import native
from pdserve.kvtransfer.native import NativeReceiver
from pdserve.kvtransfer.peers import PeerDirectory, PeerInfo
from pdserve.kvtransfer.pool import Pool, map_fd
from pdserve.kvtransfer.transport import Landed, WriteSink

log = logging.getLogger("pdserve.kvtransfer.shm")

CONNECT_TIMEOUT_S = 2.0
COPY_SLICE_BYTES = 8 << 20  # a cancel is noticed between slices of one run's copy
MAX_IDLE_PER_PEER = 4


@dataclass
class _Conn:
    sock: Any
    address: str  # the peer's gRPC address
    sent_pools: set[str] = field(default_factory=set)  # pools whose fd this connection carried


class ShmSender:
    """Connections to same-host peers and the send half of the protocol; thread-safe."""

    def __init__(self, agent_id: str, peers: PeerDirectory):
        self._agent_id = agent_id
        self._peers = peers
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = {}
        self._remote: dict[str, int] = {}  # peer address -> epoch at which it proved remote
        self._gone: set[str] = set()  # pools dropped; connections that carried them close

    def usable(self, peer: PeerInfo) -> bool:
        with self._lock:
            remote = self._remote.get(peer.address) == peer.epoch
        return peer.same_host_copy and bool(peer.local_socket) and not remote

    def mark_remote(self, peer: PeerInfo) -> None:
        with self._lock:
            self._remote[peer.address] = peer.epoch
        self.forget(peer.address)

    def send(self, peer: PeerInfo, header: WriteHeader, pool: Pool, runs: list[PageRun],
             deadline: float, liveness: Callable[[], None]) -> None:
        """One handoff by same-host copy; returns once every page is resident there. Raises
        SegmentUnavailable to fall back, else the receiver's refusal (or a timeout)."""
        conn = self._checkout(peer)
        in_step = False
        try:
            fds: tuple[int, ...] = ()
            if pool.pool_id not in conn.sent_pools:
                fds = (pool.readonly_fd(),)
            reply = request_copy(conn.sock, write_message(pool.pool_id, pool.num_pages, runs),
                                 header, fds, deadline, liveness, f"agent {peer.agent_id}")
            conn.sent_pools.add(pool.pool_id)
            in_step = True
        finally:
            self._checkin(conn, in_step)
        raise_refusal(reply)

    def forget(self, address: str) -> None:
        """Close the idle connections to a peer (it restarted, failed, or proved remote)."""
        with self._lock:
            conns = self._idle.pop(address, [])
        for conn in conns:
            conn.sock.close()

    def forget_pool(self, pool_id: str) -> None:
        """The pool is gone: close every connection that carried it (the peers unmap it)."""
        with self._lock:
            self._gone.add(pool_id)
            closing = [c for conns in self._idle.values() for c in conns
                       if pool_id in c.sent_pools]
            for conns in self._idle.values():
                conns[:] = [c for c in conns if pool_id not in c.sent_pools]
        for conn in closing:
            conn.sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()

    def _checkout(self, peer: PeerInfo) -> _Conn:
        with self._lock:
            idle = self._idle.get(peer.address)
            if idle:
                return idle.pop()
        sock = open_connection(peer.local_socket, peer.local_token,
                               lambda: self._peers.refresh(peer.address).local_token)
        return _Conn(sock, peer.address)

    def _checkin(self, conn: _Conn, reusable: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.address, [])
            if reusable and not (conn.sent_pools & self._gone) and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(conn)
                return
        conn.sock.close()


_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it (EINVAL) and nothing happens


def _prefault_in_background(view: np.ndarray) -> None:
    """Map the page tables of the sender's whole pool in a background thread, so later copies
    take no page faults, while the first copy goes on at once (populating a 256 MiB pool takes
    ~40 ms). The pool's pages exist already (the sending agent holds them populated): this takes
    no memory. ctypes calls drop the GIL; a mapping closed meanwhile only makes madvise fail."""
    address, length = view.ctypes.data, view.nbytes

    def populate() -> None:
        _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_POPULATE_READ)

    threading.Thread(target=populate, name="shm-prefault", daemon=True).start()


_LIBC = ctypes.CDLL(None, use_errno=True)


class ShmReceiver:
    """The receiving half, one per local connection: the sender pools mapped on it.

    A write of a ticket armed for it is served by the native path (native.py: checks, copy,
    reply on `fd`, without the interpreter); `landed(header, error)` then counts it. Any other
    write, and any the native path declines, goes through the sink here."""

    def __init__(self, sink: Callable[[], WriteSink], native_writes: NativeReceiver | None = None,
                 fd: int = -1,
                 landed: Landed | None = None):
        self._sink = sink
        self._maps: dict[str, _Mapped] = {}
        self._native = native_writes if fd >= 0 and landed is not None else None
        self._fd = fd
        self._landed = landed
        self._out = native.out_buffer()

    def write(self, message: dict[str, Any], payload: bytes, fds: list[int]
              ) -> dict[str, Any] | None:
        """Serve one shm_write; returns the reply (an error reply names the refusal), or None
        when the native path has sent it."""
        if self._native is not None and not fds and "columns" not in message:
            mapped = self._maps.get(message.get("src_pool", ""))
            if mapped is not None:
                done = self._native.write(payload, mapped.address, mapped.data.nbytes,
                                          message.get("src_runs"), self._fd, COPY_SLICE_BYTES,
                                          self._out)
                if done != native.DECLINED:
                    return self._native_done(done, payload)
        try:
            try:
                header = WriteHeader.decode(payload)
            except KvTransferError:
                for fd in fds:
                    os.close(fd)
                raise
            if "columns" in message:
                self._relayout(message, header, fds)
                return {}
            src = self._source(message, fds, header.page_bytes)
            runs = _runs(message, header, src.num_pages)

            def plain(start: int, dst: np.ndarray, address: int, stop: Callable[[], bool]
                      ) -> bool:
                offset = start * header.page_bytes
                return fastcopy.copy_in_slices(dst, src.data[offset:offset + dst.size],
                                               header.kv_bytes, COPY_SLICE_BYTES, stop,
                                               (address, src.address + offset))
            self._copy(header, runs, plain)
            return {}
        except KvTransferError as exc:
            return {"error": type(exc).__name__, "message": exc.message}

    def _native_done(self, done: int, payload: bytes) -> dict[str, Any] | None:
        """After a native write (its reply, if any, is sent): count it; the reply to send."""
        assert self._landed is not None
        try:  # it matched an armed ticket, so it is well formed; if not, it goes uncounted
            header: WriteHeader | None = WriteHeader.decode(payload)
        except KvTransferError:
            header = None
        if done == native.STOPPED:
            exc = TicketCancelled(f"ticket {header.ticket if header else '?'} was cancelled "
                                  "during its write")
            if header is not None:
                self._landed(header, exc)
            return {"error": type(exc).__name__, "message": exc.message}
        if header is not None:
            self._landed(header, None)
        if done == native.SEND_FAILED:
            raise OSError("the reply to a same-host write could not be sent")
        return None  # the native path replied

    def _source(self, message: dict[str, Any], fds: list[int], page_bytes: int) -> _Mapped:
        key = str(message.get("src_pool", ""))
        if fds:
            for fd in fds[1:]:
                os.close(fd)
            try:
                num_pages = int(message["src_num_pages"])
            except (KeyError, ValueError, TypeError):
                os.close(fds[0])
                raise BadRequest("malformed same-host write: src_num_pages") from None
            self._map(key, fds[0], num_pages, page_bytes)
        found = self._maps.get(key)
        if found is None:
            raise SegmentUnavailable(f"pool {key!r} was never mapped on this connection")
        return found

    def _map(self, key: str, fd: int, num_pages: int, page_bytes: int) -> None:
        """Map a sender's pool under `key` on this connection (it owns `fd`), replacing what
        was mapped there."""
        old = self._maps.pop(key, None)
        if old is not None:
            old.segment.close()
        try:  # map_fd owns the descriptor (closes it when it cannot map it)
            segment = map_fd(fd, num_pages, page_bytes, writable=False)
        except KvTransferError as exc:
            raise SegmentUnavailable(f"the sender's pool cannot be mapped here: "
                                     f"{exc.message}") from None
        self._maps[key] = _Mapped(segment, num_pages)
        _prefault_in_background(self._maps[key].data)

    def _relayout(self, message: dict[str, Any], header: WriteHeader, fds: list[int]) -> None:
        """A write that re-lays its pages out between tensor-parallel splits (relayout.py)."""
        try:
            row_bytes, columns = parse_columns(message, header.page_bytes)
            keys = [str(k) for k in message.get("maps", [])]
            if len(keys) != len(fds):
                raise BadRequest(f"re-layout write: {len(fds)} descriptors for {len(keys)} pools")
        except BadRequest:
            for fd in fds:
                os.close(fd)
            raise
        specs = {c.pool: c for c in columns}
        for n, (key, fd) in enumerate(zip(keys, fds)):
            try:
                if key not in specs:
                    os.close(fd)
                    raise BadRequest(f"re-layout write maps pool {key!r}, which no column reads")
                self._map(key, fd, specs[key].num_pages, specs[key].page_bytes)  # owns fd
            except KvTransferError:
                for rest in fds[n + 1:]:
                    os.close(rest)
                raise
        sources = []
        for c in columns:
            found = self._maps.get(c.pool)
            if found is None:
                raise SegmentUnavailable(f"pool {c.pool!r} was never mapped on this connection")
            sources.append(found)
        runs = _runs(message, header, min(m.num_pages for m in sources))

        def gather(start: int, dst: np.ndarray, _address: int, stop: Callable[[], bool]
                   ) -> bool:
            return copy_run(dst, row_bytes, [m.data for m in sources], columns, start,
                            header.kv_bytes, COPY_SLICE_BYTES, stop)
        self._copy(header, runs, gather)

    def _copy(self, header: WriteHeader, runs: list[tuple[int, int]],
              copy_one: Callable[[int, np.ndarray, int, Callable[[], bool]], bool]) -> None:
        """Accept the write, `copy_one(src start, dst view, dst address, stop)` each run,
        finish it."""
        sink = self._sink()
        write = sink.accept(header)  # nothing is written unless this returns
        ok = True
        try:
            addresses = write.dst_addresses or [dst.ctypes.data for dst in write.dst_views]
            for (start, _), dst, address in zip(runs, write.dst_views, addresses):
                ok = copy_one(start, dst, address, write.abort.is_set)
                if not ok:
                    break
        except BaseException:
            sink.finish(write, False)
            raise
        sink.finish(write, ok)  # raises TicketCancelled after a cancel: the reply says so
        if not ok:
            raise TransferTimeout("the handoff stopped before all its bytes arrived")

    def close(self) -> None:
        """Unmap every sender pool mapped on this connection (no copy is running: the
        connection's one thread calls this)."""
        for mapped in self._maps.values():
            mapped.segment.close()
        self._maps.clear()


class _Mapped:
    """A sender's pool mapped on one connection: the segment, its bytes, its page count."""

    def __init__(self, segment: SharedSegment, num_pages: int):
        self.segment = segment
        self.data = np.frombuffer(segment.buffer, dtype=np.uint8)
        self.address = self.data.ctypes.data
        self.num_pages = num_pages


def _runs(message: dict[str, Any], header: WriteHeader, num_pages: int
          ) -> list[tuple[int, int]]:
    """The write's source runs, checked against the destination runs and the sender's pool
    as it was mapped (`num_pages`)."""
    try:
        runs = [(int(a), int(b)) for a, b in message["src_runs"]]
    except (KeyError, ValueError, TypeError) as exc:
        raise BadRequest(f"malformed same-host write: {exc}") from None
    if len(runs) != len(header.dst_runs) or any(
            n != m for (_, n), (_, m) in zip(runs, header.dst_runs)):
        raise BadRequest("source runs do not match the destination runs")
    for start, n in runs:
        if start < 0 or n <= 0 or start + n > num_pages:
            raise BadRequest(f"source pages {start}..{start + n - 1} are outside the sender's "
                             f"pool (0..{num_pages - 1})")
    return runs
