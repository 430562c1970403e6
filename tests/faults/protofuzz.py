"""Hypothesis strategies for malformed and extreme protobuf requests, built from the messages'
descriptors, and a raw-bytes caller for any gRPC method.

Every request is sent as bytes, so a strategy can also produce what no client library would:
bytes that do not parse as the message, invalid UTF-8 in a string field, unknown fields,
truncated messages.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Deterministic in CI and everywhere: no example database, derandomized.
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck), print_blob=False)

I32 = st.sampled_from([0, 1, -1, 2, 15, 16, 17, 63, 64, 2**31 - 1, -(2**31)]) | st.integers(
    -(2**31), 2**31 - 1)
I64 = st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]) | st.integers(-(2**63), 2**63 - 1)
U64 = st.sampled_from([0, 1, 2**64 - 1, 2**63]) | st.integers(0, 2**64 - 1)
F64 = st.sampled_from([0.0, -1.0, 1.0, 0.5, 1e308, -1e308, math.inf, -math.inf, math.nan,
                       5e-324]) | st.floats()
F32 = st.sampled_from([0.0, -1.0, 1.0, 0.5, 3.4e38, math.inf, -math.inf, math.nan]) | st.floats(
    width=32)
TEXT = st.sampled_from(["", " ", "x" * 200_000, "\x00", "🎉" * 1000, "../../etc/passwd",
                        "a" * 64]) | st.text(max_size=40)
BYTES = st.sampled_from([b"", b"\x00" * 100_000]) | st.binary(max_size=64)

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    d.FieldDescriptor.TYPE_INT32: I32, d.FieldDescriptor.TYPE_SINT32: I32,
    d.FieldDescriptor.TYPE_INT64: I64, d.FieldDescriptor.TYPE_SINT64: I64,
    d.FieldDescriptor.TYPE_UINT64: U64, d.FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    d.FieldDescriptor.TYPE_DOUBLE: F64, d.FieldDescriptor.TYPE_FLOAT: F32,
    d.FieldDescriptor.TYPE_BOOL: st.booleans(), d.FieldDescriptor.TYPE_STRING: TEXT,
    d.FieldDescriptor.TYPE_BYTES: BYTES, d.FieldDescriptor.TYPE_FIXED64: U64,
}

Overrides = dict[str, st.SearchStrategy[Any]]  # "Message.field" -> strategy of its value


def messages(cls: type[Message], overrides: Overrides | None = None,
             depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `cls` with any subset of fields set to extreme values (repeated fields:
    short lists, or one long list)."""
    fields = _field_values(cls, overrides or {}, depth)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for name, strategy in fields.items():
            value = draw(st.none() | strategy)
            if value is not None:
                _set(msg, name, value)
        return msg
    return build()


def mutants(template: Message, overrides: Overrides | None = None) -> st.SearchStrategy[Message]:
    """`template` (a valid request) with one field set to an extreme value: each field's
    checks are reached with everything else in order."""
    fields = _field_values(type(template), overrides or {}, 0)

    def mutate(name: str) -> st.SearchStrategy[Message]:
        def with_value(value: Any) -> Message:
            msg = type(template)()
            msg.CopyFrom(template)
            msg.ClearField(name)
            _set(msg, name, value)
            return msg
        return fields[name].map(with_value)
    return st.sampled_from(sorted(fields)).flatmap(mutate)


def _field_values(cls: type[Message], overrides: Overrides,
                  depth: int) -> dict[str, st.SearchStrategy[Any]]:
    desc = cls.DESCRIPTOR
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        key = f"{desc.name}.{f.name}"
        if key in overrides:
            value = overrides[key]
        elif f.type == d.FieldDescriptor.TYPE_MESSAGE:
            if depth > 2:
                continue
            value = messages(f.message_type._concrete_class, overrides, depth + 1)
        else:
            value = _SCALARS[f.type]
        if f.is_repeated and key not in overrides:
            value = st.lists(value, max_size=6) | (
                st.lists(value, min_size=1, max_size=1).map(lambda x: x * 5000)
                if f.type != d.FieldDescriptor.TYPE_MESSAGE else st.just([]))
        fields[f.name] = value
    return fields


