"""`python -m pdserve.router.main`: the router process (no torch: tokenization only).

Makes torch unimportable here, loads the model directory's tokenizer (transformers'
AutoTokenizer), starts checking the workers, and serves
`pdserve.v1.Router` until SIGTERM/SIGINT. The workers are checked once before either port
answers; SERVING (and HTTP /health and /v1/models 200) once at least one prefill and one
decode worker are healthy.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import grpc
from pdserve.common import native_grpc
from pdserve.common.config import parse_config
from pdserve.common.heap import freeze_startup_heap
from pdserve.common.logs import setup_logging
from pdserve.common.metrics import DISABLED, serve_metrics
from pdserve.common.models import ModelRef, resolve_model_name
from pdserve.common.security import (
    ApiKeyInterceptor,
    ApiKeys,
    ChannelSecurity,
    ServerTls,
    server_credentials,
)
from pdserve.common.server import ServerStartError, serve
from pdserve.common.tracing import setup_tracing, shutdown_tracing
from pdserve.router.cache_feed import CacheFeeds
from pdserve.router.cache_index import CacheIndex
from pdserve.router.config import SERVICE, RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.http_server import HttpFrontDoor
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.native_relay import Relayer
from pdserve.router.peers import PeerPlacements
from pdserve.router.pool import WorkerPool
from pdserve.router.servicer import RouterServicer
from pdserve.router.tokenizer import Tokenizer, hide_torch
from pdserve.v1 import router_pb2_grpc

log = logging.getLogger("pdserve.router")

BUILTIN_TIMEOUT_S = 900.0
# Young collections after 20,000 net allocations, not 700: a request's objects die with it
# (reference counts), and at 150 req/s the default walked them 15-20 times a second for nothing.
GC_YOUNG_THRESHOLD = 20_000


def model_dir(ref: ModelRef) -> Path:
    """The model's directory; a built-in one is created if missing by a child process (which
    may import torch; this one must not)."""
    if ref.path is not None:
        return ref.path
    assert ref.builtin_size is not None
    argv = [sys.executable, "-m", "pdserve.engine.builtin", "ensure", ref.builtin_size]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILTIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv[1:])} took over {BUILTIN_TIMEOUT_S:.0f}s") from None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv[1:])} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return Path(lines[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the router; returns the process exit status."""
    hide_torch()  # transformers then loads only the tokenizer (see router/tokenizer.py)
    cfg = parse_config(RouterConfig, SERVICE, argv, prog="pdserve router")
    setup_logging(cfg.log_format, cfg.log_level, service=SERVICE)
    try:
        ref = resolve_model_name(cfg.model)
        directory = model_dir(ref)
        tokenizer = Tokenizer.from_dir(directory)
    except (OSError, RuntimeError, ValueError) as exc:
        log.error("cannot load the tokenizer: %s", exc)
        return 1
    try:
        native = native_grpc.choose(cfg.grpc_library)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    log.info("gRPC on %s", "its C++ core (native)" if native is not None else "grpcio")
    model_name = cfg.model_name or ref.name
    setup_tracing("pdserve-router")
    log.info("serving model %s from %s (vocab %d, context %s, eos %s)", model_name, directory,
             tokenizer.vocab_size, tokenizer.max_context, sorted(tokenizer.eos_token_ids))
    try:
        api_keys = ApiKeys.from_file(cfg.api_key_file) if cfg.api_key_file else None
    except (OSError, ValueError) as exc:
        log.error("--api-key-file: %s", exc)
        return 1
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys is not None else []
    feeds = (CacheFeeds(CacheIndex(max_pages=cfg.cache_index_max_pages))
             if cfg.cache_aware else None)
    pool = WorkerPool(interval_s=cfg.health_interval_s,
                      security=ChannelSecurity.from_options(cfg),
                      on_checked=feeds.sync if feeds is not None else None, cache=feeds,
                      shared_decode_stream=cfg.shared_decode_stream,
                      native_calls=native)
    discovery = Discovery(pool, cfg.targets("prefill"), cfg.targets("decode"),
                          interval_s=cfg.discovery_interval_s)
    lifecycle = Lifecycle(pool, tokenizer, model_name, max_retries=cfg.max_retries,
                          prefill_timeout_s=cfg.prefill_timeout_s,
                          reserve_timeout_s=cfg.reserve_timeout_s,
                          decode_start_timeout_s=cfg.decode_start_timeout_s,
                          renew_lease_s=cfg.lease_ms / 1e3, cache=feeds, weights=cfg.weights,
                          remote_prefill_min_tokens=cfg.remote_prefill_min_tokens,
                          stream_interval=cfg.stream_interval,
                          relayer=Relayer.create(native if cfg.native_relay else None,
                                                 tokenizer))
    servicer = RouterServicer(lifecycle, cfg.max_streams)
    peers: PeerPlacements | None = None
    if cfg.peers and feeds is not None:
        peers = PeerPlacements(cfg.targets("peers"), feeds,
                               security=ChannelSecurity.from_options(cfg),
                               api_key_file=cfg.api_key_file)
        lifecycle.metrics.watch_peers(peers.counts)
    elif cfg.peers:
        log.warning("--peers has no use with --no-cache-aware: nothing is told to them")
    lifecycle.metrics.watch_pool(pool.counts, lambda: discovery.failures)
    if feeds is not None:
        index = feeds.index
        lifecycle.metrics.watch_cache_index(index.sizes, lambda: index.evicted)
    metrics = serve_metrics(lifecycle.metrics.registry, cfg.metrics_port, cfg.host,
                            service=SERVICE)
    discovery.start()
    pool.start()
    if peers is not None:
        peers.start()
    # The first check of every worker before either port answers (bounded by the check's
    # timeout): a router started beside SERVING workers is ready from its first answer.
    pool.wait_checked(pool.timeout_s + 1.0)
    # the workers' channels and stubs, the tokenizer, ...; then fewer young collections
    freeze_startup_heap(SERVICE, young_threshold=GC_YOUNG_THRESHOLD)
    http: HttpFrontDoor | None = None
    try:
        if cfg.http_port != DISABLED:
            http = HttpFrontDoor.start(cfg, lifecycle, ready=pool.ready, api_keys=api_keys,
                                       unready_reason=pool.unready_reason)

        def drain() -> None:
            lifecycle.stop_admitting()
            if http is not None:
                http.drain()

        def add(server: grpc.Server) -> None:
            router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
            if peers is not None:
                router_pb2_grpc.add_RouterPeersServicer_to_server(peers.servicer, server)

        return serve(SERVICE, cfg.port, add,
                     host=cfg.host, ready=pool.ready, grace_s=cfg.grace_s,
                     on_drain=drain, max_workers=cfg.max_streams + 8,
                     credentials=server_credentials(cfg), interceptors=interceptors,
                     native=native, tls=ServerTls.from_options(cfg))
    except ServerStartError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if http is not None:
            http.stop()
        discovery.close()
        if peers is not None:
            peers.close()
        if feeds is not None:
            feeds.close()
        lifecycle.close()
        pool.close()
        shutdown_tracing()
        if metrics is not None:
            metrics.close()


if __name__ == "__main__":
    sys.exit(main())
