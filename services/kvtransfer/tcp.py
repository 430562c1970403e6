"""TCP transport: plain sockets, the fallback where UCX is not wanted.

Each agent listens on its data port; a sender keeps a few idle connections per peer and runs
one handoff at a time per connection (pdserve.common.kv.tcpwire has the wire, the socket calls
and the sending half, `TcpSender`, which a prefill worker's own lane to this agent uses too).
Runs go out with `send` from pool views and land with `recv_into` into the destination views:
no buffer between the socket and either pool.
A receiver whose ticket is cancelled mid-handoff stops writing at once and reads the rest of
the bytes into a scratch buffer, so the stream stays in step and the sender learns why; so it
does with the head of a handoff it refuses (the first MiB, which follows the header before
"ready"; all of an eager one).
On plain connections a handoff of a ticket armed for the native path (native.py) is read in
C once its header is in: the checks, "ready", the runs into the pages and "done" without the
interpreter; anything it declines is served here.

With TLS (`server_tls` / `client_tls`, from the agent's --tls-* flags) every data connection
is a TLS connection: the listener requires a client certificate from the CA under mutual TLS,
so only authenticated agents can send a header at all, and the bytes are encrypted.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence

import numpy as np
from pdserve.common.kv.errors import (
    KvTransferError,
    PeerUnavailable,
    TicketCancelled,
    TransferTimeout,
)
from pdserve.common.kv.tcpwire import (
    DEFAULT_RCVLOWAT,
    DEFAULT_WRITE_BYTES,
    EAGER_BYTES,
    HANDSHAKE_TIMEOUT_S,
    SLICE_S,
    Closed,
    Stopped,
    TcpSender,
    discard,
    frame,
    head_bytes,
    plain_data_socket,
    recv_bytes,
    recv_into,
    send_reply,
)
from pdserve.common.kv.wire import PREFIX_BYTES, Reply, WriteHeader
from pdserve.kvtransfer import native
from pdserve.kvtransfer.native import NativeReceiver
from pdserve.kvtransfer.transport import (
    Landed,
    Liveness,
    PeerContact,
    Transport,
    WriteSink,
    receive_deadline_s,
)

log = logging.getLogger("pdserve.kvtransfer.tcp")


_READY, _DONE = frame(Reply("ready")), frame(Reply("done"))  # what the native path sends
# A header the native path reads itself (longer ones, past its 16 runs, are Python's anyway).
NATIVE_HEADER_BYTES = 4096


class TcpTransport(Transport):
    """Handoffs over TCP connections (see the module docstring)."""

    name = "tcp"

    def __init__(self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "127.0.0.1",
                 max_idle_per_peer: int = 4, server_tls: ssl.SSLContext | None = None,
                 client_tls: ssl.SSLContext | None = None, tls_server_name: str = "",
                 buffer_bytes: int = 0, write_bytes: int = DEFAULT_WRITE_BYTES,
                 rcvlowat_bytes: int = DEFAULT_RCVLOWAT):
        if rcvlowat_bytes < 0:
            raise ValueError(f"rcvlowat_bytes {rcvlowat_bytes} must be >= 0")
        self._rcvlowat = rcvlowat_bytes
        self.sender = TcpSender(max_idle_per_peer, client_tls, tls_server_name, buffer_bytes,
                                write_bytes)  # checks the sizes
        self._bind = (host, port)
        self._buffer_bytes = buffer_bytes
        self._server_tls = server_tls
        self._advertise_host = advertise_host
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._sink: WriteSink | None = None
        self._native: NativeReceiver | None = None
        self._landed: Landed | None = None

    def receive_natively(self, receiver: NativeReceiver | None, landed: Landed) -> None:
        """Serve handoffs of armed tickets on plain connections in C (native.py); `landed`
        counts each one it served."""
        self._native, self._landed = receiver, landed

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
        self.sender.close()
        for thread in self._threads:
            thread.join(timeout=2.0)

    def forget(self, peer: PeerContact) -> None:
        self.sender.forget(peer.tcp_address)

    def lane_terms(self) -> dict[str, int] | None:
        """Plain connections only: under TLS the agent alone holds the client certificate."""
        if self.sender.client_tls is not None:
            return None
        return {"write_bytes": self.sender.write_bytes, "buffer_bytes": self.sender.buffer_bytes}

    # ---- sending ----------------------------------------------------------------------
    def send(self, peer: PeerContact, header: WriteHeader, src_views: Sequence[np.ndarray],
             timeout_s: float, liveness: Liveness | None = None) -> None:
        self.sender.send(peer.tcp_address, header, src_views, timeout_s, liveness)

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
                plain_data_socket(conn, self._buffer_bytes)
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
        served = self._native if self._server_tls is None else None
        out = native.out_buffer()
        head = bytearray(NATIVE_HEADER_BYTES)
        with conn:
            try:
                while True:
                    prefix = recv_bytes(conn, PREFIX_BYTES, None, self._stopping)
                    raw = b""
                    if served is not None:  # the rest of the header, and the handoff, in C
                        head[:PREFIX_BYTES] = prefix
                        done = served.recv_rest(head, conn.fileno(), EAGER_BYTES, _READY,
                                                _DONE, self._rcvlowat, int(SLICE_S * 1e3), out)
                        raw = bytes(head[:int(out[1])])
                        if not raw and done == native.TIMED_OUT:
                            raise TransferTimeout("timed out waiting for the peer")
                        if not raw and done == native.BROKEN:
                            return
                        if raw and done != native.DECLINED:
                            if not self._natively_served(conn, raw, done, int(out[0])):
                                return
                            continue
                    if not raw:
                        raw = prefix + recv_bytes(conn, WriteHeader.size(prefix) - PREFIX_BYTES,
                                                  time.monotonic() + 10.0, self._stopping)
                    if not self._serve_write(conn, WriteHeader.decode(raw)):
                        return
            except (Closed, OSError, Stopped):
                return
            except KvTransferError as exc:  # a malformed header: say why, then hang up
                send_reply(conn, Reply.failure("ready", exc))

    def _natively_served(self, conn: socket.socket, raw: bytes, done: int, got: int) -> bool:
        """Count a handoff the native path served and finish what it left to this side (a
        cancelled one's remaining bytes read away and its refusal sent); False when the
        connection must close."""
        assert self._landed is not None
        header = WriteHeader.decode(raw)  # it matched an armed ticket: well formed
        if done in (native.REPLIED, native.SEND_FAILED):
            self._landed(header, None)
            return done == native.REPLIED
        if done == native.STOPPED:
            exc: KvTransferError = TicketCancelled(f"ticket {header.ticket} was cancelled "
                                                   "during its write")
            self._landed(header, exc)
            deadline = time.monotonic() + receive_deadline_s(header)
            if not discard(conn, header.kv_bytes - got, deadline):
                return False
            send_reply(conn, Reply.failure("done", exc))
            return True
        self._landed(header, TransferTimeout("the handoff's bytes did not arrive in time")
                     if done == native.TIMED_OUT
                     else PeerUnavailable("sender hung up during the handoff"))
        return False  # out of step

    def _serve_write(self, conn: socket.socket, header: WriteHeader) -> bool:
        """Run one handoff; False when the connection must close (out of step)."""
        assert self._sink is not None
        eager = header.kv_bytes <= EAGER_BYTES  # all its bytes follow the header at once
        deadline = time.monotonic() + receive_deadline_s(header)
        try:
            write = self._sink.accept(header)
        except KvTransferError as exc:
            send_reply(conn, Reply.failure("ready", exc))
            # its head is on its way: read it away so the stream stays in step
            return discard(conn, head_bytes(header.kv_bytes), deadline)
        if not eager:
            send_reply(conn, Reply("ready"))
        ok, in_step, received = False, False, 0
        error: KvTransferError | None = None
        try:
            for view in write.dst_views:
                dst = view.data.cast("B")
                recv_into(conn, dst, deadline, write.abort, lowat=self._rcvlowat)
                received += len(dst)
            ok = in_step = True
        except Stopped as exc:
            in_step, received = True, received + exc.got
        except TransferTimeout as exc:
            error = exc
        except (OSError, Closed) as exc:
            error = PeerUnavailable(f"sender hung up during the handoff: {exc}")
        try:
            self._sink.finish(write, ok)
        except KvTransferError as exc:
            error = error or exc
        if not ok and in_step:  # cancelled: swallow the rest so the stream stays in step
            in_step = discard(conn, header.kv_bytes - received, deadline)
        if error is None and not ok:
            error = TransferTimeout("the handoff stopped before all bytes arrived")
        if in_step:
            send_reply(conn, Reply("done") if error is None else Reply.failure("done", error))
        return in_step


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
