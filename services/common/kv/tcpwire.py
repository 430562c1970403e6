"""The TCP data path's wire, both ends' socket calls, and its sending half (`TcpSender`):
used by an agent's TCP transport (pdserve.kvtransfer.tcp, which also has the receiving half)
and by a prefill worker's own lane to another host's agent (pdserve.worker.samehost).

A handoff on a connection: header and its head -> reply "ready" -> the rest of the runs' bytes
back to back -> reply "done". The head, the first EAGER_BYTES of the bytes, goes right behind the
header without waiting for "ready", so the round trip to the receiver overlaps writing it: a
handoff of at most EAGER_BYTES is all head and gets one reply ("done"), one round trip and two
wake-ups less on the latency that matters (a short prompt's pages); a larger one writes its
first MiB while "ready" is on its way (~0.15-0.2 ms of a 24 MiB handoff's ~6 ms across a veth).
A receiver that refuses a handoff answers the refusal at once and then reads the head away, so
the stream stays in step; a refused large handoff wastes at most EAGER_BYTES of the link.

Throughput (measured across a veth between two network namespaces on a 2-vCPU VM, where one
stream is bound by the CPU's copies): a run goes out in writes of `write_bytes` (512 KiB), not
in one call. One write of a whole 96 MiB run holds the socket's lock until the run is queued,
so the ACKs arriving meanwhile wait in the socket's backlog and the window opens late: 1.9-2.1
GB/s against 2.8-3.7 GB/s for 512 KiB-1 MiB writes (256 KiB: 1.7; 4 MiB: 2.7). Plain
connections then block in the kernel in slices of SLICE_S (SO_RCVTIMEO / SO_SNDTIMEO) between
checks of deadlines and aborts, and a run is read with MSG_WAITALL: one call lands a slice's
worth of bytes instead of a poll and a call per few hundred KiB. Socket buffers are the kernel's
autotuned ones unless `buffer_bytes` is set.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from pdserve.common.kv.errors import PeerUnavailable, TransferTimeout
from pdserve.common.kv.wire import LIVENESS_INTERVAL_S, Liveness, Reply, WriteHeader

SLICE_S = 0.05  # socket timeout between checks of deadlines, aborts and shutdown
LENGTH = struct.Struct("<I")
DEFAULT_WRITE_BYTES = 512 << 10  # one send() of a run (see the module docstring)
# The head of every handoff, written before "ready" (a refusal wastes it); handoffs up to this
# size are all head and do not wait for "ready" at all: across a veth a 0.38 MiB page 0.32-0.35
# ms against 0.46-0.57 in the agents; SmolLM2's 0.70 MiB page through the request path 1.36 /
# 1.36 ms against 1.58 / 1.59 at 512 KiB (alternating runs, each host on its own vCPU;
# docs/kv-transfer.md).
EAGER_BYTES = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
# A receiver reading a run asks to be woken once this much has arrived (SO_RCVLOWAT), not at
# every segment: on a veth each wake-up is an interrupt to the other vCPU. Back to back across a
# veth on a 2-vCPU VM (24 / 96 MiB handoffs): 128 KiB 3.56-3.65 / 3.86-4.35 GB/s, 256 KiB
# 4.39-4.62 / 4.58-4.92, 512 KiB 4.05-4.27 / 3.53-3.66; 1-2 MiB were slower still in
# `pdserve bench kv --netns`; waking per segment 2.79 / 2.65 (docs/kv-transfer.md).
DEFAULT_RCVLOWAT = 256 << 10
_SCRATCH_BYTES = 1 << 20
_MAX_PIECES = 1024  # buffers in one sendmsg (IOV_MAX)


def head_bytes(kv_bytes: int) -> int:
    """How many of a handoff's `kv_bytes` follow its header before "ready": the head."""
    return min(kv_bytes, EAGER_BYTES)


