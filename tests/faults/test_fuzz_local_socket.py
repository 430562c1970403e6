"""The agent's local socket (the workers' fast lane and the same-host copy), fuzzed: frames
with every operation and bent fields (wrong types, huge numbers, forged tickets, unknown pools,
descriptors where none belong and none where one does), unknown operations, frames that are
not JSON, oversized frame headers, junk bytes; while a canary streams through the same agent.

A well-formed frame gets a reply (an `error` naming what is wrong, or the answer); a frame
that is not one closes the connection; no reply is ever missing for a well-formed frame, the
agent never restarts, and (`guarded`) everything else keeps working.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.common import localsock
from pdserve.v1 import kvtransfer_pb2

from tests.faults.protofuzz import FUZZ, OUTCOMES, TEXT, raw_unary
from tests.faults.test_fuzz_http import JSON

pytestmark = pytest.mark.faults

OPS = ["hello", "register", "expect", "cancel", "status", "send", "shm_write", "nonsense"]
TICKET = {"request_id": "fuzz-l", "epoch": 1}
TEMPLATES = {
    "register": {"worker_id": "fuzz-w", "num_pages": 4, "page_bytes": 8192, "fingerprint": {}},
    "expect": {"ticket": TICKET, "pool_id": "x", "page_ids": [1, 2], "lease_ms": 1000},
    "cancel": {"ticket": TICKET}, "status": {"ticket": TICKET},
    "send": {"ticket": TICKET, "src_pool_id": "x", "src_page_ids": [1],
             "destination": {"agent_address": "127.0.0.1:1", "page_ids": [1]}},
    "shm_write": {"ticket": TICKET, "size": 8}, "hello": {}, "nonsense": {},
}
FIELDS = sorted({k for t in TEMPLATES.values() for k in t} | {"x"})


@st.composite
def frames(draw: st.DrawFn) -> tuple[dict, bool]:
    """(message with `op`, whether to pass a descriptor along)."""
    op = draw(st.sampled_from(OPS))
    message = dict(TEMPLATES[op], op=op)
    if draw(st.booleans()):
        message[draw(st.sampled_from(FIELDS))] = draw(JSON | TEXT)
    return message, draw(st.booleans())


JUNK = st.one_of(
    st.binary(min_size=1, max_size=64),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
        lambda t: struct.pack("<II", *t)),
    st.sampled_from([struct.pack("<II", 5, 0) + b"[1,2]", struct.pack("<II", 3, 0) + b"\xff{}"]),
)


def _connect(address: str) -> socket.socket:
    sock = localsock.connect(address, 10.0)
    sock.settimeout(15.0)
    return sock


def test_local_socket(guarded):
    stub = raw_unary(guarded.channel("agent-b"), "/pdserve.v1.KVTransfer/GetAgentInfo")
    info = kvtransfer_pb2.AgentInfo.FromString(stub(b"", timeout=5))
    address = info.local_socket
    assert address, "agent-b serves a local socket"
    tally = OUTCOMES.setdefault("local socket frames", Counter())

    @settings(FUZZ, max_examples=80)
    @given(frames())
    def well_formed(case: tuple[dict, bool]) -> None:
        message, with_fd = case
        fds = (os.open(os.devnull, os.O_RDONLY),) if with_fd else ()
        try:
            with _connect(address) as sock:
                localsock.send(sock, message, fds=fds)
                reply, _, got = localsock.recv(sock)
        finally:
            for fd in fds:
                os.close(fd)
        for fd in got:
            os.close(fd)
        if "error" in reply:
            assert reply["message"].strip(), reply
            tally[f"error {reply['error']}"] += 1
        else:
            tally[f"answered {message['op']}"] += 1

    @settings(FUZZ, max_examples=30)
    @given(JUNK)
    def junk(data: bytes) -> None:
        with _connect(address) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            try:
                assert sock.recv(1) == b"", f"answered junk {data!r:.120}"
            except ConnectionResetError:
                pass
        tally["junk: closed"] += 1

    well_formed()
    junk()
    stub_again = kvtransfer_pb2.AgentInfo.FromString(stub(b"", timeout=5))
    assert stub_again.epoch == info.epoch  # the same agent: it never restarted
