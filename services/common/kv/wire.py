"""The data path's two control messages: the write header and the receiver's reply.

One handoff on the wire (both transports):

    sender                                   receiver
    WriteHeader  ------------------------->  check ticket, epoch, pool, pages, layout
                 <-------------------------  Reply(stage="ready") or Reply(error)
    run 0 bytes, run 1 bytes, ...  ------->  straight into the destination pages
                 <-------------------------  Reply(stage="done") once every byte is resident

The header is a small fixed prefix (magic, version, body bytes, number of runs), a binary body
(fixed-width fields, then the strings and bytes whose lengths it gives) and the destination
runs as int32 pairs, all little-endian; KV bytes never travel inside it. The body is binary,
not JSON: a header is made and read once per handoff on its critical path, right after a copy
has pushed everything out of the caches, where a JSON round trip with its objects costs about
90 us and this about 30 (docs/benchmarks.md). The layout's fields go as JSON bytes, made once
per layout and parsed once per distinct layout. Nothing here does I/O. The sender's W3C
`traceparent` (the receiver's kv.receive span continues the trace) is empty when not traced.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.common.kv.errors import (
    BadRequest,
    KvTransferError,
    LayoutMismatch,
    PeerUnavailable,
    from_wire,
)
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey

MAGIC = b"PDKV"
# 1: JSON body; 2: TCP waited for "ready" before every handoff's bytes; 3: before any byte of
# one over 1 MiB (now its first MiB goes right behind the header)
VERSION = 4
_PREFIX = struct.Struct("<4sBxxxII")  # magic, version, body bytes, number of runs
# xfer_id, ticket epoch, destination agent epoch, page_bytes, timeout_ms, then the byte
# lengths of: request_id, dst_pool_id, fingerprint (JSON), traceparent, sender, reply_to, grant
_FIXED = struct.Struct("<QQQqd7I")
PREFIX_BYTES = _PREFIX.size
REPLY_BYTES = 1024  # a reply always fits in this many bytes (the message is cut to fit)
MAX_RUNS = 1 << 17
MAX_BODY_BYTES = 1 << 16
MAX_HEADER_BYTES = PREFIX_BYTES + MAX_BODY_BYTES + 8 * MAX_RUNS  # about 1.1 MiB
LIVENESS_INTERVAL_S = 1.0  # how often a sender waiting on a receiver checks that it still lives
LIVENESS_FAILURES = 3  # unanswered checks in a row before a sender gives up on its receiver
Liveness = Callable[[], None]  # raises when the receiver is known gone


def counted_liveness(ask: Callable[[], None]) -> Liveness:
    """A sender's liveness check from `ask` (which raises StaleEpoch when the receiver's agent
    restarted, PeerUnavailable when it did not answer): a restart ends the wait at once, an
    unanswered ask only the LIVENESS_FAILURES-th in a row."""
    failures = 0

    def check() -> None:
        nonlocal failures
        try:
            ask()
            failures = 0
        except PeerUnavailable:
            failures += 1
            if failures >= LIVENESS_FAILURES:
                raise
    return check


def expect_same(mine: LayoutFingerprint, theirs: LayoutFingerprint, mine_name: str,
                theirs_name: str) -> None:
    """Raise LayoutMismatch naming each differing field as `field: mine != theirs`."""
    if mine is theirs or mine == theirs:  # the common case, once per handoff on each side
        return
    diffs = mine.mismatches(theirs)
    if diffs:
        raise LayoutMismatch(f"layout mismatch between {mine_name} and {theirs_name} pool: "
                             + "; ".join(diffs))


@functools.lru_cache(maxsize=64)
@functools.lru_cache(maxsize=64)
def fingerprint_bytes(fp: LayoutFingerprint) -> bytes:
    """A pool's layout as a header carries it: JSON bytes (a few layouts per agent: made once
    each). A receiver armed for native writes compares these bytes."""
    return json.dumps(dataclasses.asdict(fp), separators=(",", ":")).encode()


@functools.lru_cache(maxsize=64)
def _fingerprint(data: bytes) -> LayoutFingerprint:
    """The layout a header names (parsed and validated once per distinct layout)."""
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise ValueError("the layout is not a JSON object")
    return LayoutFingerprint(**fields)


@functools.lru_cache(maxsize=64)
def _runs_struct(num_runs: int) -> struct.Struct:
    """The runs of a header as little-endian int32 pairs: one struct per run count, so a
    header's runs are packed and read in one call each (a handoff's critical path)."""
    return struct.Struct(f"<{2 * num_runs}i")


@functools.lru_cache(maxsize=256)
def _strings_struct(lengths: tuple[int, ...]) -> struct.Struct:
    """The header's strings, by their lengths (few distinct sets: read in one call)."""
    return struct.Struct("<" + "".join(f"{n}s" for n in lengths))


