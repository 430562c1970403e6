"""Prometheus metrics of every pdserve service: each name is defined here, all start `pdserve_`.

Times are seconds (`_seconds`), sizes bytes (`_bytes`), counters end in `_total`. Each
service's object (`RouterMetrics`, `WorkerMetrics`, `AgentMetrics`) owns its own
`CollectorRegistry` (never the global one, so tests stay isolated) and `serve_metrics` exposes
it as text on `http://<host>:<metrics_port>/metrics`.

Per-token figures (ITL, TPOT) are histogram observations at the router, one per message or
request. Gauges that mirror engine state (pages, sequences, queue depth) are read from the
worker's `stats()` when scraped, so nothing is done per step or per token.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.common.engine_metrics import FAST_BUCKETS, LATENCY_BUCKETS, EngineMetrics
from pdserve.common.heap import gc_pauses
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("pdserve.metrics")

PREFIX = "pdserve_"
DISABLED = -1  # metrics_port value that turns the endpoint off
UNKNOWN_PEER = "unknown"  # a sender that did not name itself (an older agent)

GBPS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)


def outcome_of(code: str) -> str:
    """A gRPC status code name -> the request outcome: ok, cancelled or error."""
    return {"OK": "ok", "CANCELLED": "cancelled"}.get(code, "error")


@contextlib.contextmanager
def count_outcome(counter: Counter) -> Iterator[None]:
    """Count the enclosed call once in `counter`, labelled by its status code name: OK, the
    raised `ServiceError`'s code (a status name), else INTERNAL."""
    code = "OK"
    try:
        yield
    except BaseException as exc:
        status = getattr(exc, "code", None)
        code = status if isinstance(status, str) else str(getattr(status, "name", "INTERNAL"))
        raise
    finally:
        counter.labels(code).inc()


