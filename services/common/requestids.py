"""Request ids: the one the client gave (or the router made up), and the one each attempt's
workers and agents see.

The client's id labels its request wherever the client or an operator looks: the responses,
the router's logs, metrics and traces. It need not be unique: a client may send the same id
again at once, or for two requests at the same time. The workers and agents key their state
by request id (the prefill engine's sequences, the decode worker's reservations, the agents'
tickets, which they remember for a minute after closing them so that a late write is refused
precisely), so each attempt of each request gets its own id there:
`<client id>#<attempt>.<8 hex digits drawn once per request>`. It starts with the client's id,
so grepping the workers' logs for it (and fail points matching it) still work; spans and outcome
lines carry the client's id as `request_id` and this one as `attempt_id`.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

_SUFFIX = re.compile(r"#\d+\.[0-9a-f]{8}\Z")


def new_nonce() -> str:
    """Drawn once per request: what tells two requests with the same client id apart."""
    return secrets.token_hex(4)


def attempt_id(client_id: str, attempt: int, nonce: str) -> str:
    """The id the workers and agents see for the `attempt`-th attempt (1-based)."""
    return f"{client_id}#{attempt}.{nonce}"


def client_id(request_id: str) -> str:
    """The client's id inside an attempt id (any other id is returned as it is)."""
    suffix = _SUFFIX.search(request_id)
    return request_id[:suffix.start()] if suffix else request_id


def labelled(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with an attempt id in `request_id` split into the client's id (`request_id`)
    and the attempt's (`attempt_id`); other fields as they are."""
    rid = fields.get("request_id")
    if not isinstance(rid, str) or client_id(rid) == rid:
        return fields
    return {**fields, "request_id": client_id(rid), "attempt_id": rid}
