"""TLS, mutual TLS and API keys for every pdserve hop (see docs/security.md).

Built once at start-up from a service's `TlsOptions` (flags / env twins) and handed to whatever
opens a port or a channel:

    tls = ChannelSecurity.from_options(cfg)          # None when TLS is off
    channel = open_channel("decode-0:50071", tls)    # secure_channel or insecure_channel
    creds = server_credentials(cfg)                  # None: add_insecure_port as before

With every TLS option empty, nothing changes: plaintext ports and channels.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pdserve.common.config import TlsOptions

log = logging.getLogger("pdserve.security")

AUTH_HEADER = "authorization"
BEARER = "bearer "
# Open without a key: health (probes) and reflection (the schema of an open-source API, so
# `grpcurl list` and a keyless health check work); everything else needs one.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


@dataclass(frozen=True)
class ServerTls:
    """A port's TLS: its certificate and key, the CA its callers' certificates must chain to
    ("" = none asked for), and whether a caller must present one (`require_client`)."""

    cert: str
    key: str
    ca: str = ""
    require_client: bool = False

    @classmethod
    def from_options(cls, opts: TlsOptions) -> ServerTls | None:
        """None (plaintext) without --tls-cert; callers must present a certificate only with
        --tls-ca and --tls-client-auth."""
        if not opts.tls:
            return None
        return cls(opts.tls_cert, opts.tls_key, opts.tls_ca,
                   bool(opts.tls_ca) and opts.tls_client_auth)

    def pems(self) -> tuple[bytes, bytes, bytes | None]:
        """The certificate chain, the key and the CA (None: none), read now."""
        return _read(self.cert), _read(self.key), _read(self.ca) if self.ca else None


def server_credentials(opts: TlsOptions) -> grpc.ServerCredentials | None:
    """The port's credentials (ServerTls.from_options): None when TLS is off."""
    tls = ServerTls.from_options(opts)
    if tls is None:
        return None
    cert, key, ca = tls.pems()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=tls.require_client)


@dataclass(frozen=True)
class ChannelSecurity:
    """How this process calls other services over TLS: the CA file it trusts ("" = the
    system roots), the certificate and key it presents ("" = none), the name it expects in
    their certificates ("" = the host of the address). Files are read when a channel opens."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    @classmethod
    def from_options(cls, opts: TlsOptions) -> ChannelSecurity | None:
        """None when TLS is off. The own certificate is presented only in mutual TLS."""
        if not opts.tls:
            return None
        mutual = bool(opts.tls_ca)
        return cls(ca=opts.tls_ca, cert=opts.tls_cert if mutual else "",
                   key=opts.tls_key if mutual else "", server_name=opts.tls_server_name)

    def pems(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The trusted roots, the own key and certificate chain (None: not set), read now."""
        def read(path: str) -> bytes | None:
            return _read(path) if path else None

        return read(self.ca), read(self.key), read(self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        roots, key, chain = self.pems()
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key,
                                            certificate_chain=chain)

    def options(self) -> tuple[tuple[str, Any], ...]:
        if not self.server_name:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)

    def ssl_client_context(self) -> ssl.SSLContext:
        """The same trust and certificate for a plain socket (the TCP KV data path)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def ssl_server_context(opts: TlsOptions) -> ssl.SSLContext | None:
    """A server-side SSLContext from the same options (the TCP KV data path); None: off."""
    if not opts.tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    if opts.tls_ca:
        ctx.load_verify_locations(cafile=opts.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if opts.tls_client_auth else ssl.CERT_NONE
    return ctx


def open_channel(address: str, security: ChannelSecurity | None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to another pdserve service: TLS when `security` is given, else plaintext."""
    if security is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, security.credentials(),
                               options=[*options, *security.options()])


def peer_identity(context: grpc.ServicerContext) -> str:
    """The authenticated caller's certificate identity (its first subject alternative name or
    common name); "" when the call did not come over mutual TLS."""
    identities = context.peer_identities()
    return identities[0].decode(errors="replace") if identities else ""


# --- API keys ------------------------------------------------------------------------------

def load_api_keys(path: str) -> frozenset[bytes]:
    """The SHA-256 digests of the keys in `path`: one key per line, `#` comments and blank
    lines ignored. Raises ValueError naming the file when it holds no key."""
    return frozenset(_digest(k) for k in _api_keys(path))


def first_api_key(path: str) -> str:
    """The first key of an API key file: what a router presents to its peers (which read the
    same file). Raises OSError, or ValueError naming the file when it holds no key."""
    return _api_keys(path)[0]


def _api_keys(path: str) -> list[str]:
    keys = [line.strip() for line in Path(path).read_text().splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"{path}: no API key in the file (one key per line)")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value; None if not one."""
    if header is None or not header.lower().startswith(BEARER):
        return None
    return header[len(BEARER):].strip() or None


class ApiKeys:
    """A set of accepted API keys, compared by digest in constant time."""

    def __init__(self, digests: Iterable[bytes]):
        self._digests = tuple(digests)

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """The keys of `path`, read again when the file changes (see `KeyFile`)."""
        return KeyFile(path)

    def digests(self) -> tuple[bytes, ...]:
        return self._digests

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` (the header's value) carries a valid key, else why not."""
        token = bearer_token(authorization)
        if token is None:
            return ("missing API key: send the header 'authorization: Bearer <key>'"
                    if authorization is None else
                    "malformed authorization header: expected 'Bearer <key>'")
        digest = _digest(token)
        ok = False
        for known in self.digests():  # no early exit: the time does not tell which key
            ok |= hmac.compare_digest(digest, known)
        return None if ok else "invalid API key"


class KeyFile(ApiKeys):
    """The keys of a file, re-read when its modification time or size changes (looked at
    most once per `recheck_s`), so keys rotate without a restart: add the new key, move the
    clients, remove the old one. A file that becomes unreadable or empty keeps the old keys
    (logged), never locks everybody out by accident."""

    def __init__(self, path: str, recheck_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._recheck_s = recheck_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        super().__init__(load_api_keys(path))
        self._checked = clock()

    def _stat(self) -> tuple[int, int]:
        st = os.stat(self._path)
        return st.st_mtime_ns, st.st_size

    def digests(self) -> tuple[bytes, ...]:
        now = self._clock()
        if now - self._checked >= self._recheck_s and self._lock.acquire(blocking=False):
            try:
                self._checked = now
                self._reload()
            finally:
                self._lock.release()
        return self._digests

    def _reload(self) -> None:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            digests = tuple(load_api_keys(self._path))
        except (OSError, ValueError) as exc:
            log.warning("API keys not reloaded, the previous ones stay in force: %s", exc)
            return
        self._stamp, self._digests = stamp, digests
        log.info("API keys reloaded from %s: %d keys", self._path, len(digests))


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses every call without a valid `authorization: Bearer <key>` header with
    UNAUTHENTICATED, except grpc.health.v1 (probes) and server reflection (OPEN_PREFIXES)."""

    def __init__(self, keys: ApiKeys):
        self._keys = keys

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_PREFIXES):
            return continuation(details)
        header = next((str(v) for k, v in details.invocation_metadata or ()
                       if k == AUTH_HEADER), None)
        why = self._keys.check(header)
        if why is None:
            return continuation(details)
        handler = continuation(details)
        return _refusal(handler, why)


def _refusal(handler: Any, why: str) -> Any:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(deny)
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)
