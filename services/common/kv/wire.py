"""The data path's two control messages: the write header and the receiver's reply.

One handoff on the wire (both transports):

    sender                                   receiver
    WriteHeader  ------------------------->  check ticket, epoch, pool, pages, layout
                 <-------------------------  Reply(stage="ready") or Reply(error)
    run 0 bytes, run 1 bytes, ...  ------->  straight into the destination pages
                 <-------------------------  Reply(stage="done") once every byte is resident

The header is a small fixed prefix, a JSON object and the destination runs as int32 pairs;
KV bytes never travel inside it. Nothing here does I/O. The JSON may carry the sender's W3C
`traceparent` (the receiver's kv.receive span continues the trace); a header without it, or a
receiver that does not know the key, works as before.
"""

from __future__ import annotations

import array
import base64
import dataclasses
import functools
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

from pdserve.common.kv.errors import BadRequest, KvTransferError, LayoutMismatch, from_wire
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("<4sBxxxII")  # magic, version, json bytes, number of runs
PREFIX_BYTES = _PREFIX.size
REPLY_BYTES = 1024  # a reply always fits in this many bytes (the message is cut to fit)
MAX_RUNS = 1 << 17
MAX_BODY_BYTES = 1 << 16
MAX_HEADER_BYTES = PREFIX_BYTES + MAX_BODY_BYTES + 8 * MAX_RUNS  # about 1.1 MiB
LIVENESS_INTERVAL_S = 1.0  # how often a sender waiting on a receiver checks that it still lives


def expect_same(mine: LayoutFingerprint, theirs: LayoutFingerprint, mine_name: str,
                theirs_name: str) -> None:
    """Raise LayoutMismatch naming each differing field as `field: mine != theirs`."""
    if mine == theirs:  # the common case, once per handoff on each side: no field walk
        return
    diffs = mine.mismatches(theirs)
    if diffs:
        raise LayoutMismatch(f"layout mismatch between {mine_name} and {theirs_name} pool: "
                             + "; ".join(diffs))


@functools.lru_cache(maxsize=64)
def _fingerprint_json(fp: LayoutFingerprint) -> dict[str, Any]:
    """A pool's layout as JSON fields (a few layouts per agent: made once each). Read-only."""
    return dataclasses.asdict(fp)


@functools.lru_cache(maxsize=64)
def _fingerprint(**fields: Any) -> LayoutFingerprint:
    """The layout a header names (validated once per distinct layout)."""
    return LayoutFingerprint(**fields)


def _pack_runs(runs: tuple[tuple[int, int], ...]) -> bytes:
    """The runs as little-endian int32 pairs (array, not numpy: a handoff's header is made
    and read once per handoff on its critical path, where numpy's call overhead shows)."""
    flat = array.array("i", [x for run in runs for x in run])  # OverflowError past int32
    if sys.byteorder == "big":
        flat.byteswap()
    return flat.tobytes()


def _unpack_runs(data: bytes | memoryview, offset: int, num_runs: int
                 ) -> tuple[tuple[int, int], ...]:
    flat = array.array("i")
    flat.frombytes(bytes(data[offset:offset + 8 * num_runs]))
    if len(flat) != 2 * num_runs:
        raise ValueError(f"{num_runs} runs announced, {len(flat) // 2} present")
    if sys.byteorder == "big":
        flat.byteswap()
    values = iter(flat.tolist())
    return tuple(zip(values, values))


