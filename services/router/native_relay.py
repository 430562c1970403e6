"""A request's decode tokens relayed in C++ (common/csrc/token_relay.cc): no Python per message.

Where the router serves gRPC on its C++ core, the lifecycle relays the first decode message
itself and hands the rest of the sequence here; the request's thread waits (GIL released)
while each Decode message becomes a delta on the client's stream, and comes back with the
count, the finish reason and when each delta went out. On a sequence's own native Decode call
(pools past SHARED_STREAM_MAX_WORKERS decode workers, or --no-shared-decode-stream) each
message is taken on gRPC's C++ thread as it arrives (`Relay.run`): ~0.08 ms of router CPU a
message against ~0.17 in Python. On a worker's shared DecodeMany stream its reader (Python,
router/mux.py) hands each update over (`Relay.feed`), so only the relay's own part is saved.

The text must be exactly what the Python relay sends, so only tokenizers whose decode
(skip_special_tokens=True) is the UTF-8 of the tokens' bytes joined (byte-level BPE: GPT-2,
Llama 3, Qwen, SmolLM) qualify, checked at start-up token by token and on random sequences;
the others keep the Python relay (`Relayer.create` says why).
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from pdserve.common.errors import Aborted, ServiceError, Unavailable
from pdserve.common.native_calls import STATUS_CODES
from pdserve.router.cancel import CallScope, ClientCancelled

log = logging.getLogger("pdserve.router")

# What pdr_run returns (csrc/token_relay.cc)
ROUTER_FINISHED, DECODE_FINISHED, ABORTED, FAILED, NO_FINISH, CLIENT_GONE, BAD_MESSAGE = range(7)
_CHECK_SEQUENCES, _CHECK_LENGTH, _CHECK_SEED = 64, 24, 5
_p = ctypes.c_void_p
_i32_p = ctypes.POINTER(ctypes.c_int32)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (what ByteLevel decoders invert)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def token_bytes(tokenizer: Any) -> tuple[list[bytes] | None, str]:
    """Each token's bytes (b"" for a special token) where the tokenizer's decode is their
    UTF-8 joined, else (None, why not). `tokenizer`: router.tokenizer.Tokenizer."""
    backend = tokenizer.plain_backend()
    if backend is None:
        return None, "its decode is not the Rust tokenizer's alone"
    if type(backend.decoder).__name__ != "ByteLevel" or tokenizer.byte_token_ids:
        return None, "not a byte-level BPE tokenizer"
    decoder = _byte_decoder()
    special = tokenizer.special_token_ids
    table: list[bytes] = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif all(c in decoder for c in token):
            table.append(bytes(decoder[c] for c in token))
        else:
            return None, f"token {i} ({token!r}) is not in the byte-level alphabet"
    ids = list(range(len(table)))
    singles = backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
    for i, text in zip(ids, singles, strict=True):
        if text != table[i].decode(errors="replace"):
            return None, f"token {i} decodes to {text!r}, not its bytes"
    rng = random.Random(_CHECK_SEED)
    for _ in range(_CHECK_SEQUENCES):
        seq = [rng.randrange(len(table)) for _ in range(_CHECK_LENGTH)]
        joined = b"".join(table[i] for i in seq).decode(errors="replace")
        if backend.decode(seq, skip_special_tokens=True) != joined:
            return None, f"ids {seq} decode to other than their bytes joined"
    return table, ""


def _bind(lib: ctypes.CDLL) -> None:
    lib.pdr_vocab.restype = _p
    lib.pdr_vocab.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
    lib.pdr_new.restype = _p
    lib.pdr_new.argtypes = [_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, _i32_p,
                            ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_size_t]
    lib.pdr_accept.argtypes = [_p, _i32_p, ctypes.c_int, ctypes.c_char_p, _i32_p,
                               ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    lib.pdr_run.argtypes = [_p, _p, _p]
    lib.pdr_finish_reason.restype = ctypes.c_char_p
    lib.pdr_sent.argtypes = [_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_double)),
                             ctypes.POINTER(_i32_p)]
    lib.pdr_status.argtypes = [_p, ctypes.POINTER(ctypes.c_char_p)]
    lib.pdr_feed.argtypes = [_p, _p, _i32_p, ctypes.c_int, ctypes.c_char_p]
    for name in ("pdr_vocab_free", "pdr_free", "pdr_tokens", "pdr_finish_reason"):
        getattr(lib, name).argtypes = [_p]


@dataclass
class Outcome:
    """How a native relay ended, and what it sent."""

    code: int                      # ROUTER_FINISHED .. BAD_MESSAGE
    tokens: int                    # the request's completion tokens so far
    finish_reason: str
    sent: list[tuple[float, int]]  # (monotonic time, tokens) of each delta with tokens
    status: int = 0                # FAILED: the Decode call's status code
    details: str = ""


class Relay:
    """One request's relay (its completion state): `accept` one message (tests), or `run`."""

    def __init__(self, lib: ctypes.CDLL, vocab: int, request_id: str, max_tokens: int,
                 tokens: int, eos: Sequence[int], stops: Sequence[str], held: str):
        self._lib = lib
        stop_bytes = [s.encode() for s in stops if s]
        packed = b"".join(struct.pack("<I", len(s)) + s for s in stop_bytes)
        eos_array = (ctypes.c_int32 * max(1, len(eos)))(*eos)
        held_bytes = held.encode()
        self._handle = lib.pdr_new(vocab, request_id.encode(), max_tokens, tokens, eos_array,
                                   len(eos), packed, len(stop_bytes), held_bytes, len(held_bytes))

    def accept(self, token_ids: Sequence[int], finish_reason: str = ""
               ) -> tuple[list[int], str] | None:
        """What one Decode message makes (taken tokens, text); None: decode aborted."""
        ids = (ctypes.c_int32 * max(1, len(token_ids)))(*token_ids)
        taken = (ctypes.c_int32 * max(1, len(token_ids)))()
        text, size = ctypes.c_char_p(), ctypes.c_size_t()
        n = self._lib.pdr_accept(self._handle, ids, len(token_ids), finish_reason.encode(),
                                 taken, ctypes.byref(text), ctypes.byref(size))
        if n < 0:
            return None
        return list(taken[:n]), ctypes.string_at(text, size.value).decode()

    @property
    def finish_reason(self) -> str:
        """"stop" or "length" once the request is finished ("" before)."""
        return (self._lib.pdr_finish_reason(self._handle) or b"").decode()

    def run(self, server_call: int, decode_call: int) -> Outcome:
        """Relay until the sequence ends, the call fails or the client is gone."""
        return self.outcome(self._lib.pdr_run(self._handle, server_call, decode_call))

    def feed(self, server_call: int, token_ids: Sequence[int], finish_reason: str) -> int:
        """One Decode message handed over (a shared stream's update), sent on to the client's
        call: the outcome's code, or -1 while the sequence goes on."""
        ids = (ctypes.c_int32 * max(1, len(token_ids)))(*token_ids)
        return int(self._lib.pdr_feed(self._handle, server_call, ids, len(token_ids),
                                      finish_reason.encode()))

    def outcome(self, code: int, status: int = 0, details: str = "") -> Outcome:
        """The outcome `code` with what was sent; `status`, `details`: a failure the caller
        saw (FAILED), else the Decode call's own."""
        lib = self._lib
        at, counts = ctypes.POINTER(ctypes.c_double)(), _i32_p()
        n = lib.pdr_sent(self._handle, ctypes.byref(at), ctypes.byref(counts))
        if not status:
            text = ctypes.c_char_p()
            status = lib.pdr_status(self._handle, ctypes.byref(text))
            details = (text.value or b"").decode(errors="replace")
        return Outcome(code, lib.pdr_tokens(self._handle),
                       (lib.pdr_finish_reason(self._handle) or b"").decode(),
                       [(at[i], counts[i]) for i in range(n)], status, details)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.pdr_free(handle)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def settle(outcome: Outcome, completion: Any, clock: Any, observe_itl: Callable[[float], None],
           scope: CallScope, address: str) -> bool:
    """What a native relay did, as the Python relay (lifecycle._relay) would have: the
    completion's count and finish, the clock and its ITL samples, the errors it raises; True
    when decode itself finished the sequence. `completion`: lifecycle.Completion; `clock`:
    timing.TokenClock."""
    completion.tokens = outcome.tokens
    for at, tokens in outcome.sent:
        gap_s = clock.sent(tokens, at)
        if gap_s is not None:
            observe_itl(gap_s)
    if outcome.code in (ROUTER_FINISHED, DECODE_FINISHED):
        completion.finish_reason = outcome.finish_reason
        return outcome.code == DECODE_FINISHED
    if outcome.code == ABORTED:
        raise Aborted(f"decode {address} aborted the sequence after {outcome.tokens} tokens")
    if outcome.code == CLIENT_GONE or scope.cancelled:
        raise ClientCancelled()
    if outcome.code == FAILED:
        code = STATUS_CODES.get(outcome.status, grpc.StatusCode.UNKNOWN).name
        raise ServiceError(f"decode {address} (decoding) failed after {outcome.tokens} tokens "
                           f"were streamed: {code} {outcome.details}", code)
    if outcome.code == BAD_MESSAGE:
        raise ServiceError(f"decode {address} (decoding): a Decode message that does not parse "
                           f"after {outcome.tokens} tokens", "INTERNAL")
    raise Unavailable(f"decode {address} (decoding): stream ended without a finish reason "
                      f"after {outcome.tokens} tokens")


