"""The receiving agent's native same-host write (the second half of csrc/kvcopy.c).

A same-host handoff is one memory copy; what it added on top was the receiving agent's Python
around it: ~90 us of header parsing, checks and bookkeeping before the copy and ~40 us after,
each step several times its warm cost right after a wake-up (docs/benchmarks.md). Here the
common case runs in C without the interpreter:

    decode worker's expect  ->  TicketBook.expect arms the ticket here (its reserved spans,
                                the pool's address, its layout, the lease)
    shm_write arrives       ->  `write`: the header must match an armed ticket exactly; then
                                the copy (stopping at a cancel), the ticket marked done, and
                                the reply on the socket, all in one call without the GIL
    a TCP header arrives    ->  `recv`: the same checks, then "ready" (unless eager), the
                                runs read from the socket into the pages, "done" (tcp.py)
    anything else           ->  declined: the Python path serves it and refuses with the reason

The TicketBook stays the authority. Before it decides anything about an armed ticket it takes
the ticket back (`take`), learning whether a native write landed, stopped, or is in flight.
A pool is registered here while it is mapped: closing it waits for native writes into it, and
no later write goes there. Armed only where nothing else must see each write: no write grants
(mutual TLS), no tracing (kv.receive spans), no failpoints; `PDSERVE_NO_NATIVE_RECEIVE=1` (or
no native library) turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

from pdserve.common import fastcopy
from pdserve.common.kv.errors import BadRequest
from pdserve.common.kv.wire import pack_runs
from pdserve.common.tickets import TicketKey

ABSENT, ARMED, WRITING, DONE, ABORTED = range(5)  # a ticket's state here (kvcopy.c)
DECLINED, REPLIED, STOPPED, SEND_FAILED, BROKEN, TIMED_OUT = range(6)  # what a write did
MAX_SPANS = 16  # more spans than this are served by the Python path
ENV_OFF = "PDSERVE_NO_NATIVE_RECEIVE"

_i64, _u64, _u32, _ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
_BOUND: list[ctypes.CDLL] = []  # libraries whose argtypes are set


def _bind(lib: ctypes.CDLL) -> None:
    lib.pdserve_kv_table_new.restype = _ptr
    lib.pdserve_kv_pool_open.argtypes = [_ptr, ctypes.c_size_t, _u64, ctypes.POINTER(_u64)]
    lib.pdserve_kv_pool_close.argtypes = [_ptr, ctypes.c_int]
    lib.pdserve_kv_arm.argtypes = [_ptr, ctypes.c_char_p, _u32, _u64, ctypes.c_int, _u64,
                                   ctypes.c_char_p, _u32, _u64, ctypes.c_char_p, _u32, _i64,
                                   ctypes.c_char_p, _u32, _i64]
    lib.pdserve_kv_take.argtypes = [_ptr, ctypes.c_char_p, _u32, _u64, ctypes.c_int, _i64,
                                    ctypes.POINTER(_i64), ctypes.POINTER(ctypes.c_double)]
    lib.pdserve_kv_write.argtypes = [_ptr, ctypes.c_char_p, _u64, ctypes.c_size_t, _u64,
                                     ctypes.c_char_p, _u32, ctypes.c_int, _u64, _u64,
                                     ctypes.POINTER(_i64)]
    lib.pdserve_kv_recv.argtypes = [_ptr, ctypes.c_char_p, _u64, ctypes.c_int, _u64,
                                    ctypes.c_char_p, _u32, ctypes.c_char_p, _u32, _u64,
                                    ctypes.c_int, ctypes.POINTER(_i64)]
    lib.pdserve_kv_recv_rest.argtypes = [_ptr, ctypes.c_void_p, _u64, ctypes.c_int, _u64,
                                         ctypes.c_char_p, _u32, ctypes.c_char_p, _u32, _u64,
                                         ctypes.c_int, ctypes.POINTER(_i64)]


class NativeReceiver:
    """One agent's armed tickets and registered pools (thread-safe: the C side locks)."""

    def __init__(self, lib: Any):
        self._lib = lib
        self._table = lib.pdserve_kv_table_new()
        if not self._table:
            raise MemoryError("no memory for the native receive table")

    @classmethod
    def create(cls) -> NativeReceiver | None:
        """The table, or None where it is off or the native library is missing."""
        if os.environ.get(ENV_OFF):
            return None
        lib = fastcopy.library()
        if lib is None:
            return None
        if lib not in _BOUND:
            _bind(lib)
            _BOUND.append(lib)
        return cls(lib)

    # ---- pools ------------------------------------------------------------------------
    def open_pool(self, address: int, size: int) -> tuple[int, int]:
        """Register a mapped pool: (handle, generation); handle -1 when the table is full."""
        gen = _u64()
        handle = self._lib.pdserve_kv_pool_open(self._table, address, size, ctypes.byref(gen))
        return int(handle), int(gen.value)

    def close_pool(self, handle: int) -> None:
        """No native write goes into the pool any more; returns once none is in flight."""
        if handle >= 0:
            self._lib.pdserve_kv_pool_close(self._table, handle)

    # ---- tickets ----------------------------------------------------------------------
    def arm(self, key: TicketKey, pool: tuple[int, int], pool_id: str, agent_epoch: int,
            fingerprint: bytes, page_bytes: int, spans: Sequence[tuple[int, int]],
            deadline_s: float) -> bool:
        """Let a same-host write of exactly `spans` for `key` be served natively until
        `deadline_s` (time.monotonic). False when not armed (the Python path serves it)."""
        handle, gen = pool
        if handle < 0 or not 0 < len(spans) <= MAX_SPANS:
            return False
        rid, pid = key.request_id.encode(), pool_id.encode()
        try:
            packed = pack_runs(spans)
        except BadRequest:
            return False
        return int(self._lib.pdserve_kv_arm(
            self._table, rid, len(rid), key.epoch, handle, gen, pid, len(pid), agent_epoch,
            fingerprint, len(fingerprint), page_bytes, packed, len(spans),
            int(deadline_s * 1e9))) == 0

    def take(self, key: TicketKey, abort: bool = False, wait_s: float = 0.0
             ) -> tuple[int, int, float]:
        """Take the ticket back: (state, bytes landed, when in unix ms). A write in flight is
        stopped at its next slice when `abort`, and waited for up to `wait_s`; WRITING (the
        ticket stays here) when it has not ended by then."""
        rid = key.request_id.encode()
        out, done_ms = (_i64 * 1)(), ctypes.c_double()
        state = self._lib.pdserve_kv_take(self._table, rid, len(rid), key.epoch, int(abort),
                                          int(wait_s * 1e9), out, ctypes.byref(done_ms))
        return int(state), int(out[0]) if state == DONE else 0, float(done_ms.value)

    def write(self, header: bytes, src_address: int, src_size: int, src_runs: Any, fd: int,
              slice_bytes: int, out: Any) -> int:
        """Serve one shm_write natively (see the module docstring): the sender's pool is
        mapped at `src_address`, `src_size` bytes; `out[0]` gets the bytes written. DECLINED
        when it cannot (not armed, anything different, runs outside the mapping, malformed)."""
        try:
            n = len(src_runs)
            if not 0 < n <= MAX_SPANS:
                return DECLINED
            runs = pack_runs([(start, count) for start, count in src_runs])
        except (TypeError, ValueError, BadRequest):
            return DECLINED
        return int(self._lib.pdserve_kv_write(
            self._table, header, len(header), src_address, src_size, runs, n, fd, slice_bytes,
            fastcopy.STREAM_MIN_BYTES, out))


    def recv(self, header: bytes, fd: int, eager_bytes: int, ready: bytes, done: bytes,
             lowat: int, slice_ms: int, out: Any) -> int:
        """Serve one TCP handoff natively, its header just read from the data connection `fd`
        (plain): "ready" unless it is at most `eager_bytes`, the runs read into the reserved
        pages (woken per `lowat` bytes, checks every `slice_ms`), `done` sent; `ready` and
        `done` are the wire's encoded replies; `out[0]` gets the bytes read. DECLINED (nothing
        read) when it cannot; STOPPED (a cancel), BROKEN, TIMED_OUT, SEND_FAILED: see
        kvcopy.c's pdserve_kv_recv."""
        return int(self._lib.pdserve_kv_recv(
            self._table, header, len(header), fd, eager_bytes, ready, len(ready), done,
            len(done), lowat, slice_ms, out))


    def recv_rest(self, buf: bytearray, fd: int, eager_bytes: int, ready: bytes, done: bytes,
                  lowat: int, slice_ms: int, out: Any) -> int:
        """`recv`, the header's first PREFIX_BYTES bytes in `buf` and the rest still on the
        socket: read here into `buf` first (one call less through the interpreter before the
        bytes are read). `out[1]` gets the header's length once read whole (a DECLINED one is
        then in `buf`), 0 when nothing more was read (not a pdserve header, longer than `buf`:
        DECLINED; the connection failed: BROKEN, TIMED_OUT)."""
        address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        return int(self._lib.pdserve_kv_recv_rest(
            self._table, address, len(buf), fd, eager_bytes, ready, len(ready), done,
            len(done), lowat, slice_ms, out))


def out_buffer() -> Any:
    """The values `write` and `recv` report through (one per connection: no per-call
    alloc)."""
    return (_i64 * 2)()
