"""TCP transport: plain sockets, the fallback where UCX is not wanted.

Each agent listens on its data port; a sender keeps a few idle connections per peer and runs
one handoff at a time per connection: header -> reply -> the runs' bytes back to back -> reply.
Runs go out with `send` from pool views and land with `recv_into` into the destination views:
no buffer between the socket and either pool.
A handoff of at most EAGER_BYTES sends its bytes right behind the header, without waiting for
the "ready" reply: one round trip and two wake-ups less on the latency that matters (a short
prompt's pages); a receiver that refuses it answers the refusal instead of "done" at once and
then reads the bytes into a scratch buffer, so the stream stays in step.
A receiver whose ticket is cancelled mid-handoff stops writing at once and reads the rest of
the bytes into a scratch buffer, so the stream stays in step and the sender learns why.

With TLS (`server_tls` / `client_tls`, from the agent's --tls-* flags) every data connection
is a TLS connection: the listener requires a client certificate from the CA under mutual TLS,
so only authenticated agents can send a header at all, and the bytes are encrypted.

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

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
from pdserve.common.kv.errors import KvTransferError, PeerUnavailable, TransferTimeout
from pdserve.common.kv.wire import LIVENESS_INTERVAL_S, PREFIX_BYTES, Reply, WriteHeader
from pdserve.kvtransfer.transport import (
    Liveness,
    PeerContact,
    Transport,
    WriteSink,
    receive_deadline_s,
)

log = logging.getLogger("pdserve.kvtransfer.tcp")

SLICE_S = 0.05  # socket timeout between checks of deadlines, aborts and shutdown
_LEN = struct.Struct("<I")
_SCRATCH_BYTES = 1 << 20
DEFAULT_WRITE_BYTES = 512 << 10  # one send() of a run (see the module docstring)
# Handoffs up to this size do not wait for "ready" (a refusal wastes the bytes): across a veth a
# 0.38 MiB page 0.32-0.35 ms against 0.46-0.57; no gain at 0.75 MiB (docs/kv-transfer.md).
EAGER_BYTES = 512 << 10
HANDSHAKE_TIMEOUT_S = 10.0


class _Closed(Exception):
    """The peer closed the connection."""


class _Aborted(Exception):
    """The ticket was cancelled while its bytes were arriving; `got` bytes of the current
    buffer had landed."""

    def __init__(self, got: int):
        super().__init__(f"aborted after {got} bytes")
        self.got = got


class TcpTransport(Transport):
    """Handoffs over TCP connections (see the module docstring)."""

    name = "tcp"

    def __init__(self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1",
                 max_idle_per_peer: int = 4, server_tls: ssl.SSLContext | None = None,
                 client_tls: ssl.SSLContext | None = None, tls_server_name: str = "",
                 buffer_bytes: int = 0, write_bytes: int = DEFAULT_WRITE_BYTES):
        if write_bytes <= 0 or buffer_bytes < 0:
            raise ValueError(f"write_bytes {write_bytes} must be > 0, buffer_bytes "
                             f"{buffer_bytes} >= 0")
        self._bind = (host, port)
        self._buffer_bytes = buffer_bytes
        self._write_bytes = write_bytes
        self._server_tls = server_tls
        self._client_tls = client_tls
        self._tls_server_name = tls_server_name
        self._advertise_host = advertise_host
        self._max_idle = max_idle_per_peer
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._sink: WriteSink | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def start(self, sink: WriteSink) -> PeerContact:
        self._sink = sink
        self._listener = socket.create_server(self._bind, backlog=128)
        self._listener.settimeout(0.2)
        port = self._listener.getsockname()[1]
        accept = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        accept.start()
        self._threads.append(accept)
        log.info("TCP data listener on %s:%d%s", self._bind[0], port,
                 " (TLS)" if self._server_tls is not None else "")
        return PeerContact(agent_id="", tcp_address=f"{self._advertise_host}:{port}")

    def close(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        for thread in self._threads:
            thread.join(timeout=2.0)

    def forget(self, peer: PeerContact) -> None:
        with self._lock:
            conns = self._idle.pop(peer.tcp_address, [])
        for conn in conns:
            conn.close()

    # ---- sending ----------------------------------------------------------------------
    def send(self, peer: PeerContact, header: WriteHeader, src_views: Sequence[np.ndarray],
             timeout_s: float, liveness: Liveness | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        conn = self._checkout(peer.tcp_address, deadline)
        eager = header.kv_bytes <= EAGER_BYTES
        reusable = False
        try:
            try:
                _send_all(conn, header.encode(), deadline, liveness)
                if eager:  # the bytes right behind the header; the one reply says how it went
                    self._send_runs(conn, src_views, deadline, liveness)
                ready = None if eager else _read_reply(conn, deadline, liveness)
            except (OSError, _Closed) as exc:
                # no reply yet: nothing was acknowledged (typically an idle connection the
                # receiver closed), so the handoff may be tried again on a fresh one
                raise PeerUnavailable(f"TCP connection to {peer.tcp_address} failed before the "
                                      f"receiver answered: {exc}", retryable=True) from None
            if ready is not None:
                reusable = True
                ready.raise_if_error()
                reusable = False
            try:
                if not eager:
                    self._send_runs(conn, src_views, deadline, liveness)
                done = _read_reply(conn, deadline, liveness)
            except (OSError, _Closed) as exc:
                # eager: still no reply at all, as above (a retry rewrites the same bytes; a
                # receiver that had finished the ticket refuses it cleanly)
                raise PeerUnavailable(f"TCP connection to {peer.tcp_address} failed during the "
                                      f"handoff: {exc}", retryable=eager) from None
            reusable = True
            done.raise_if_error()
        finally:
            self._checkin(peer.tcp_address, conn, reusable)

    def _send_runs(self, conn: socket.socket, src_views: Sequence[np.ndarray], deadline: float,
                   liveness: Liveness | None) -> None:
        for view in src_views:
            _send_all(conn, view, deadline, liveness, self._write_bytes)

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
        if self._client_tls is None:
            _plain_data_socket(conn, self._buffer_bytes)
            return conn
        try:
            conn.settimeout(max(0.001, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
            conn = self._client_tls.wrap_socket(conn,
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
            if reusable and not self._stopping.is_set() and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    # ---- receiving --------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._server_tls is None:
                _plain_data_socket(conn, self._buffer_bytes)
            thread = threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn",
                                      daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: handoffs one after another until the peer closes it."""
        if self._server_tls is not None:
            peer = _peer_name(conn)
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                conn = self._server_tls.wrap_socket(conn, server_side=True)
                conn.settimeout(SLICE_S)
            except (OSError, ValueError) as exc:
                log.warning("refused a TCP data connection from %s: TLS handshake failed: %s",
                            peer, exc)
                conn.close()
                return
        with conn:
            try:
                while True:
                    prefix = _recv_bytes(conn, PREFIX_BYTES, None, self._stopping)
                    rest = _recv_bytes(conn, WriteHeader.size(prefix) - PREFIX_BYTES,
                                       time.monotonic() + 10.0, self._stopping)
                    if not self._serve_write(conn, WriteHeader.decode(prefix + rest)):
                        return
            except (_Closed, OSError, _Aborted):
                return
            except KvTransferError as exc:  # a malformed header: say why, then hang up
                _send_reply(conn, Reply.failure("ready", exc))

    def _serve_write(self, conn: socket.socket, header: WriteHeader) -> bool:
        """Run one handoff; False when the connection must close (out of step)."""
        assert self._sink is not None
        eager = header.kv_bytes <= EAGER_BYTES  # its bytes follow the header at once
        deadline = time.monotonic() + receive_deadline_s(header)
        try:
            write = self._sink.accept(header)
        except KvTransferError as exc:
            _send_reply(conn, Reply.failure("ready", exc))
            # eager: its bytes are on their way; read them away so the stream stays in step
            return not eager or _discard(conn, header.kv_bytes, deadline)
        if not eager:
            _send_reply(conn, Reply("ready"))
        ok, in_step, received = False, False, 0
        error: KvTransferError | None = None
        try:
            for view in write.dst_views:
                dst = view.data.cast("B")
                _recv_into(conn, dst, deadline, write.abort)
                received += len(dst)
            ok = in_step = True
        except _Aborted as exc:
            in_step, received = True, received + exc.got
        except TransferTimeout as exc:
            error = exc
        except (OSError, _Closed) as exc:
            error = PeerUnavailable(f"sender hung up during the handoff: {exc}")
        try:
            self._sink.finish(write, ok)
        except KvTransferError as exc:
            error = error or exc
        if not ok and in_step:  # cancelled: swallow the rest so the stream stays in step
            in_step = _discard(conn, header.kv_bytes - received, deadline)
        if error is None and not ok:
            error = TransferTimeout("the handoff stopped before all bytes arrived")
        if in_step:
            _send_reply(conn, Reply("done") if error is None else Reply.failure("done", error))
        return in_step


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def _plain_data_socket(conn: socket.socket, buffer_bytes: int) -> None:
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