class Relayer:
    """The served tokenizer's vocabulary in C++, for every request's `Relay`."""

    def __init__(self, lib: ctypes.CDLL, table: Sequence[bytes]):
        _bind(lib)
        self.lib = lib
        offsets = [0]
        for token in table:
            offsets.append(offsets[-1] + len(token))
        blob = b"".join(table)
        self._vocab = lib.pdr_vocab(blob, (ctypes.c_uint32 * len(offsets))(*offsets),
                                    len(table))

    @classmethod
    def create(cls, lib: ctypes.CDLL | None, tokenizer: Any) -> Relayer | None:
        """A relayer for the served tokenizer; None (and why, logged) where it cannot be."""
        if lib is None:
            return None
        table, why = token_bytes(tokenizer)
        if table is None:
            log.info("tokens relayed in Python: the tokenizer does not qualify for the native "
                     "relay (%s)", why)
            return None
        log.info("gRPC clients' tokens relayed in C++ (a vocabulary of %d tokens)",
                 len(table))
        return cls(lib, table)

    def relay(self, request_id: str, max_tokens: int, tokens: int, eos: Sequence[int],
              stops: Sequence[str], held: str) -> Relay:
        return Relay(self.lib, self._vocab, request_id, max_tokens, tokens, eos, stops, held)