class RouterMetrics:
    """Per request at the router: the TTFT breakdown, ITL, TPOT, end to end, outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("pdserve_requests", "Generate requests by outcome "
                                "(ok, error, cancelled), gRPC status code and API (grpc, "
                                "http); once each", ("outcome", "code", "api"), registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Generate requests being served",
                               registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "request received -> stream ended",
                             ("outcome", "api"), buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "request received -> first token sent",
                              ("api",), buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve_queue_seconds", "request received -> prefill compute "
                               "started (TTFT component)", buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve_prefill_seconds", "prefill compute, first layer to "
                                 "first token (TTFT component)", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.kv_transfer = Histogram("pdserve_kv_transfer_seconds", "KV ready on prefill -> "
                                     "resident on decode (TTFT component)", ("transport",),
                                     buckets=FAST_BUCKETS, registry=r)
        self.kv_transfer_total = Histogram(
            "pdserve_kv_transfer_total_seconds", "the whole KV transfer's duration (time spent "
            "moving pages); pipelined with chunked prefill, only pdserve_kv_transfer_seconds of "
            "it adds to TTFT", ("transport",), buckets=FAST_BUCKETS, registry=r)
        self.decode_start = Histogram("pdserve_decode_start_seconds", "KV resident on decode "
                                      "-> sequence live in its batch (TTFT component)",
                                      buckets=FAST_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "gap between consecutive token messages "
                             "sent to the client", buckets=FAST_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "per request: (last token - first "
                              "token) / (tokens - 1)", buckets=FAST_BUCKETS, registry=r)
        self.kv_bytes = Counter("pdserve_kv_bytes", "KV bytes handed off for requests, by "
                                "transport", ("transport",), registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of valid requests",
                                     registry=r)
        self.completion_tokens = Counter("pdserve_completion_tokens", "tokens streamed to "
                                         "clients", registry=r)
        self.relay_merged = Counter(
            "pdserve_relay_merged_messages", "decode messages a client got inside the one ahead "
            "of them because the router's relay had fallen behind its decode worker: a router "
            "core near saturation (add a router replica, or raise --stream-interval)",
            registry=r)
        self.relayed_natively = Counter(
            "pdserve_relayed_natively", "requests whose decode tokens the router relayed in C++ "
            "(gRPC clients, a byte-level tokenizer; the rest in Python)",
            registry=r)
        self.retries = Counter("pdserve_retries", "extra attempts (other workers) before a "
                               "request's first token", registry=r)

    def started(self) -> None:
        self.in_flight.inc()

    def first_token(self, queue_ms: float, prefill_ms: float, kv_transfer_ms: float,
                    ttft_ms: float, kv_bytes: int, transport: str, attempts: int,
                    api: str = "grpc", kv_transfer_total_ms: float | None = None) -> None:
        """The first token went out: TTFT and its components (decode_start comes apart)."""
        self.ttft.labels(api).observe(ttft_ms / 1e3)
        self.queue.observe(queue_ms / 1e3)
        self.prefill.observe(prefill_ms / 1e3)
        if transport:  # no handoff when the request ended at its first token
            self.kv_transfer.labels(transport).observe(kv_transfer_ms / 1e3)
            total_ms = kv_transfer_ms if kv_transfer_total_ms is None else kv_transfer_total_ms
            self.kv_transfer_total.labels(transport).observe(total_ms / 1e3)
            self.kv_bytes.labels(transport).inc(kv_bytes)
        self.retries.inc(max(0, attempts - 1))

    def finished(self, code: str, e2e_s: float, prompt_tokens: int, completion_tokens: int,
                 tpot_ms: float, api: str = "grpc") -> None:
        """The request ended (once per request, whatever the outcome); `tpot_ms` 0 when it
        had fewer than two tokens."""
        outcome = outcome_of(code)
        self.requests.labels(outcome, code, api).inc()
        self.e2e.labels(outcome, api).observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if tpot_ms > 0:
            self.tpot.observe(tpot_ms / 1e3)
        self.in_flight.dec()

    def refused(self, code: str, api: str) -> None:
        """A request its front door refused before the lifecycle saw it (a malformed body)."""
        self.requests.labels(outcome_of(code), code, api).inc()

    def watch_pool(self, counts: Callable[[], Mapping[str, WorkerCounts]],
                   discovery_failures: Callable[[], int] = lambda: 0) -> None:
        """Export the pool's `counts()` per role, and failed DNS lookups, at scrape time."""
        self.registry.register(_WorkersCollector(counts, discovery_failures))

    def watch_cache_index(self, keys_per_worker: Callable[[], Mapping[str, int]],
                          evicted: Callable[[], int]) -> None:
        """Export how many prefix-cache pages the router's index holds per worker, and how
        many it dropped to stay under --cache-index-max-pages."""
        def collect() -> Iterator[Metric]:
            family = GaugeMetricFamily("pdserve_router_cache_index_pages", "prefix-cache pages "
                                       "the router's index says each worker holds (from its "
                                       "cache events)", labels=("worker",))
            for worker, n in sorted(keys_per_worker().items()):
                family.add_metric((worker,), n)
            yield family
            yield CounterMetricFamily("pdserve_router_cache_index_evicted_pages", "(worker, "
                                      "page) entries the router's index dropped, least "
                                      "recently used first, to stay under "
                                      "--cache-index-max-pages", value=evicted())
        self.registry.register(_CallbackCollector(collect))

    def watch_peers(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        """Export the --peers exchange: batches sent and failed (per peer), placements
        received from other routers."""
        def collect() -> Iterator[Metric]:
            sent, failed, received = counts()
            family = CounterMetricFamily("pdserve_router_peer_batches", "batches of placements "
                                         "this router sent to its --peers, per peer",
                                         labels=("result",))
            family.add_metric(("sent",), sent)
            family.add_metric(("failed",), failed)
            yield family
            yield CounterMetricFamily("pdserve_router_peer_placements_received", "placements "
                                      "other routers told this one of", value=received)
        self.registry.register(_CallbackCollector(collect))


class WorkerMetrics:
    """A prefill, decode or co-located worker: engine gauges read from `stats()` at scrape
    time, plus counters the worker bumps at request boundaries."""

    def __init__(self, role: str, stats: Callable[[], Any],
                 registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.prefills = Counter("pdserve_prefill_requests", "Prefill calls by gRPC status code",
                                ("code",), registry=r)
        self.finished = Counter("pdserve_sequences_finished", "decode sequences ended, by "
                                "reason (stop, length, abort)", ("reason",), registry=r)
        self.decode_starts = Counter("pdserve_decode_sequences_started", "Decode starts by the "
                                     "stream they came on: shared (DecodeMany, a router's one "
                                     "stream to this worker) or own (a Decode call each)",
                                     ("stream",), registry=r)
        self.lease_expiries = Counter("pdserve_lease_expiries", "reservations reclaimed because "
                                      "their KV handoff never came", registry=r)
        self.queried_tokens = Counter("pdserve_prefix_cache_queried_tokens", "prompt tokens "
                                      "looked up in this worker's prefix cache", registry=r)
        self.hit_tokens = Counter("pdserve_prefix_cache_hit_tokens", "prompt tokens this "
                                  "worker's prefix cache held (not computed, not received); "
                                  "hit rate = hit / queried", registry=r)
        self.pages_not_sent = Counter("pdserve_kv_pages_not_sent", "prompt pages not shipped to "
                                      "decode because the decode worker held them", registry=r)
        self.bytes_not_sent = Counter("pdserve_kv_bytes_not_sent", "KV bytes of those pages",
                                      registry=r)
        self.lane_handoffs = Counter("pdserve_kv_lane_handoffs", "KV handoffs (parts) this "
                                     "prefill worker sent itself, by transport: shm (to an agent "
                                     "of this host), tcp (to another host's); the rest went "
                                     "through its agent", ("transport",), registry=r)
        self.handoffs_begun = Counter("pdserve_kv_handoffs_begun", "last parts of KV handoffs "
                                      "this prefill worker started writing the moment their KV "
                                      "was ready (made ready while the prompt's last chunk "
                                      "computed; its own TCP lane, eager sizes)", registry=r)
        self.engine = EngineMetrics(r)
        r.register(_StatsCollector(role, stats))

    def note_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.queried_tokens.inc(prompt_tokens)
        self.hit_tokens.inc(cached_tokens)


class AgentMetrics:
    """A kvtransfer agent: bytes moved per transport, direction and peer agent (its
    --agent-id: the destination's when sending, the sender's when receiving; this agent's own
    for a copy on one host), handoff time and throughput (sender side), failures by cause."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved by this "
                                      "agent, by the agent at the other end (peer)",
                                      ("transport", "direction", "peer"), registry=r)
        self.transfer_pages = Counter("pdserve_kv_transfer_pages", "KV pages moved by this "
                                      "agent, by the agent at the other end (peer)",
                                      ("transport", "direction", "peer"), registry=r)
        self.handoff = Histogram("pdserve_kv_handoff_seconds", "SendPages: request -> every "
                                 "page resident at the destination", ("transport",),
                                 buckets=FAST_BUCKETS, registry=r)
        self.throughput = Histogram("pdserve_kv_transfer_gb_per_second", "per handoff: bytes "
                                    "/ handoff time, in 1e9 bytes/s", ("transport",),
                                    buckets=GBPS_BUCKETS, registry=r)
        self.failures = Counter("pdserve_kv_transfer_failures", "handoffs that failed, by cause "
                                "and direction", ("cause", "direction"), registry=r)

        # (transport, direction, peer) -> its two counters: each handoff counts itself on its
        # critical path, where labels()' checks and lock cost more than the counting
        self._moved: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def _counters(self, transport: str, direction: str, peer: str) -> tuple[Any, Any]:
        key = (transport, direction, peer or UNKNOWN_PEER)
        counters = self._moved.get(key)
        if counters is None:
            counters = self._moved[key] = (self.transfer_bytes.labels(*key),
                                           self.transfer_pages.labels(*key))
        return counters

    def sent(self, transport: str, kv_bytes: int, kv_pages: int, handoff_s: float,
             peer: str = UNKNOWN_PEER) -> None:
        moved_bytes, moved_pages = self._counters(transport, "send", peer)
        moved_bytes.inc(kv_bytes)
        moved_pages.inc(kv_pages)
        self.handoff.labels(transport).observe(handoff_s)
        if handoff_s > 0:
            self.throughput.labels(transport).observe(kv_bytes / handoff_s / 1e9)

    def received(self, transport: str, kv_bytes: int, kv_pages: int,
                 peer: str = UNKNOWN_PEER) -> None:
        moved_bytes, moved_pages = self._counters(transport, "receive", peer)
        moved_bytes.inc(kv_bytes)
        moved_pages.inc(kv_pages)

    def failed(self, cause: str, direction: str) -> None:
        self.failures.labels(cause, direction).inc()


# ---- scrape-time gauges ----------------------------------------------------------------

_STATS_GAUGES = (  # (metric, stats() attribute, help)
    ("pdserve_kv_pages_capacity", "num_pages", "KV pages in the worker's pool"),
    ("pdserve_kv_pages_free", "free_pages", "KV pages an allocation can take (free, or "
     "cached and unreferenced)"),
    ("pdserve_prefix_cache_pages", "cached_pages", "KV pages holding a prefix-cache key"),
    ("pdserve_running_sequences", "running_sequences", "sequences in the running batch"),
    ("pdserve_waiting_sequences", "waiting_sequences", "queue depth: sequences waiting to run"),
    ("pdserve_queued_prompt_tokens", "queued_prompt_tokens", "prompt tokens still to prefill"),
    ("pdserve_reserved_tickets", "reserved_tickets", "reservations waiting for their handoff"),
)


class _StatsCollector(Collector):
    """Gauges read from a worker's `stats()` (any object with the attributes named in
    _STATS_GAUGES, e.g. pdserve.worker.types.WorkerStats)."""

    def __init__(self, role: str, stats: Callable[[], Any]):
        self._role = role
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, key, help_text in _STATS_GAUGES:
            yield _gauge(name, help_text, {"role": self._role}, getattr(stats, key))
        yield _gauge("pdserve_kv_pages_used", "KV pages held by sequences or reservations",
                     {"role": self._role}, stats.num_pages - stats.free_pages)


@dataclass(frozen=True)
class WorkerCounts:
    """One role's workers as the router's pool knows them."""

    healthy: int  # members passing health checks (they get requests)
    members: int  # configured or discovered now
    leaving: int = 0  # gone from discovery, their in-flight calls not yet ended
    joins: int = 0  # since start (the first members included)
    leaves: int = 0


class _CallbackCollector(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]):
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


class _WorkersCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, WorkerCounts]],
                 discovery_failures: Callable[[], int]):
        self._counts = counts
        self._discovery_failures = discovery_failures

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "healthy": GaugeMetricFamily("pdserve_workers_healthy", "workers passing health "
                                         "checks", labels=("role",)),
            "members": GaugeMetricFamily("pdserve_workers", "workers configured or discovered",
                                         labels=("role",)),
            "leaving": GaugeMetricFamily("pdserve_workers_leaving", "workers gone from "
                                         "discovery whose in-flight calls have not ended",
                                         labels=("role",)),
            "joins": CounterMetricFamily("pdserve_worker_joins", "workers that joined the "
                                         "pool (the first ones included)", labels=("role",)),
            "leaves": CounterMetricFamily("pdserve_worker_leaves", "workers that left the "
                                          "pool (their address record disappeared)",
                                          labels=("role",)),
        }
        for role, counts in self._counts().items():
            for key, family in families.items():
                family.add_metric((role,), getattr(counts, key))
        yield from families.values()
        yield CounterMetricFamily("pdserve_discovery_failures", "dns:/// lookups that failed "
                                  "(the last known workers were kept)",
                                  value=self._discovery_failures())


def _gauge(name: str, help_text: str, labels: Mapping[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=tuple(labels))
    family.add_metric(tuple(labels.values()), value)
    return family


# ---- the HTTP endpoint ------------------------------------------------------------------

@dataclass
class MetricsServer:
    """A running /metrics endpoint: its bound port, and how to stop it."""

    port: int
    _httpd: Any

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0", *,
                  service: str = "") -> MetricsServer | None:
    """Serve `registry` as Prometheus text on http://host:port/metrics (port 0: any free port).

    Returns None when `port` is -1 (off) or cannot be bound: metrics are never a reason to
    refuse serving requests, so a busy port is logged as a warning naming the flag.
    """
    if port == DISABLED:
        log.info("%s metrics: off", service or "process")
        return None
    with contextlib.suppress(ValueError):  # already there: a registry served twice
        registry.register(gc_pauses())
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("%s metrics: cannot listen on %s:%d (%s); serving without /metrics "
                    "(choose another with --metrics-port, -1 turns it off)", service or "process",
                    host, port, exc)
        return None
    bound = httpd.server_port
    log.info("%s metrics on http://%s:%d/metrics", service or "process", host, bound)
    return MetricsServer(bound, httpd)
