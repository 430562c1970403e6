"""The router's configuration: flags with `PDSERVE_ROUTER_*` twins (see pdserve.common.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.common.config import METRICS_PORT_HELP, ServerConfig, option, require
from pdserve.common.models import DEFAULT_MODEL, builtin_models_help
from pdserve.common.native_grpc import CHOICES as GRPC_LIBRARIES
from pdserve.common.stream_interval import MAX_INTERVAL
from pdserve.router.cache_index import MAX_PAGES
from pdserve.router.placement import Weights
from pdserve.router.targets import FORMS, Target, parse_target

SERVICE = "router"


@dataclass(frozen=True)
class RouterConfig(ServerConfig):
    """pdserve router: the public Generate API in front of prefill and decode workers."""

    port: int = option(50051, "gRPC port")
    metrics_port: int = option(9051, METRICS_PORT_HELP)
    http_port: int = option(8000, "OpenAI-compatible HTTP API port (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health; 0 = any free "
                                   "port, -1 = off); HTTPS with --tls-cert")
    prefill: tuple[str, ...] = option((), "prefill workers, comma-separated host:port and "
                                          "dns:///NAME:PORT (every address record of NAME is "
                                          "a worker)")
    decode: tuple[str, ...] = option((), "decode workers, comma-separated host:port and "
                                         "dns:///NAME:PORT (every address record of NAME is a "
                                         "worker)")
    discovery_interval_s: float = option(5.0, "how often dns:/// targets are resolved again (s)")
    peers: tuple[str, ...] = option((), "the other router replicas of this pool, host:port and "
                                        "dns:///NAME:PORT (itself among them is fine): each "
                                        "tells the others where it placed prompts, so their "
                                        "prefix-cache indexes know before the workers' own "
                                        "events arrive (seconds apart past 128 workers)")
    model: str = option(DEFAULT_MODEL, "Hugging Face model directory (its tokenizer and config "
                                       "are read), or a built-in model: "
                                       f"{builtin_models_help()}")
    model_name: str | None = option(None, "the served model's name (default: the directory "
                                          "name, SmolLM2-135M-Instruct, or builtin-<size>)")
    max_retries: int = option(1, "retries on other workers before the first token")
    prefill_timeout_s: float = option(120.0, "deadline of one Prefill call (s)")
    reserve_timeout_s: float = option(5.0, "deadline of one Reserve call (s)")
    decode_start_timeout_s: float = option(30.0, "longest wait for a decode worker to start a "
                                                 "handed-off sequence (its first message) (s)")
    lease_ms: float = option(5000.0, "lease of a decode reservation while its request is "
                                     "alive: renewed every quarter of it (Decode/Renew), so a "
                                     "dead router's pages come back after it (ms; 0: no "
                                     "renewal, leases last --prefill-timeout-s + 10 s)")
    health_interval_s: float = option(1.0, "how often every worker's health and Stats are read (s)")
    cache_aware: bool = option(True, "place requests where their prompt's KV already is: follow "
                                     "every worker's prefix-cache events and weigh the tokens "
                                     "each would not have to compute or receive against its "
                                     "load (--no-cache-aware: by load only)")
    cache_index_max_pages: int = option(MAX_PAGES, "(worker, page) entries the router's "
                                                   "prefix-cache index holds, ~110 bytes each; "
                                                   "past it the workers holding the most lose "
                                                   "their least recently used pages first")
    shared_decode_stream: bool = option(True, "run every sequence on a decode worker over one "
                                              "DecodeMany stream, one message per engine step "
                                              "(--no-shared-decode-stream: a Decode call per "
                                              "sequence, one message per token)")
    grpc_library: str = option("auto", "what carries the router's gRPC (its port, its calls to "
                                       "workers): native is gRPC's C++ core, ~14% less router "
                                       "CPU a request, built on first use (needs libgrpc++-dev, "
                                       "g++, pkg-config); auto = native where it builds, else "
                                       "grpcio", choices=GRPC_LIBRARIES)
    native_relay: bool = option(True, "with the native gRPC library, relay a gRPC client's "
                                      "decode tokens in C++ for byte-level BPE tokenizers: "
                                      "~35% less router CPU a token where a sequence has its "
                                      "own Decode call (past 64 decode workers), ~7% on a "
                                      "shared stream (--no-native-relay: in Python)")
    cache_weight: float = option(1.0, "placement cost per prompt token a worker would have to "
                                      "compute or receive")
    sequence_weight: float = option(32.0, "placement cost per sequence already in a decode "
                                          "worker's batch, in prompt tokens")
    max_imbalance: float = option(1.5, "a decode worker with more than this many times the "
                                       "least loaded one's sequences (plus --imbalance-slack) "
                                       "is passed over, however much of the prompt it holds")
    imbalance_slack: int = option(4, "sequences a decode worker may run over the "
                                     "--max-imbalance line")
    placement_sample: int = option(32, "in a pool larger than this, a request weighs this many "
                                       "workers drawn at random, plus those holding its "
                                       "prompt's first page (each role); 0: always every worker")
    remote_prefill_min_tokens: int = option(256, "a prompt whose part the chosen decode worker "
                                                 "lacks is shorter than this many tokens is "
                                                 "prefilled by the decode worker itself (no "
                                                 "prefill call, no KV handoff; measured in "
                                                 "docs/benchmarks.md); 0: never")
    stream_interval: int = option(1, "tokens per message a client gets after the first: decode "
                                     "workers send a sequence's tokens N at a time, so the "
                                     "router reads and writes a message per N tokens (its CPU "
                                     "per token falls ~N-fold; the client sees bursts of N); "
                                     "1: every token as it is made")
    max_streams: int = option(256, "Generate streams served at once (server threads), per API; "
                                   "over it a gRPC Generate is refused at once with "
                                   "RESOURCE_EXHAUSTED")
    tls_client_auth: bool = option(False, "with --tls-ca, refuse clients of the public API "
                                          "without a certificate from that CA")
    api_key_file: str = option("", "file of accepted API keys, one a line: every call but "
                                   "health and reflection needs 'authorization: Bearer <key>' "
                                   "(default: no keys asked)")

    def __post_init__(self) -> None:
        super().__post_init__()
        for role in ("prefill", "decode"):
            entries = getattr(self, role)
            require(bool(entries), role, entries, f"at least one {FORMS}")
            for entry in entries:
                try:
                    parse_target(entry)
                except ValueError as exc:
                    raise ValueError(f"{role}={entry!r}: {exc}") from None
        for entry in self.peers:
            try:
                parse_target(entry)
            except ValueError as exc:
                raise ValueError(f"peers={entry!r}: {exc}") from None
        require(bool(self.model.strip()), "model", self.model,
                "a model directory or a built-in model")
        require(not self.api_key_file or os.path.isfile(self.api_key_file), "api_key_file",
                self.api_key_file, "a readable file of API keys")
        require(-1 <= self.http_port <= 65535, "http_port", self.http_port,
                "0..65535, or -1 (off)")
        require(self.cache_index_max_pages > 0, "cache_index_max_pages",
                self.cache_index_max_pages, "> 0")
        require(self.max_streams > 0, "max_streams", self.max_streams, "> 0")
        for name in ("cache_weight", "sequence_weight", "imbalance_slack",
                     "remote_prefill_min_tokens"):
            require(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        require(self.max_imbalance >= 1, "max_imbalance", self.max_imbalance, ">= 1")
        require(0 <= self.max_retries <= 10, "max_retries", self.max_retries, "0..10")
        require(self.placement_sample >= 0, "placement_sample", self.placement_sample,
                ">= 0 (0 = every worker)")
        require(1 <= self.stream_interval <= MAX_INTERVAL, "stream_interval",
                self.stream_interval, f"1..{MAX_INTERVAL}")
        require(0 <= self.lease_ms < 1e9, "lease_ms", self.lease_ms, ">= 0 (0 = not renewed)")
        for name in ("prefill_timeout_s", "reserve_timeout_s", "health_interval_s",
                     "discovery_interval_s", "decode_start_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "> 0")

    @property
    def weights(self) -> Weights:
        return Weights(self.cache_weight, self.sequence_weight, self.max_imbalance,
                       self.imbalance_slack, sample=self.placement_sample)

    def targets(self, role: str) -> list[Target]:
        """The parsed --prefill, --decode or --peers entries."""
        return [parse_target(entry) for entry in getattr(self, role)]
