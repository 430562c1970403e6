"""Settings shared by the prefill, decode and co-located workers (each adds its own on top)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from pdserve.common.config import ServerConfig, option, require
from pdserve.common.models import DEFAULT_MODEL, builtin_models_help

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig(ServerConfig):
    model: str = option(DEFAULT_MODEL, "a local Hugging Face model directory, or a built-in "
                                       f"model: {builtin_models_help()}")
    dtype: str = option("auto", "weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                        choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N")
    block_size: int = option(16, "tokens per KV page")
    num_pages: int = option(0, "KV pages in the pool (0: from --kv-cache-mb); it must hold "
                               "one full-context sequence")
    kv_cache_mb: int = option(0, "KV pool size in MiB when --num-pages is 0; it must hold one "
                                 "full-context sequence (0: 512 MiB, grown to hold one)")
    max_model_len: int = option(0, "longest sequence served, prompt + output tokens (0: the "
                                   "model's context); lower it to serve a small pool")
    chunk_size: int = option(512, "prompt tokens per sequence per prefill step")
    max_num_seqs: int = option(256, "sequences in one decode batch")
    max_prefill_tokens: int = option(2048, "prompt tokens of all sequences in one prefill step")
    kv_agent: str = option("127.0.0.1:50081", "host:port of this host's kvtransfer agent (a "
                                              "loopback host is advertised to other hosts' "
                                              "agents as --advertise-host)")
    kv_agent_socket: str = option("", "the agent's local socket (its --local-socket: a path, "
                                      "or @NAME); default: the one the agent advertises")
    kv_agent_wait_s: float = option(60.0, "how long a starting worker waits for its kvtransfer "
                                          "agent to answer (s)")
    worker_id: str = option("", "name in stats, traces and logs (default: "
                                "role@advertise-host:port)")
    advertise_host: str = option("127.0.0.1", "address other hosts reach this worker and its "
                                              "agent at (the pod IP in Kubernetes)")
    threads: int = option(0, "torch threads (per rank with --tp; 0: this process's CPU "
                             "allowance, i.e. its cores capped by its cgroup CPU quota, as a "
                             "pod's limits set them, divided among the ranks)")
    tp: int = option(1, "tensor-parallel ranks: one process each on its share of this "
                        "worker's cores, the model's heads and MLP split between them; it must "
                        "divide the attention heads, the KV heads and the MLP size")
    warmup: bool = option(True, "run one throwaway request before reporting SERVING")
    prefix_cache: bool = option(True, "keep full KV pages after their request, named by a hash "
                                      "of their prefix, and reuse them for later prompts that "
                                      "start the same (--no-prefix-cache: off)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.block_size > 0, "block_size", self.block_size, "> 0")
        require(self.num_pages >= 0, "num_pages", self.num_pages, ">= 0")
        require(self.kv_cache_mb >= 0, "kv_cache_mb", self.kv_cache_mb,
                ">= 0 (0 = sized for the context)")
        require(self.max_model_len >= 0, "max_model_len", self.max_model_len,
                ">= 0 (0 = the model's context)")
        require(self.chunk_size > 0, "chunk_size", self.chunk_size, "> 0")
        require(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "> 0")
        require(self.max_prefill_tokens > 0, "max_prefill_tokens", self.max_prefill_tokens, "> 0")
        require(self.threads >= 0, "threads", self.threads, ">= 0 (0 = the CPU allowance)")
        require(self.tp >= 1, "tp", self.tp, ">= 1")
        require(self.kv_agent_wait_s > 0, "kv_agent_wait_s", self.kv_agent_wait_s, "> 0")
        require(":" in self.kv_agent and not _unspecified(self.kv_agent.rpartition(":")[0]),
                "kv_agent", self.kv_agent, "host:port of the agent")
        require(bool(self.advertise_host) and not _unspecified(self.advertise_host),
                "advertise_host", self.advertise_host, "an address peers can connect to")
        require(self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
                "cpu, cuda or cuda:N")

    @property
    def kv_agent_for_peers(self) -> str:
        """The agent's address as other hosts reach it (decode workers hand it out in every
        reservation): --kv-agent, its host replaced by --advertise-host when it is a loopback
        address (the agent beside the worker, as a sidecar shares a pod's network)."""
        host, _, port = self.kv_agent.rpartition(":")
        if _loopback(host) and not _loopback(self.advertise_host):
            host = self.advertise_host
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else \
            f"{host}:{port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _loopback(host: str) -> bool:
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def _unspecified(host: str) -> bool:
    ip = _ip(host)
    return ip is not None and ip.is_unspecified
