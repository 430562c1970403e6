"""Write grants: with mutual TLS on, an agent accepts a write only for a ticket it granted to
an authenticated peer, and only from that peer.

    sender agent                                     receiving agent
    GrantWrite(ticket, reply_to) ──gRPC, mTLS──────▶ ticket expected here? not granted to
                                                     another peer? -> a random 128-bit grant,
                                ◀──── grant ──────── bound to (ticket, peer identity, reply_to)
    WriteHeader(ticket, grant, reply_to) ══UCX/TCP══▶ accept only if the grant matches the
                                                     ticket and the reply_to it was issued for

The grant travels only over the authenticated control channel, so a process that can reach
the data port but holds no certificate from the CA cannot obtain one; a header with a forged,
missing or another ticket's grant is refused (`Unauthorized`) before any byte lands. A ticket
stays bound to the first peer it was granted to: a grant for it to another identity or UCX
address is refused. A grant is dropped when its pages have landed or its ticket is cancelled,
and lives at most `ttl_s` (a sender asks again for each handoff attempt); no I/O here.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.kv.errors import Unauthorized
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.transport import IncomingWrite, WriteSink

GRANT_BYTES = 16


@dataclass(frozen=True)
class Grant:
    token: bytes
    peer: str  # the grantee's certificate identity
    reply_to: bytes  # the grantee's UCX worker address ("" for TCP: the socket is mTLS)
    expires: float


class GrantBook:
    """Grants by ticket; thread-safe. `clock` is monotonic seconds."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[TicketKey, Grant] = {}

    def issue(self, key: TicketKey, peer: str, reply_to: bytes) -> bytes:
        """A grant for `key` to `peer`; the same one again for the same peer and address."""
        if not peer:
            raise Unauthorized(f"ticket {key}: a write grant needs an authenticated peer "
                               "(a client certificate over mutual TLS)")
        now = self._clock()
        with self._lock:
            old = self._grants.get(key)
            if old is not None and old.expires > now:
                if (old.peer, old.reply_to) != (peer, reply_to):
                    raise Unauthorized(f"ticket {key} is already granted to another peer "
                                       f"({old.peer}); refused for {peer}")
                return old.token
            grant = Grant(secrets.token_bytes(GRANT_BYTES), peer, reply_to, now + self._ttl_s)
            self._grants[key] = grant
            return grant.token

    def check(self, key: TicketKey, token: bytes, reply_to: bytes) -> None:
        """Raise Unauthorized unless `token` is the live grant of `key` for `reply_to`."""
        with self._lock:
            grant = self._grants.get(key)
        if not token:
            raise Unauthorized(f"write for ticket {key} carries no grant: this agent runs with "
                               "mutual TLS and accepts writes only for tickets it granted (the "
                               "sending agent needs --tls-ca too)")
        if grant is None or grant.expires <= self._clock():
            raise Unauthorized(f"write for ticket {key}: no grant was issued for it here")
        if not hmac.compare_digest(grant.token, token):
            raise Unauthorized(f"write for ticket {key}: the grant does not match")
        if grant.reply_to and grant.reply_to != reply_to:
            raise Unauthorized(f"write for ticket {key} comes from another UCX worker than the "
                               f"one it was granted to ({grant.peer})")

    def drop(self, key: TicketKey) -> None:
        with self._lock:
            self._grants.pop(key, None)

    def sweep(self) -> None:
        now = self._clock()
        with self._lock:
            for key in [k for k, g in self._grants.items() if g.expires <= now]:
                del self._grants[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)


class GrantedSink:
    """The `WriteSink` an agent hands its transport under mutual TLS: a write header must carry
    the grant of its ticket (issued to the peer whose reply address it names) before the
    agent's own checks run. A local copy between two pools of one agent does not pass here."""

    def __init__(self, sink: WriteSink, grants: GrantBook, refused: Callable[[], None]):
        self._sink = sink
        self._grants = grants
        self._refused = refused

    def accept(self, header: WriteHeader) -> IncomingWrite:
        try:
            self._grants.check(header.ticket, header.grant, header.reply_to)
        except Unauthorized:
            self._refused()
            raise
        return self._sink.accept(header)

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        self._sink.finish(write, ok)
        if ok and getattr(write.handle, "complete", True):  # every page landed (not a part)
            self._grants.drop(write.header.ticket)