@dataclass(frozen=True)
class WriteHeader:
    """What the receiver checks before a single byte lands: whose pages, where, what shape."""

    xfer_id: int
    ticket: TicketKey
    dst_agent_epoch: int
    dst_pool_id: str
    fingerprint: LayoutFingerprint  # the source pool's layout
    page_bytes: int
    # (first destination page, number of pages), in send order
    dst_runs: tuple[tuple[int, int], ...]
    timeout_ms: float  # how long the sender will wait; the receiver waits no longer
    reply_to: bytes = b""  # transport-specific return address (the sender's UCX worker address)
    traceparent: str = ""  # the sender's trace context (W3C), "" when not traced
    grant: bytes = b""  # the receiver's write grant for the ticket (mutual TLS; see grants)
    sender: str = ""  # the sending agent's id (per-peer byte counters), "" when not given

    @property
    def kv_bytes(self) -> int:
        return sum(n for _, n in self.dst_runs) * self.page_bytes

    def encode(self) -> bytes:
        body = json.dumps({
            "xfer_id": self.xfer_id, "request_id": self.ticket.request_id,
            "ticket_epoch": self.ticket.epoch, "dst_agent_epoch": self.dst_agent_epoch,
            "dst_pool_id": self.dst_pool_id, "fingerprint": _fingerprint_json(self.fingerprint),
            "page_bytes": self.page_bytes, "timeout_ms": self.timeout_ms,
            "reply_to": base64.b64encode(self.reply_to).decode(),
            **({"traceparent": self.traceparent} if self.traceparent else {}),
            **({"grant": base64.b64encode(self.grant).decode()} if self.grant else {}),
            **({"sender": self.sender} if self.sender else {}),
        }).encode()
        return _PREFIX.pack(MAGIC, VERSION, len(body), len(self.dst_runs)) + body + \
            _pack_runs(self.dst_runs)

    @staticmethod
    def size(prefix: bytes) -> int:
        """Total encoded size, from the first PREFIX_BYTES bytes; BadRequest if not a header."""
        magic, version, body_len, num_runs = _PREFIX.unpack_from(prefix)
        if magic != MAGIC or version != VERSION:
            raise BadRequest(f"not a pdserve KV header (magic {magic!r}, version {version})")
        if body_len > MAX_BODY_BYTES or num_runs > MAX_RUNS:
            raise BadRequest(f"KV header too large ({body_len} bytes of JSON, {num_runs} runs)")
        return int(_PREFIX.size + body_len + 8 * num_runs)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> WriteHeader:
        """Parse a header; raises BadRequest on anything malformed."""
        try:
            magic, version, body_len, num_runs = _PREFIX.unpack_from(data)
            if magic != MAGIC or version != VERSION:
                raise BadRequest(f"not a pdserve KV header (magic {magic!r}, version {version})")
            if num_runs > MAX_RUNS:
                raise BadRequest(f"{num_runs} runs in one header (limit {MAX_RUNS})")
            body = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + body_len]))
            start = _PREFIX.size + body_len
            runs = _unpack_runs(data, start, num_runs)
            return cls(
                xfer_id=int(body["xfer_id"]),
                ticket=TicketKey(str(body["request_id"]), int(body["ticket_epoch"])),
                dst_agent_epoch=int(body["dst_agent_epoch"]), dst_pool_id=str(body["dst_pool_id"]),
                fingerprint=_fingerprint(**body["fingerprint"]),
                page_bytes=int(body["page_bytes"]),
                dst_runs=runs,
                timeout_ms=float(body["timeout_ms"]),
                reply_to=base64.b64decode(body["reply_to"]),
                traceparent=str(body.get("traceparent", "")),  # checked where it is used
                grant=base64.b64decode(body.get("grant", "")),
                sender=str(body.get("sender", "")))
        except BadRequest:
            raise
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise BadRequest(f"malformed KV write header: {exc}") from None


@dataclass(frozen=True)
class Reply:
    """The receiver's answer: ready for data, done (all bytes resident), or an error."""

    stage: str  # "ready" | "done"
    error_kind: str = ""  # a class name from pdserve.common.kv.errors; empty on success
    message: str = ""

    @classmethod
    def failure(cls, stage: str, exc: KvTransferError) -> Reply:
        return cls(stage, type(exc).__name__, exc.message)

    def raise_if_error(self) -> None:
        if self.error_kind:
            raise from_wire(self.error_kind, self.message)

    def encode(self) -> bytes:
        """At most REPLY_BYTES bytes; a long message is cut."""
        message = self.message
        while True:
            data = json.dumps({"stage": self.stage, "error": self.error_kind,
                               "message": message}).encode()
            if len(data) <= REPLY_BYTES:
                return data
            message = message[:len(message) - (len(data) - REPLY_BYTES) - 8] + "..."

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Reply:
        raw = bytes(data).rstrip(b"\0")
        try:
            obj = json.loads(raw)
            return cls(str(obj["stage"]), str(obj["error"]), str(obj["message"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise KvTransferError(f"malformed reply from the receiving agent: {exc}") from None
