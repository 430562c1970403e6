"""`python -m pdserve.kvtransfer.main`: the per-host KV transfer agent process.

Starts the data path (UCX worker or TCP listener) and the local socket (workers' pools and
fast lane, same-host peers), then serves pdserve.v1.KVTransfer with health and reflection
through the shared bootstrap; on SIGTERM/SIGINT health turns NOT_SERVING, in-flight calls get
`--grace-s`, then the local socket and the transport stop and pools are unmapped.
"""

from __future__ import annotations

import logging
import sys

from pdserve.common import fastcopy
from pdserve.common.config import parse_config
from pdserve.common.heap import freeze_startup_heap
from pdserve.common.logs import setup_logging
from pdserve.common.metrics import serve_metrics
from pdserve.common.security import ChannelSecurity, server_credentials, ssl_server_context
from pdserve.common.server import ServerStartError, start
from pdserve.common.tracing import setup_tracing, shutdown_tracing
from pdserve.kvtransfer.agent import Agent
from pdserve.kvtransfer.config import SERVICE, AgentConfig
from pdserve.kvtransfer.local import LocalServer, default_address
from pdserve.kvtransfer.servicer import KVTransferServicer
from pdserve.kvtransfer.transport import Transport
from pdserve.v1 import kvtransfer_pb2_grpc

log = logging.getLogger("pdserve.kvtransfer")


def make_transport(cfg: AgentConfig) -> Transport:
    """The configured transport (UCX is imported only when chosen)."""
    if cfg.transport == "tcp":
        from pdserve.kvtransfer.tcp import TcpTransport
        security = ChannelSecurity.from_options(cfg)
        return TcpTransport(cfg.host, cfg.data_port, cfg.advertise_host,
                            server_tls=ssl_server_context(cfg),
                            client_tls=security.ssl_client_context() if security else None,
                            tls_server_name=cfg.tls_server_name,
                            buffer_bytes=int(cfg.tcp_buffer_mb * (1 << 20)),
                            write_bytes=cfg.tcp_write_kb << 10,
                            rcvlowat_bytes=cfg.tcp_rcvlowat_kb << 10)
    from pdserve.kvtransfer.ucx import UcxTransport
    return UcxTransport(error_handling=cfg.ucx_error_handling)


def main(argv: list[str] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit status."""
    cfg = parse_config(AgentConfig, SERVICE, argv, prog="pdserve kvtransfer")
    setup_logging(cfg.log_format, cfg.log_level, service=SERVICE)
    setup_tracing("pdserve-kvtransfer", instance_id=cfg.name)
    local_socket = cfg.local_socket or default_address(cfg.port)
    # The copy library is built or loaded now, not inside the first big handoff.
    log.info("KV copies of %d MiB and more: streaming stores (%s)",
             fastcopy.STREAM_MIN_BYTES >> 20, fastcopy.isa())
    agent = Agent(cfg.name, make_transport(cfg), default_timeout_s=cfg.default_timeout_s,
                  cancel_wait_s=cfg.cancel_wait_s, security=ChannelSecurity.from_options(cfg),
                  grant_writes=bool(cfg.tls_ca) and cfg.tls_client_auth,
                  local_socket=local_socket, same_host_copy=cfg.same_host_copy)
    local = LocalServer(agent, local_socket)
    try:
        agent.start()
    except (OSError, RuntimeError) as exc:
        log.error("cannot start the %s data path: %s", cfg.transport, exc)
        agent.close()
        return 1
    try:
        local.start()
    except OSError as exc:
        log.error("cannot listen on the local socket %s: %s (--local-socket)", local_socket, exc)
        agent.close()
        return 1
    servicer = KVTransferServicer(agent)
    freeze_startup_heap(SERVICE)
    metrics = serve_metrics(agent.metrics.registry, cfg.metrics_port, cfg.host, service=SERVICE)
    try:
        handle = start(SERVICE, cfg.port,
                       lambda server: kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(
                           servicer, server),
                       host=cfg.host, grace_s=cfg.grace_s, max_workers=64,
                       credentials=server_credentials(cfg))
    except ServerStartError as exc:
        log.error("%s", exc)
        if metrics is not None:
            metrics.close()
        local.close()
        agent.close()
        return 1
    try:
        return handle.wait()
    finally:
        if metrics is not None:
            metrics.close()
        local.close()
        agent.close()
        shutdown_tracing()
        log.info("agent %s stopped", agent.agent_id)


if __name__ == "__main__":
    sys.exit(main())
