"""The TCP data path (pdserve.common.kv.tcpwire). Reads woken per SO_RCVLOWAT bytes: every
byte lands, also a tail shorter than the mark that arrives after the reader went to sleep (a
blocking read would wait for a full mark's worth that never comes), and the mark is back at 1
for the next header. A prepared eager handoff: `push` alone puts its header and bytes on the
wire, `send` then only waits for the reply and the connection is kept for the next one; a push
on a connection the receiver closed starts over on a fresh one; what cannot go eager is not
prepared. A larger handoff writes its first MiB right behind the header and the rest only after
"ready"; a receiving transport that refuses one reads its head away, so the connection carries
the next handoff."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from pdserve.common.kv.errors import UnknownTicket
from pdserve.common.kv.tcpwire import TcpSender, frame, recv_bytes, recv_into
from pdserve.common.kv.wire import PREFIX_BYTES, Reply, WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.tcp import TcpTransport
from pdserve.kvtransfer.transport import IncomingWrite

FP = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4)


def _connected() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    return sender, receiver


def _queued(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def test_a_reader_woken_per_mark_gets_a_tail_shorter_than_the_mark() -> None:
    sender, receiver = _connected()
    nbytes, tail, mark = 3 * (1 << 20) + 5, 5, 512 << 10
    data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.zeros(nbytes, dtype=np.uint8)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            recv_into(receiver, out.data.cast("B"), time.monotonic() + 30, None, lowat=mark)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        sender.sendall(data[:-tail].data)
        # Bounded: until every byte but the tail is either read or queued (the reader then
        # sleeps with less than a mark's worth still to come), then the tail.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            same = out[:-tail] == data[:-tail]
            written = len(same) if same.all() else int(np.argmin(same))
            if written + _queued(receiver) >= nbytes - tail:
                break
            time.sleep(0.001)
        sender.sendall(data[-tail:].data)
        reader.join(timeout=20)
        assert not reader.is_alive(), "the reader never woke for the tail"
        assert not errors, errors
        assert np.array_equal(out, data)
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        sender.sendall(b"next")  # a header after the handoff is read at once
        head = bytearray(4)
        recv_into(receiver, memoryview(head), time.monotonic() + 5, None)
        assert head == b"next"
    finally:
        sender.close()
        receiver.close()


class _Receiver:
    """A data port that reads each handoff whole and answers "done" (a thread per connection;
    `close_idle` hangs up every connection between handoffs, as a restarted agent would)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.got: list[tuple[int, bytes]] = []  # (connection number, the handoff's bytes)
        self.arrived = threading.Event()
        self.close_idle = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        for number in range(8):  # bounded: a test opens at most a few
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            for _ in range(8):
                try:
                    prefix = recv_bytes(conn, PREFIX_BYTES, time.monotonic() + 10, None)
                    raw = prefix + recv_bytes(conn, WriteHeader.size(prefix) - PREFIX_BYTES,
                                              time.monotonic() + 10, None)
                    data = recv_bytes(conn, WriteHeader.decode(raw).kv_bytes,
                                      time.monotonic() + 10, None)
                except Exception:  # noqa: BLE001 - the sender hung up
                    return
                self.got.append((number, data))
                self.arrived.set()
                conn.sendall(frame(Reply("done")))
                if self.close_idle:
                    return

    def close(self) -> None:
        self.listener.close()
        for conn in self._conns:
            conn.close()


def _header(pages: int) -> WriteHeader:
    return WriteHeader(xfer_id=7, ticket=TicketKey("r", 1), dst_agent_epoch=1, dst_pool_id="p",
                       fingerprint=FP, page_bytes=FP.page_bytes, dst_runs=((0, pages),),
                       timeout_ms=5000.0)


def _pages(pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, pages * FP.page_bytes, dtype=np.uint8)


@pytest.fixture
def receiver():
    r = _Receiver()
    yield r
    r.close()


def test_a_prepared_handoff_is_on_the_wire_after_push_and_its_connection_is_kept(receiver):
    sender = TcpSender()
    try:
        sender.send(receiver.address, _header(2), [_pages(2, 1)], 5.0)  # opens a connection
        receiver.arrived.clear()
        data = _pages(3, 2)
        prepared = sender.prepare(receiver.address, _header(3), [data[:FP.page_bytes],
                                                                  data[FP.page_bytes:]], 5.0)
        assert prepared is not None and prepared.sent == 0
        prepared.push()
        assert receiver.arrived.wait(10), "push did not put the handoff on the wire"
        assert receiver.got[-1] == (0, data.tobytes())  # whole, on the kept connection
        sender.send(receiver.address, _header(3), [data], 5.0, begun=prepared)  # the reply
        again = sender.prepare(receiver.address, _header(1), [_pages(1, 3)], 5.0)
        assert again is not None and again.conn is prepared.conn  # kept for the next one
        again.conn.close()
    finally:
        sender.close()