def split_views(views: Sequence[np.ndarray], nbytes: int) -> tuple[list[memoryview],
                                                                    list[memoryview]]:
    """`views` as bytes, cut after their first `nbytes`: (before, after)."""
    before: list[memoryview] = []
    after: list[memoryview] = []
    for view in views:
        data = view.data.cast("B")
        take = min(nbytes, len(data))
        if take:
            before.append(data[:take])
        if take < len(data):
            after.append(data[take:])
        nbytes -= take
    return before, after


class Closed(Exception):
    """The peer closed the connection."""


class Stopped(Exception):
    """The ticket was cancelled while its bytes were arriving; `got` bytes of the current
    buffer had landed."""

    def __init__(self, got: int):
        super().__init__(f"aborted after {got} bytes")
        self.got = got


class Prepared:
    """An eager handoff made ready by `TcpSender.prepare`: its connection, its bytes (header
    first) and how many of them are written; `push` writes what the socket takes at once."""

    def __init__(self, conn: socket.socket, pieces: list[memoryview]):
        self.conn, self.pieces, self.sent = conn, pieces, 0
        self.broken = False  # a write failed: the connection is closed, `send` starts over
        self.pushed_at = 0.0  # perf_counter of the first push

    def push(self) -> None:
        """Write as many of the bytes as the socket takes without waiting, in one call."""
        self.pushed_at = self.pushed_at or time.perf_counter()
        try:
            self.sent += self.conn.sendmsg(self.rest(), (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError:
            self.broken = True
            self.conn.close()

    def rest(self) -> list[memoryview]:
        """The bytes not written yet."""
        skip, rest = self.sent, []
        for piece in self.pieces:
            if skip < len(piece):
                rest.append(piece[skip:])
            skip = max(0, skip - len(piece))
        return rest


class TcpSender:
    """Handoffs to other agents' TCP data ports, a few idle connections kept per peer
    (thread-safe)."""

    def __init__(self, max_idle_per_peer: int = 4, client_tls: ssl.SSLContext | None = None,
                 tls_server_name: str = "", buffer_bytes: int = 0,
                 write_bytes: int = DEFAULT_WRITE_BYTES):
        if write_bytes <= 0 or buffer_bytes < 0:
            raise ValueError(f"write_bytes {write_bytes} must be > 0, buffer_bytes "
                             f"{buffer_bytes} >= 0")
        self.buffer_bytes = buffer_bytes
        self.write_bytes = write_bytes
        self.client_tls = client_tls
        self._tls_server_name = tls_server_name
        self._max_idle = max_idle_per_peer
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def prepare(self, address: str, header: WriteHeader, src_views: Sequence[np.ndarray],
                timeout_s: float) -> Prepared | None:
        """An eager handoff ready to go: a connection taken and its bytes laid out, so that
        `Prepared.push` only writes; `send` with it writes the rest and waits for the reply.
        None where it cannot be (not eager, TLS, no connection)."""
        if header.kv_bytes > EAGER_BYTES or self.client_tls is not None \
                or len(src_views) >= _MAX_PIECES:
            return None
        try:
            conn = self._checkout(address, time.monotonic() + min(timeout_s, 5.0))
        except PeerUnavailable:
            return None  # `send` tries again, and says why
        return Prepared(conn, [memoryview(header.encode()),
                               *(v.data.cast("B") for v in src_views)])

    def send(self, address: str, header: WriteHeader, src_views: Sequence[np.ndarray],
             timeout_s: float, liveness: Liveness | None = None,
             attach: Callable[[socket.socket | None], None] = lambda conn: None,
             begun: Prepared | None = None) -> None:
        """One handoff to the data port at `address` ("host:port"), or the rest of a prepared
        one (`begun`); returns once the receiver said every byte landed. PeerUnavailable
        (retryable when nothing was acknowledged), TransferTimeout, or the receiver's refusal.
        `attach` is told the connection while it is in use (hanging it up stops it)."""
        deadline = time.monotonic() + timeout_s
        begun = None if begun is None or begun.broken else begun
        conn = self._checkout(address, deadline) if begun is None else begun.conn
        attach(conn)
        eager = header.kv_bytes <= EAGER_BYTES
        # a prepared handoff is eager: all of it is in `begun`, nothing follows "ready"
        head, rest = ([], []) if begun is not None else \
            split_views(src_views, head_bytes(header.kv_bytes))
        reusable = False
        try:
            try:
                # the head right behind the header; eager (all head): one reply says how it went
                pieces: Sequence[bytes | memoryview] = (
                    begun.rest() if begun is not None else [header.encode(), *head])
                for piece in pieces:
                    send_all(conn, piece, deadline, liveness, self.write_bytes)
                ready = None if eager else read_reply(conn, deadline, liveness)
            except (OSError, Closed) as exc:
                # no reply yet: nothing was acknowledged (typically an idle connection the
                # receiver closed), so the handoff may be tried again on a fresh one
                raise PeerUnavailable(f"TCP connection to {address} failed before the "
                                      f"receiver answered: {exc}", retryable=True) from None
            if ready is not None:
                reusable = True
                ready.raise_if_error()
                reusable = False
            try:
                for piece in rest:
                    send_all(conn, piece, deadline, liveness, self.write_bytes)
                done = read_reply(conn, deadline, liveness)
            except (OSError, Closed) as exc:
                # eager: still no reply at all, as above (a retry rewrites the same bytes; a
                # receiver that had finished the ticket refuses it cleanly)
                raise PeerUnavailable(f"TCP connection to {address} failed during the "
                                      f"handoff: {exc}", retryable=eager) from None
            reusable = True
            done.raise_if_error()
        finally:
            attach(None)
            self._checkin(address, conn, reusable)

    def _checkout(self, address: str, deadline: float) -> socket.socket:
        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        host, _, port = address.rpartition(":")
        try:
            conn = socket.create_connection((host, int(port)),
                                            timeout=max(0.001, deadline - time.monotonic()))
        except (OSError, ValueError) as exc:
            raise PeerUnavailable(f"cannot connect to the TCP data port {address}: {exc}",
                                  retryable=True) from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.client_tls is None:
            plain_data_socket(conn, self.buffer_bytes)
            return conn
        try:
            conn.settimeout(max(0.001, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
            conn = self.client_tls.wrap_socket(conn,
                                               server_hostname=self._tls_server_name or host)
            conn.settimeout(SLICE_S)
            return conn
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            conn.close()
            raise PeerUnavailable(f"TLS handshake with the TCP data port {address} failed: "
                                  f"{exc}") from None

    def _checkin(self, address: str, conn: socket.socket, reusable: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if reusable and not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def forget(self, address: str) -> None:
        """Close the idle connections to `address` (its agent restarted or is gone)."""
        with self._lock:
            conns = self._idle.pop(address, [])
        for conn in conns:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def plain_data_socket(conn: socket.socket, buffer_bytes: int) -> None:
    """A plain data connection: blocking calls that return within SLICE_S (see the module
    docstring), and `buffer_bytes` socket buffers (0: autotuned)."""
    conn.settimeout(None)
    slice_tv = struct.pack("ll", 0, int(SLICE_S * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, slice_tv)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, slice_tv)
    if buffer_bytes:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


# A slice that ended with nothing sent or received: Python's timeout (TLS connections), or the
# kernel's (plain ones, where it surfaces as EAGAIN).
_SLICE_ENDED = (TimeoutError, BlockingIOError)


def send_all(conn: socket.socket, data: bytes | memoryview | np.ndarray, deadline: float,
             liveness: Liveness | None, write_bytes: int = DEFAULT_WRITE_BYTES) -> None:
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    sent, next_check = 0, time.monotonic() + LIVENESS_INTERVAL_S
    while sent < len(view):
        try:
            sent += conn.send(view[sent:sent + write_bytes])
        except _SLICE_ENDED:
            next_check = _tick(deadline, next_check, liveness, "sending the handoff")


def read_reply(conn: socket.socket, deadline: float, liveness: Liveness | None) -> Reply:
    (length,) = LENGTH.unpack(recv_bytes(conn, LENGTH.size, deadline, None, liveness))
    return Reply.decode(recv_bytes(conn, length, deadline, None, liveness))


def frame(reply: Reply) -> bytes:
    """A reply as it goes on the wire: its length, then its encoding."""
    data = reply.encode()
    return LENGTH.pack(len(data)) + data


def send_reply(conn: socket.socket, reply: Reply) -> None:
    try:
        send_all(conn, frame(reply), time.monotonic() + 5.0, None)
    except (OSError, TransferTimeout):
        pass  # the sender is gone; it reports its own error


def _tick(deadline: float, next_check: float, liveness: Liveness | None, doing: str) -> float:
    now = time.monotonic()
    if now >= deadline:
        raise TransferTimeout(f"timed out {doing}")
    if liveness is not None and now >= next_check:
        liveness()
        return now + LIVENESS_INTERVAL_S
    return next_check


def recv_bytes(conn: socket.socket, n: int, deadline: float | None,
               stopping: threading.Event | None, liveness: Liveness | None = None) -> bytes:
    buf = bytearray(n)
    recv_into(conn, memoryview(buf), deadline, None, stopping, liveness)
    return bytes(buf)


def recv_into(conn: socket.socket, view: memoryview, deadline: float | None,
              abort: threading.Event | None, stopping: threading.Event | None = None,
              liveness: Liveness | None = None, lowat: int = 0) -> None:
    """Fill `view`. `lowat` (plain connections): wake this reader once that many bytes (or
    what is left) have arrived, not at every segment (see DEFAULT_RCVLOWAT)."""
    plain = not isinstance(conn, ssl.SSLSocket)
    woken = _Woken(conn, lowat) if lowat and plain else None
    flags = socket.MSG_WAITALL if plain else 0  # TLS: no flags
    got, next_check = 0, time.monotonic() + LIVENESS_INTERVAL_S
    try:
        while got < len(view):
            if abort is not None and abort.is_set():
                raise Stopped(got)
            try:
                n = (woken.recv(view[got:]) if woken is not None
                     else conn.recv_into(view[got:], 0, flags))
            except _SLICE_ENDED:
                if stopping is not None and stopping.is_set():
                    raise Closed("shutting down") from None
                if deadline is not None:
                    next_check = _tick(deadline, next_check, liveness, "waiting for the peer")
                continue
            if n == 0:
                raise Closed("connection closed by the peer")
            got += n
    finally:
        if woken is not None:
            woken.reset()


class _Woken:
    """Reads woken per `lowat` bytes: poll until SO_RCVLOWAT bytes are queued, then take
    everything queued without waiting. Never a blocking read: within one blocking call the
    kernel would wait for SO_RCVLOWAT more bytes even where fewer are still to come (the tail
    of a handoff), and sleep until the slice's timeout."""

    def __init__(self, conn: socket.socket, lowat: int):
        self._conn, self._lowat, self._mark = conn, lowat, 1
        self._poller = select.poll()
        self._poller.register(conn, select.POLLIN)

    def recv(self, view: memoryview) -> int:
        """Bytes read into `view`; BlockingIOError when a slice ended with less queued."""
        want = min(self._lowat, len(view))
        if want != self._mark:
            self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._mark = want
        if not self._poller.poll(SLICE_S * 1e3):
            raise BlockingIOError("less than the mark arrived within the slice")
        return self._conn.recv_into(view, 0, socket.MSG_DONTWAIT)

    def reset(self) -> None:
        """The mark back at 1: the next read on the connection is a header."""
        if self._mark != 1:
            try:
                self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass  # the connection is gone


def discard(conn: socket.socket, nbytes: int, deadline: float) -> bool:
    """Read and drop `nbytes`; False if that failed (the connection is then out of step)."""
    scratch = memoryview(bytearray(min(max(nbytes, 1), _SCRATCH_BYTES)))
    try:
        while nbytes > 0:
            chunk = scratch[:min(nbytes, len(scratch))]
            recv_into(conn, chunk, deadline, None)
            nbytes -= len(chunk)
    except (OSError, Closed, TransferTimeout):
        return False
    return True
