"""The router's HTTP port: uvicorn serving the OpenAI-compatible app on a thread of its own,
beside the gRPC server in the same process.

    http = HttpFrontDoor.start(cfg, lifecycle, ready=pool.ready, api_keys=keys)
    ...                        # SIGTERM: the gRPC bootstrap's on_drain calls http.drain()
    http.stop()                # waits for the streams in flight (up to grace_s), then stops

The socket is bound here, before anything is served, so a busy port fails the start with a
message naming the flag, and port 0 takes any free port (`http.port` says which). With
`--tls-cert`/`--tls-key` the port serves HTTPS with the same certificate as the gRPC port
(and asks for a client certificate from `--tls-ca` only with `--tls-client-auth`).
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import uvicorn
from pdserve.common.config import TlsOptions
from pdserve.common.security import ApiKeys
from pdserve.common.server import ServerStartError
from pdserve.router.http_app import HttpApi
from pdserve.router.lifecycle import Lifecycle
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig

log = logging.getLogger("pdserve.router")

BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServerStartError(f"router HTTP: cannot listen on {host}:{port} ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ServerStartError(f"router HTTP: cannot listen on {host}:{port}: port {port} is "
                               f"in use or the address is not available ({exc}); choose "
                               "another with --http-port (-1 turns it off)") from None
    return sock


class HttpServer:
    """uvicorn on its own thread and event loop, serving one pre-bound socket."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, scheme: str):
        self._server = server
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        self.scheme = scheme
        self._thread = threading.Thread(target=self._run, name="router-http", daemon=True)

    @classmethod
    def start(cls, app: ASGIApp, host: str, port: int, *, tls: TlsOptions | None = None,
              grace_s: float = 30.0) -> HttpServer:
        """Bind and start serving; raises ServerStartError naming the port."""
        ssl_options: dict[str, object] = {}
        if tls is not None and tls.tls:
            client_auth = bool(tls.tls_ca) and tls.tls_client_auth
            ssl_options = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key,
                           "ssl_ca_certs": tls.tls_ca or None,
                           "ssl_cert_reqs": ssl.CERT_REQUIRED if client_auth else ssl.CERT_NONE}
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            proxy_headers=False, backlog=BACKLOG,
            timeout_graceful_shutdown=max(1, math.ceil(grace_s)),
            **ssl_options)  # type: ignore[arg-type]
        try:
            config.load()  # reads the certificate now: a bad one fails the start, not a call
        except (OSError, ssl.SSLError) as exc:
            raise ServerStartError(f"router HTTP: cannot load the TLS certificate: {exc}"
                                   ) from None
        sock = bind(host, port)
        http = cls(uvicorn.Server(config), sock, "https" if ssl_options else "http")
        http._thread.start()
        log.info("router HTTP API (OpenAI-compatible) on %s://%s:%d/v1", http.scheme, host,
                 http.port)
        return http

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except Exception:
            log.exception("router HTTP server failed")

    def drain(self) -> None:
        """Stop accepting connections; streams in flight go on (up to the grace period)."""
        self._server.should_exit = True

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain, wait for the server to finish (up to `timeout_s`, default its grace period
        plus a second), then close the socket."""
        self.drain()
        started = time.monotonic()
        grace = self._server.config.timeout_graceful_shutdown or 0
        self._thread.join(timeout_s if timeout_s is not None else grace + 1.0)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(1.0)
        self._sock.close()
        log.info("router HTTP stopped after %.2fs", time.monotonic() - started)


class HttpFrontDoor:
    """The HTTP API of one router: the app, the threads its requests' lifecycles run on (at
    most --max-streams at once; more wait for a thread), and the server."""

    def __init__(self, server: HttpServer, executor: ThreadPoolExecutor):
        self.server = server
        self._executor = executor

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    def start(cls, cfg: RouterConfig, lifecycle: Lifecycle, *, ready: Callable[[], bool],
              api_keys: ApiKeys | None = None,
              unready_reason: Callable[[], str] | None = None) -> HttpFrontDoor:
        executor = ThreadPoolExecutor(max_workers=cfg.max_streams,
                                      thread_name_prefix="router-http-stream")
        app = HttpApi(lifecycle, executor, ready=ready, api_keys=api_keys,
                      unready_reason=unready_reason).app()
        try:
            server = HttpServer.start(app, cfg.host, cfg.http_port, tls=cfg, grace_s=cfg.grace_s)
        except ServerStartError:
            executor.shutdown(wait=False)
            raise
        return cls(server, executor)

    def drain(self) -> None:
        self.server.drain()

    def stop(self, timeout_s: float | None = None) -> None:
        self.server.stop(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
