"""The local socket's framing (messages, payloads, descriptors) over a real socket pair, and
the same-host receiver's refusals that need no peer agent: a sender pool that cannot be
mapped here, a write for a pool never mapped, a malformed header (descriptors closed)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from pdserve.common import localsock
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.shm import SharedSegment
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.shm import ShmReceiver

pytestmark = pytest.mark.unit
FP = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4)


def test_a_frame_carries_message_payload_and_descriptors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, SharedSegment.create(4096) as segment:
        segment.buffer[:5] = b"hello"
        localsock.send(a, {"op": "x", "n": 3}, b"\0payload", (segment.fd,))
        message, payload, fds = localsock.recv(b)
        assert message == {"op": "x", "n": 3} and payload == b"\0payload" and len(fds) == 1
        with SharedSegment.from_fd(fds[0], 4096, writable=False) as seen:
            assert bytes(seen.buffer[:5]) == b"hello"  # the same memory, not a copy
        sender = threading.Thread(target=localsock.send, args=(a, {"big": "y" * 300_000}))
        sender.start()  # larger than the socket's buffer: sent and read in pieces
        assert localsock.recv(b)[0]["big"] == "y" * 300_000
        sender.join()
        localsock.check_peer(b)  # this process's own uid
        a.close()
        with pytest.raises(localsock.Closed):
            localsock.recv(b)


def test_a_readonly_descriptor_cannot_be_mapped_for_writing() -> None:
    with SharedSegment.create(4096) as segment:
        fd = segment.readonly_fd()
        with pytest.raises(PermissionError):
            SharedSegment.from_fd(fd, 4096, writable=True)


def _never() -> object:
    raise AssertionError("the sink must not be reached")


def _header() -> bytes:
    return WriteHeader(1, TicketKey("r", 1), 7, "decode/1", FP, FP.page_bytes, ((0, 1),),
                       1000.0).encode()


def test_the_same_host_receiver_refuses_what_it_cannot_map() -> None:
    receiver = ShmReceiver(_never)  # type: ignore[arg-type]
    write = {"op": "shm_write", "src_pool": "p/1", "src_num_pages": 8, "src_runs": [[0, 1]]}
    with SharedSegment.create(FP.page_bytes) as small:  # 1 page, the sender claims 8
        reply = receiver.write(write, _header(), [small.readonly_fd()])
    assert reply["error"] == "SegmentUnavailable" and "cannot be mapped" in reply["message"]
    reply = receiver.write(write, _header(), [])  # no descriptor, never mapped here
    assert reply["error"] == "SegmentUnavailable" and "never mapped" in reply["message"]
    with SharedSegment.create(8 * FP.page_bytes) as pool:
        fd = pool.readonly_fd()
        reply = receiver.write(write, b"not a header", [fd])
        assert reply["error"] == "BadRequest"
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by the receiver
    receiver.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_reply_is_read_whole_in_one_read_or_in_pieces() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        localsock.send(a, {}, b"")
        assert localsock.recv_reply(b) == ({}, b"")
        localsock.send(a, {"error": "BadRequest", "message": "é"}, b"tail")
        assert localsock.recv_reply(b) == ({"error": "BadRequest", "message": "é"}, b"tail")
        frame = b"\x0b\x00\x00\x00\x00\x00\x00\x00" + b'{"ok":true}'
        writer = threading.Thread(target=lambda: [a.sendall(frame[:3]), a.sendall(frame[3:])])
        writer.start()  # the head cut in two: the rest is waited for
        assert localsock.recv_reply(b) == ({"ok": True}, b"")
        writer.join()


def test_a_reply_that_stops_in_the_middle_or_comes_twice_is_refused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):  # nothing yet: the caller may check its peer
            localsock.recv_reply(b)
        localsock.send(a, {"n": 1})
        localsock.send(a, {"n": 2})
        with pytest.raises(ValueError, match="more than one reply"):
            localsock.recv_reply(b)
        a.sendall(b"\x20\x00\x00\x00\x00\x00\x00\x00{")  # 32 bytes announced, 1 sent
        with pytest.raises(localsock.Closed, match="stopped in the middle"):
            localsock.recv_reply(b)
        a.close()
        with pytest.raises(localsock.Closed):
            localsock.recv_reply(b)


def test_descriptors_in_a_reply_are_dropped_not_leaked() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, SharedSegment.create(4096) as segment:
        before = _open_fds()
        localsock.send(a, {"x": 1}, b"", (segment.fd, segment.fd))
        assert localsock.recv_reply(b) == ({"x": 1}, b"")
        assert _open_fds() == before