def _set(msg: Message, name: str, value: Any) -> None:
    field = msg.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        getattr(msg, name).extend(value)
    elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


def unknown_fields() -> st.SearchStrategy[bytes]:
    """Encoded fields with numbers no pdserve message uses (varint, length-delimited)."""
    number = st.integers(min_value=100, max_value=2**29 - 1)
    varint = number.map(lambda n: _varint(n << 3) + _varint(7))
    blob = st.tuples(number, st.binary(max_size=32)).map(
        lambda t: _varint(t[0] << 3 | 2) + _varint(len(t[1])) + t[1])
    return st.lists(varint | blob, min_size=1, max_size=3).map(b"".join)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire_requests(cls: type[Message], overrides: Overrides | None = None,
                  template: Message | None = None) -> st.SearchStrategy[bytes]:
    """What a fuzzer sends: mostly a valid `template` with one field extreme; else a message
    with any fields extreme (sometimes with unknown fields after it), the message cut short,
    invalid UTF-8 in a string field, or arbitrary bytes."""
    msg = messages(cls, overrides).map(lambda m: m.SerializeToString())
    near = (mutants(template, overrides) if template is not None
            else messages(cls, overrides)).map(lambda m: m.SerializeToString())
    string_fields = [f.number for f in cls.DESCRIPTOR.fields
                     if f.type == d.FieldDescriptor.TYPE_STRING]
    bad_utf8 = st.sampled_from(string_fields or [1]).map(
        lambda n: _varint(n << 3 | 2) + b"\x03\xff\xfe\xc0")
    return st.one_of(
        near, near, near, near,
        msg,
        st.tuples(near, unknown_fields()).map(b"".join),
        st.tuples(msg, st.integers(1, 50)).map(_cut),
        bad_utf8,
        st.binary(min_size=1, max_size=64),
    )


def _cut(case: tuple[bytes, int]) -> bytes:
    data, n = case
    return data[:-n] if len(data) > 1 else b"\x0a"  # a length prefix with nothing after it


def raw_unary(channel: grpc.Channel, method: str) -> Callable[..., bytes]:
    return channel.unary_unary(method, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)


def raw_stream(channel: grpc.Channel, method: str) -> Callable[..., Any]:
    return channel.unary_stream(method, request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)


OUTCOMES: dict[str, Counter[str]] = {}  # method -> status code -> examples (the run's summary)

EXAMPLES: dict[tuple[str, str], str] = {}  # (method, code) -> the first message seen

BAD_CODES = frozenset({"UNKNOWN", "INTERNAL", "DATA_LOSS"})


def check_outcome(method: str, request: bytes, call: Callable[[], object],
                  allow_deadline: bool = False) -> str:
    """Run `call`; it must succeed or fail with a named status and a message (an unexpected
    exception in a handler shows as UNKNOWN, a crash as UNAVAILABLE). Returns the code."""
    tally = OUTCOMES.setdefault(method.rpartition(".")[2], Counter())
    try:
        call()
        tally["OK"] += 1
        return "OK"
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    tally[code] += 1
    EXAMPLES.setdefault((method.rpartition(".")[2], code), details[:160])
    assert code not in BAD_CODES, f"{method} answered {code} {details!r} to {request[:200]!r}"
    assert code != "UNAVAILABLE" or "connect" not in details.lower(), \
        f"{method}: the server went away on {request[:200]!r}: {details}"
    assert code != "DEADLINE_EXCEEDED" or allow_deadline, f"{method} hung on {request[:200]!r}"
    assert details.strip(), f"{method} answered {code} without a message"
    return code