def pack_runs(runs: Sequence[tuple[int, int]]) -> bytes:
    """(start, n) pairs as a header carries them (int32, little-endian); BadRequest past int32.
    The native same-host write takes its spans in the same form."""
    try:
        return _runs_struct(len(runs)).pack(*[x for run in runs for x in run])
    except struct.error as exc:
        raise BadRequest(f"a write header field is out of range: {exc}") from None


def _unpack_runs(data: bytes | memoryview, offset: int, num_runs: int
                 ) -> tuple[tuple[int, int], ...]:
    values = iter(_runs_struct(num_runs).unpack_from(data, offset))
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
        strings = (self.ticket.request_id.encode(), self.dst_pool_id.encode(),
                   fingerprint_bytes(self.fingerprint), self.traceparent.encode(),
                   self.sender.encode(), self.reply_to, self.grant)
        try:
            fixed = _FIXED.pack(self.xfer_id, self.ticket.epoch, self.dst_agent_epoch,
                                self.page_bytes, self.timeout_ms, *map(len, strings))
        except struct.error as exc:
            raise BadRequest(f"a write header field is out of range: {exc}") from None
        body_len = len(fixed) + sum(map(len, strings))  # the receiver refuses it past the limit
        return b"".join((_PREFIX.pack(MAGIC, VERSION, body_len, len(self.dst_runs)), fixed,
                         *strings, pack_runs(self.dst_runs)))

    @staticmethod
    def size(prefix: bytes) -> int:
        """Total encoded size, from the first PREFIX_BYTES bytes; BadRequest if not a header."""
        magic, version, body_len, num_runs = _PREFIX.unpack_from(prefix)
        if magic != MAGIC or version != VERSION:
            raise BadRequest(f"not a pdserve KV header (magic {magic!r}, version {version})")
        if body_len > MAX_BODY_BYTES or num_runs > MAX_RUNS:
            raise BadRequest(f"KV header too large ({body_len} bytes of body, {num_runs} runs)")
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
            fixed = _FIXED.unpack_from(data, _PREFIX.size)
            xfer_id, ticket_epoch, dst_epoch, page_bytes, timeout_ms = fixed[:5]
            lengths = fixed[5:]
            at = _PREFIX.size + _FIXED.size
            if sum(lengths) != body_len - _FIXED.size:
                raise ValueError(f"a body of {body_len} bytes with {sum(lengths)} bytes of "
                                 "strings")
            request_id, pool_id, fingerprint, traceparent, sender, reply_to, grant = \
                _strings_struct(lengths).unpack_from(data, at)
            at += body_len - _FIXED.size
            return cls(xfer_id, TicketKey(request_id.decode(), ticket_epoch), dst_epoch,
                       pool_id.decode(), _fingerprint(fingerprint), page_bytes,
                       _unpack_runs(data, at, num_runs), timeout_ms, reply_to,
                       traceparent.decode(),  # checked where it is used
                       grant, sender.decode())
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