def test_a_push_on_a_connection_the_receiver_closed_starts_over_on_a_fresh_one(receiver):
    sender = TcpSender()
    try:
        receiver.close_idle = True  # hangs up after each handoff
        sender.send(receiver.address, _header(1), [_pages(1, 4)], 5.0)
        data = _pages(2, 5)
        prepared = sender.prepare(receiver.address, _header(2), [data], 5.0)
        assert prepared is not None
        deadline = time.monotonic() + 10
        while not prepared.broken and time.monotonic() < deadline:  # bounded
            prepared.push()  # the first may still go into the dead socket's buffer
            time.sleep(0.01)
            prepared.sent = 0
        assert prepared.broken
        sender.send(receiver.address, _header(2), [data], 5.0, begun=prepared)
        assert receiver.got[-1] == (1, data.tobytes())  # landed whole on a new connection
    finally:
        sender.close()


def test_what_cannot_go_eager_is_not_prepared(receiver):
    sender = TcpSender()
    try:
        big = 1 + (1 << 20) // FP.page_bytes  # above the eager size
        assert sender.prepare(receiver.address, _header(big), [_pages(big, 6)], 5.0) is None
        with socket.create_server(("127.0.0.1", 0)) as closed:
            port = closed.getsockname()[1]
        assert sender.prepare(f"127.0.0.1:{port}", _header(1), [_pages(1, 7)], 1.0) is None
    finally:
        sender.close()


class _Refusing:
    """A receiving agent, as a TcpTransport sees it: refuses ticket "no", lands the others in
    `pool`."""

    def __init__(self, pages: int) -> None:
        self.pool = np.zeros(pages * FP.page_bytes, dtype=np.uint8)

    def accept(self, header: WriteHeader) -> IncomingWrite:
        if header.ticket.request_id == "no":
            raise UnknownTicket("unknown ticket no")
        ((start, n),) = header.dst_runs
        b = FP.page_bytes
        return IncomingWrite(header, [self.pool[start * b:(start + n) * b]], threading.Event())

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        pass


def test_a_large_handoff_writes_its_head_before_ready_and_the_rest_after():
    big = 3 * (1 << 20) // FP.page_bytes  # 3 MiB: a 1 MiB head, then 2 MiB after "ready"
    data = _pages(big, 8)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender, failures = TcpSender(), []
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def send() -> None:
            try:
                sender.send(address, _header(big), [data], 10.0)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                failures.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        conn, _ = listener.accept()
        with conn:
            prefix = recv_bytes(conn, PREFIX_BYTES, time.monotonic() + 10, None)
            raw = prefix + recv_bytes(conn, WriteHeader.size(prefix) - PREFIX_BYTES,
                                      time.monotonic() + 10, None)
            assert WriteHeader.decode(raw).kv_bytes == len(data)
            head = recv_bytes(conn, 1 << 20, time.monotonic() + 10, None)  # before "ready"
            assert head == data[:1 << 20].tobytes()
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing more until "ready"
                conn.recv(1)
            conn.setblocking(True)
            conn.sendall(frame(Reply("ready")))
            rest = recv_bytes(conn, len(data) - (1 << 20), time.monotonic() + 10, None)
            assert rest == data[1 << 20:].tobytes()
            conn.sendall(frame(Reply("done")))
            thread.join(10)
        sender.close()
    assert not thread.is_alive() and not failures, failures


def test_a_refused_large_handoff_leaves_the_connection_in_step_for_the_next():
    """The receiver reads a refused handoff's head away: the next handoff on the same
    connection lands whole (out of step, it would read the head as a header and hang up)."""
    big = 3 * (1 << 20) // FP.page_bytes
    sink = _Refusing(big)
    transport = TcpTransport(host="127.0.0.1")
    address = transport.start(sink).tcp_address
    sender = TcpSender()
    try:
        data = _pages(big, 9)
        refused = replace(_header(big), ticket=TicketKey("no", 1))
        with pytest.raises(UnknownTicket):
            sender.send(address, refused, [data], 10.0)
        (conn,) = sender._idle[address]  # kept: the stream is in step
        assert not sink.pool.any()
        sender.send(address, _header(big), [data], 10.0)
        assert np.array_equal(sink.pool, data)
        assert sender._idle[address] == [conn]  # the same connection carried it
    finally:
        sender.close()
        transport.close()