def _send_all(conn: socket.socket, data: bytes | np.ndarray, deadline: float,
              liveness: Liveness | None, write_bytes: int = DEFAULT_WRITE_BYTES) -> None:
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    sent, next_check = 0, time.monotonic() + LIVENESS_INTERVAL_S
    while sent < len(view):
        try:
            sent += conn.send(view[sent:sent + write_bytes])
        except _SLICE_ENDED:
            next_check = _tick(deadline, next_check, liveness, "sending the handoff")


def _read_reply(conn: socket.socket, deadline: float, liveness: Liveness | None) -> Reply:
    (length,) = _LEN.unpack(_recv_bytes(conn, _LEN.size, deadline, None, liveness))
    return Reply.decode(_recv_bytes(conn, length, deadline, None, liveness))


def _send_reply(conn: socket.socket, reply: Reply) -> None:
    data = reply.encode()
    try:
        _send_all(conn, _LEN.pack(len(data)) + data, time.monotonic() + 5.0, None)
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


def _recv_bytes(conn: socket.socket, n: int, deadline: float | None,
                stopping: threading.Event | None, liveness: Liveness | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf), deadline, None, stopping, liveness)
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview, deadline: float | None,
               abort: threading.Event | None, stopping: threading.Event | None = None,
               liveness: Liveness | None = None) -> None:
    got, next_check = 0, time.monotonic() + LIVENESS_INTERVAL_S
    flags = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS: no flags
    while got < len(view):
        if abort is not None and abort.is_set():
            raise _Aborted(got)
        try:
            n = conn.recv_into(view[got:], 0, flags)
        except _SLICE_ENDED:
            if stopping is not None and stopping.is_set():
                raise _Closed("shutting down") from None
            if deadline is not None:
                next_check = _tick(deadline, next_check, liveness, "waiting for the peer")
            continue
        if n == 0:
            raise _Closed("connection closed by the peer")
        got += n


def _discard(conn: socket.socket, nbytes: int, deadline: float) -> bool:
    """Read and drop `nbytes`; False if that failed (the connection is then out of step)."""
    scratch = memoryview(bytearray(min(max(nbytes, 1), _SCRATCH_BYTES)))
    try:
        while nbytes > 0:
            chunk = scratch[:min(nbytes, len(scratch))]
            _recv_into(conn, chunk, deadline, None)
            nbytes -= len(chunk)
    except (OSError, _Closed, TransferTimeout):
        return False
    return True
