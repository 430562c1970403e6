"""The agent's configuration: flags with `PDSERVE_KVTRANSFER_*` twins (see
pdserve.common.config)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pdserve.common.config import METRICS_PORT_HELP, ServerConfig, option, require

SERVICE = "kvtransfer"
TRANSPORTS = ("ucx", "tcp")


@dataclass(frozen=True)
class AgentConfig(ServerConfig):
    """pdserve kvtransfer: the per-host agent that moves KV pages between workers' pools."""

    port: int = option(50081, "gRPC port")
    metrics_port: int = option(9081, METRICS_PORT_HELP)
    advertise_host: str = option("127.0.0.1", "host peers use to reach this agent's data port")
    transport: str = option("ucx", "data path between agents", choices=TRANSPORTS)
    data_port: int = option(0, "TCP data listener port, --transport tcp (0 = any free port)")
    tcp_write_kb: int = option(512, "--transport tcp: bytes of one socket write (KiB); a whole "
                                    "run in one write leaves ACKs waiting and the link half "
                                    "used")
    tcp_rcvlowat_kb: int = option(256, "--transport tcp: a receiver reading a handoff is woken "
                                       "once this much has arrived, not at every segment "
                                       "(KiB; 0: at every segment)")
    tcp_buffer_mb: float = option(0.0, "--transport tcp: send and receive buffers of each data "
                                       "connection (MiB; 0: the kernel's autotuning)")
    agent_id: str = option("", "this agent's name in logs and errors (default: the host name)")
    ucx_error_handling: bool = option(False, "UCX peer-error handling: survives a peer dying "
                                             "mid-copy, but disables shared memory and CMA "
                                             "(loopback TCP even on one host)")
    local_socket: str = option("", "Unix socket for this host's workers (their pools' "
                                   "descriptors, the per-handoff calls) and same-host peers: a "
                                   "path (e.g. in a volume the worker's and peers' pods share), "
                                   "or @NAME in the abstract namespace (shared by one network "
                                   "namespace only); default @pdserve-kvtransfer-PORT")
    same_host_copy: bool = option(True, "when a peer agent's local socket is reachable from "
                                        "here (same host), copy pages straight from the "
                                        "sender's pool (one memory copy) instead of the network "
                                        "transport")
    default_timeout_s: float = option(30.0, "handoff timeout when SendPages gives none (s)")
    cancel_wait_s: float = option(10.0, "longest CancelTransfer waits for an in-flight write (s)")
    grace_s: float = option(10.0, "on SIGTERM, how long in-flight calls may take to finish (s)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.transport in TRANSPORTS, "transport", self.transport, " or ".join(TRANSPORTS))
        require(0 <= self.data_port <= 65535, "data_port", self.data_port, "0..65535")
        require(4 <= self.tcp_write_kb <= 1 << 20, "tcp_write_kb", self.tcp_write_kb,
                "4..1048576")
        require(0 <= self.tcp_rcvlowat_kb <= 1 << 20, "tcp_rcvlowat_kb", self.tcp_rcvlowat_kb,
                "0..1048576")
        require(0 <= self.tcp_buffer_mb <= 1024, "tcp_buffer_mb", self.tcp_buffer_mb,
                "0..1024 (0: autotuned)")
        require(bool(self.advertise_host) and self.advertise_host not in ("0.0.0.0", "::"),
                "advertise_host", self.advertise_host, "an address peers can connect to")
        require(not self.local_socket.startswith("@") or len(self.local_socket) > 1,
                "local_socket", self.local_socket, "a path or @NAME")
        for name in ("default_timeout_s", "cancel_wait_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "> 0")

    @property
    def name(self) -> str:
        return self.agent_id or socket.gethostname()
