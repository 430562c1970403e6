"""The TCP data path's reads woken per SO_RCVLOWAT bytes (pdserve.common.kv.tcpwire): every
byte lands, also a tail shorter than the mark that arrives after the reader went to sleep (a
blocking read would wait for a full mark's worth that never comes), and the mark is back at 1
for the next header."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time

import numpy as np
from pdserve.common.kv.tcpwire import recv_into


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
