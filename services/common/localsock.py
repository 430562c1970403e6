"""Messages over a Unix stream socket between processes of one host, with file descriptors.

Used between a worker and its host's kvtransfer agent (the pool's memory fd, and the per-
handoff calls of the fast lane) and between two agents that turn out to share a host (the
same-host copy). Standard library only.

Addresses: a filesystem path (`/run/pdserve/kvtransfer.sock`, reachable by whoever can reach
the path, e.g. two containers sharing an emptyDir), or `@name` for Linux's abstract namespace
(no file; scoped to the network namespace, so processes in two network namespaces never
reach each other's, even on one machine).

A message is a frame: `<II` (JSON bytes, payload bytes), a JSON object, an opaque payload.
File descriptors ride on the frame's first bytes (SCM_RIGHTS). Both ends check the peer's
uid (SO_PEERCRED): only the same user, or root, is spoken to.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from typing import Any

_FRAME = struct.Struct("<II")
MAX_JSON_BYTES = 1 << 24
MAX_PAYLOAD_BYTES = 1 << 24
MAX_FDS = 4
_REPLY_READ_BYTES = 1 << 16  # a reply's first read (the usual reply: tens of bytes)
# built once: json.dumps with any option builds a new encoder per call (a handoff's path)
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class Closed(ConnectionError):
    """The peer closed the connection (or it broke)."""


def sockaddr(address: str) -> str | bytes:
    """The bind/connect address of `address` ("@name": abstract namespace)."""
    if not address:
        raise ValueError("empty Unix socket address")
    return b"\0" + address[1:].encode() if address.startswith("@") else address


def listen(address: str, backlog: int = 64) -> socket.socket:
    """A listening socket at `address`. A stale socket file (nobody listening) is replaced;
    a live one is an error (another process serves it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not address.startswith("@") and os.path.exists(address):
            if _alive(address):
                raise OSError(f"{address}: another process is listening there")
            os.unlink(address)
        if not address.startswith("@"):
            os.makedirs(os.path.dirname(os.path.abspath(address)), exist_ok=True)
        sock.bind(sockaddr(address))
        if not address.startswith("@"):
            os.chmod(address, 0o660)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _alive(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def connect(address: str, timeout_s: float) -> socket.socket:
    """A connection to `address`, its peer checked (`check_peer`); OSError when unreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(sockaddr(address))
        check_peer(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def check_peer(sock: socket.socket) -> None:
    """Raise PermissionError unless the peer runs as this process's user or as root."""
    uid = peer_uid(sock)
    if uid not in (0, os.geteuid()):
        raise PermissionError(f"the process at the other end runs as uid {uid}, not {os.geteuid()}")


def send(sock: socket.socket, message: dict[str, Any], payload: bytes = b"",
         fds: tuple[int, ...] = ()) -> None:
    """One frame; `fds` travel with its first bytes."""
    body = _ENCODER.encode(message).encode() if message else b"{}"
    data = _FRAME.pack(len(body), len(payload)) + body + payload  # one write when it fits
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytes, list[int]]:
    """The next frame: (message, payload, received fds; the caller owns and closes them).
    Raises Closed at end of stream, ValueError on a malformed frame."""
    fds = array.array("i")
    head, ancillary, _, _ = sock.recvmsg(_FRAME.size, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    try:
        if not head:
            raise Closed("connection closed by the peer")
        head += _recv_exactly(sock, _FRAME.size - len(head))
        body_len, payload_len = _sizes(head)
        body = _recv_exactly(sock, body_len + payload_len)
        message = _message(body[:body_len])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, body[body_len:], list(fds)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    if n <= 0:
        return b""
    data = sock.recv(n, socket.MSG_WAITALL)  # usually all of it at once
    if len(data) == n:
        return data
    chunks, got = [data], len(data)
    while got < n:
        if not data:
            raise Closed("connection closed by the peer in the middle of a message")
        data = sock.recv(n - got)
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def recv_reply(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """The reply to the request just sent on `sock`: (message, payload). The peer sends
    nothing else meanwhile, so one read takes the whole frame (the next syscall the caller
    makes is its next request): a reply comes back in one system call, not three. Descriptors
    in a reply are dropped by the kernel (a reply never carries any). TimeoutError only when
    nothing of the reply arrived within the socket's timeout; Closed at end of stream, or
    when the reply stops in the middle."""
    data = sock.recv(_REPLY_READ_BYTES)
    if not data:
        raise Closed("connection closed by the peer")
    try:
        if len(data) < _FRAME.size:
            data += _recv_exactly(sock, _FRAME.size - len(data))
        body_len, payload_len = _sizes(data)
        end = _FRAME.size + body_len + payload_len
        if len(data) < end:
            data += _recv_exactly(sock, end - len(data))
    except TimeoutError:
        raise Closed("the reply stopped in the middle") from None
    if len(data) > end:
        raise ValueError("the peer sent more than one reply")
    return _message(data[_FRAME.size:_FRAME.size + body_len]), data[_FRAME.size + body_len:]


def _sizes(head: bytes) -> tuple[int, int]:
    """(JSON bytes, payload bytes) of the frame whose first bytes are `head`."""
    body_len, payload_len = _FRAME.unpack_from(head)
    if body_len > MAX_JSON_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ValueError(f"frame too large ({body_len} + {payload_len} bytes)")
    return int(body_len), int(payload_len)


def _message(body: bytes) -> dict[str, Any]:
    message = {} if body == b"{}" else json.loads(body)  # {}: the usual reply
    if not isinstance(message, dict):
        raise ValueError("a frame's message must be a JSON object")
    return message


def call(sock: socket.socket, message: dict[str, Any], payload: bytes = b"",
         fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytes]:
    """Send one request and read its reply (descriptors in a reply are dropped)."""
    send(sock, message, payload, fds)
    return recv_reply(sock)
