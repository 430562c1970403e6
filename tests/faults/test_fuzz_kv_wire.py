"""The TCP transport's data port, fuzzed: write headers with extreme fields, forged tickets and
epochs, wrong page ids, truncated and oversized headers, and bytes that are no header at all,
sent straight to a receiving agent's socket while a canary streams real requests through it.

A header the agent can parse but refuses gets a reply naming why; one it cannot parse gets a
reply or, once the sender stops short, a closed connection; nothing is ever written (no reply
says "done"), and the agent keeps serving (the `guarded` fixture checks the rest).
"""

from __future__ import annotations

import json
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.common import wire
from pdserve.common.kv.wire import MAGIC, MAX_BODY_BYTES, MAX_RUNS, VERSION, WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.v1 import kvtransfer_pb2

from tests.faults.protofuzz import F64, FUZZ, I32, TEXT, U64, raw_unary

pytestmark = pytest.mark.faults

_LEN = struct.Struct("<I")
_PREFIX = struct.Struct("<4sBxxxII")


def _info(fs, name: str) -> kvtransfer_pb2.AgentInfo:
    stub = raw_unary(fs.channel(name), "/pdserve.v1.KVTransfer/GetAgentInfo")
    return kvtransfer_pb2.AgentInfo.FromString(stub(b"", timeout=5))


def _exchange(address: str, data: bytes, close_after: bool) -> dict | None:
    """Send `data`, (optionally) stop sending, read one reply: its JSON, or None when the
    agent closed the connection without one."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.settimeout(15)
        try:  # the agent may refuse and hang up before it has read everything
            conn.sendall(data)
            if close_after:
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            head = _recv(conn, _LEN.size)
            if head is None:
                return None
            body = _recv(conn, _LEN.unpack(head)[0])
        except OSError:  # reset: it hung up without a reply
            return None
    return None if body is None else json.loads(body)


def _recv(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def headers(pool_ids: list[str], epoch: int, tiny: LayoutFingerprint
            ) -> st.SearchStrategy[bytes]:
    fingerprint = st.sampled_from([tiny, LayoutFingerprint("other", "", "float32", 2, 2, 16,
                                                           16, 0, 1)])
    runs = st.lists(st.tuples(I32, I32), max_size=6) | st.just(((0, 1), (0, 1)))
    header = st.builds(
        WriteHeader, xfer_id=st.integers(0, 2**36 - 1),
        ticket=st.builds(TicketKey, TEXT.map(lambda s: f"fuzz-{s}"), U64),
        dst_agent_epoch=st.sampled_from([epoch]) | U64,
        dst_pool_id=st.sampled_from(pool_ids) | TEXT, fingerprint=fingerprint,
        page_bytes=st.sampled_from([tiny.page_bytes, 0, -1, 2**40]) | I32, dst_runs=runs,
        timeout_ms=F64, reply_to=st.binary(max_size=16), traceparent=TEXT,
        grant=st.binary(max_size=16))
    return header.map(WriteHeader.encode)


def malformed(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[tuple[bytes, bool]]:
    """(bytes, close after sending): whole headers, cut ones, inflated sizes, junk."""
    return st.one_of(
        valid.map(lambda h: (h, False)),
        st.tuples(valid, st.integers(1, 200)).map(lambda t: (t[0][:max(1, len(t[0]) - t[1])],
                                                             True)),
        st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
            lambda t: (_PREFIX.pack(MAGIC, VERSION, *t), True)),
        st.just((_PREFIX.pack(MAGIC, VERSION, MAX_BODY_BYTES + 1, 0), False)),
        st.just((_PREFIX.pack(MAGIC, VERSION, 2, MAX_RUNS + 1), False)),
        st.just((_PREFIX.pack(MAGIC, VERSION, 4, 0) + b"\xff\xfe{}", False)),
        st.just((_PREFIX.pack(MAGIC, VERSION, 2, 0) + b"[]", False)),
        st.binary(min_size=1, max_size=64).map(lambda b: (b, True)),
    )


def test_tcp_data_port_refuses_malformed_and_forged_writes(guarded):
    fs = guarded
    info = _info(fs, "agent-b")
    address = info.tcp_address
    assert address, "agent-b runs the TCP transport"
    refused: dict[str, int] = {}

    @settings(FUZZ, max_examples=60)
    @given(malformed(headers(list(info.pool_ids), info.epoch,
                             wire.fingerprint_from_pb(fs.stats("decode-0").fingerprint))))
    def run(case: tuple[bytes, bool]) -> None:
        data, close_after = case
        reply = _exchange(address, data, close_after)
        if reply is None:  # only a header cut short (or too large to read) goes unanswered
            assert close_after or len(data) > 60_000, f"no reply to a whole header {data[:120]!r}"
            return
        assert reply["stage"] == "ready" and reply["error"] and reply["message"], reply
        refused[reply["error"]] = refused.get(reply["error"], 0) + 1

    run()
    assert {"BadRequest", "UnknownTicket"} & set(refused), refused
    assert _info(fs, "agent-b").epoch == info.epoch  # the same agent, never restarted
