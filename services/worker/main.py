"""Start-up shared by the prefill, decode and co-located workers: engine, pool registration,
server, drain. The role supplies how to build its worker and which servicers to serve."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc
from pdserve.common.config import parse_config
from pdserve.common.cpus import cpu_allowance, format_cpu_list
from pdserve.common.heap import freeze_startup_heap
from pdserve.common.logs import setup_logging
from pdserve.common.metrics import WorkerMetrics, serve_metrics
from pdserve.common.ports import listened_on
from pdserve.common.security import ChannelSecurity, server_credentials
from pdserve.common.server import ServerStartError, start
from pdserve.common.tracing import setup_tracing, shutdown_tracing
from pdserve.engine.loop import EngineLoop
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.cache_feed import CacheFeed
from pdserve.worker.config import WorkerConfig

log = logging.getLogger("pdserve.worker")


class Worker(Protocol):
    """What start-up needs of a worker: its metrics, registration of its pool (with the
    host's agent, where it has one), the drain switch, its health for Stats, and stop."""

    metrics: WorkerMetrics
    admitting: bool
    serving: Callable[[], bool] | None
    pool_id: str
    cache_feed: CacheFeed

    def register(self) -> None: ...

    def stop(self) -> None: ...


C = TypeVar("C", bound=WorkerConfig)
W = TypeVar("W", bound=Worker)


class _Serving:
    """What the worker's health check, its server and its rank watcher share: whether it is
    ready, why it failed (a rank died: "" while none has), and how to stop it."""

    def __init__(self) -> None:
        self.ready = False
        self.failed = ""
        self.stop: Callable[[], None] = lambda: None


def run_worker(role: str, config_cls: type[C], argv: list[str] | None,
               make_worker: Callable[[C, EngineLoop, str], W],
               servicers: Callable[[W], Callable[[grpc.Server], None]], description: str) -> int:
    """Parse config, build the engine, register the pool with the agent, serve until SIGTERM."""

    cfg = parse_config(config_cls, role, argv, prog=f"pdserve {role}", description=description)
    setup_logging(cfg.log_format, cfg.log_level, service=role)
    setup_tracing(f"pdserve-{role}", instance_id=worker_name(role, cfg))
    # Until the server's own drain handler takes over, a stop request unwinds through the
    # `finally` below, so the pool's shared memory is released even during start-up.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(role, cfg, make_worker, servicers)
    except KeyboardInterrupt:
        log.info("%s: stopped during start-up", role)
        return 0
    finally:
        shutdown_tracing()


def worker_name(role: str, cfg: WorkerConfig) -> str:
    """The worker's id: `--worker-id`, else role@host:port."""
    return cfg.worker_id or f"{role}@{cfg.advertise_host}:{cfg.port}"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run(role: str, cfg: C, make_worker: Callable[[C, EngineLoop, str], W],
         servicers: Callable[[W], Callable[[grpc.Server], None]]) -> int:
    import torch
    from pdserve.engine.setup import build_engine
    from pdserve.engine.tp import RankFailed, split_cores
    from pdserve.worker.warmup import warm_up

    cores = None
    if cfg.tp > 1:  # rank 0 (this process) on the first share of the cores, the others after
        cores = split_cores(sorted(os.sched_getaffinity(0)), cfg.tp)
        os.sched_setaffinity(0, cores[0])
    # Per rank: the CPU allowance (cgroup quota included, as a pod's limits set it) shared out.
    threads = cfg.threads or (max(1, min(len(cores[0]), cpu_allowance() // cfg.tp)) if cores
                              else cpu_allowance())
    torch.set_num_threads(threads)
    worker_id = worker_name(role, cfg)
    if cfg.port and listened_on(cfg.port):  # said now, not after the model loaded
        log.error("%s cannot start: port %d is in use (--port)", worker_id, cfg.port)
        return 1
    try:
        engine, model_dir = build_engine(
            cfg.model, role=role, dtype=cfg.dtype, device=cfg.device, block_size=cfg.block_size,
            num_pages=cfg.num_pages, kv_cache_mb=cfg.kv_cache_mb,
            max_model_len=cfg.max_model_len, chunk_size=cfg.chunk_size,
            max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens,
            prefix_caching=cfg.prefix_cache,
            prompts_beside_decodes=getattr(cfg, "prompts_beside_decodes", 0),  # not prefill's
            tp=cfg.tp, tp_cores=cores, tp_threads=threads)
    except (OSError, ValueError, RankFailed) as exc:  # ranks stopped, no pool left
        # The model's name or directory, its config.json, its architecture, the pool's size
        # (SizingError) or the TP split (ShardingError): one line, the traceback at DEBUG.
        log.error("%s cannot start: %s", worker_id, exc)
        log.debug("%s: start-up failed", worker_id, exc_info=True)
        return 1
    log.info("%s: model %s from %s, %d pages of %d bytes, max_model_len %d, prefix cache %s, "
             "%d torch threads on cores %s%s", worker_id, engine.model.model_id, model_dir,
             engine.config.num_pages, engine.pool.page_bytes, engine.max_model_len,
             "on" if engine.config.prefix_caching else "off", threads,
             format_cpu_list(sorted(os.sched_getaffinity(0))),
             f", tensor-parallel rank 0 of {cfg.tp}" if cfg.tp > 1 else "")
    state = _Serving()
    if engine.ranks is not None:
        def rank_died(rank: int, code: int) -> None:  # the worker cannot step without it
            state.failed = f"tensor-parallel rank {rank} exited (code {code})"
            log.error("%s: %s; the worker stops", worker_id, state.failed)
            state.stop()
        engine.ranks.on_death = rank_died
    loop = EngineLoop(engine).start()
    try:
        worker = make_worker(cfg, loop, worker_id)
    except ConnectionError as exc:  # its kvtransfer agent: not there, or not the one named
        log.error("%s cannot start: %s", worker_id, exc)
        loop.stop()
        engine.close()
        return 1
    engine.on_step = worker.metrics.engine.observe_step
    loop.on_held = worker.metrics.engine.observe_held
    freeze_startup_heap(worker_id)  # the model's modules, the engine, the tokenizer
    metrics = serve_metrics(worker.metrics.registry, cfg.metrics_port, cfg.host, service=role)
    try:
        try:
            handle = start(role, cfg.port, servicers(worker), host=cfg.host,
                           ready=lambda: state.ready and not state.failed, grace_s=cfg.grace_s,
                           on_drain=worker_drain(worker), credentials=server_credentials(cfg))
        except ServerStartError as exc:  # names the port (in use, or not ours to bind)
            log.error("%s", exc)
            return 1
        state.stop = handle.request_stop
        worker.serving = handle.serving  # Stats says what health Check would
        if state.failed:
            handle.request_stop()
        if cfg.warmup:
            log.info("%s: warmed up in %.0f ms", worker_id, warm_up(loop, role))
        worker.register()
        state.ready = True
        log.info("%s serving on port %d, pool %s", worker_id, handle.port, worker.pool_id)
        handle.wait()
        return 1 if state.failed else 0
    finally:
        if metrics is not None:
            metrics.close()
        worker.stop()
        loop.stop()
        engine.close()
        if state.failed:
            _exit_now(1)


def _exit_now(code: int) -> None:
    """Exit after a rank died, everything above closed: run the exit handlers (log and span
    flushes), then leave without the interpreter's teardown, whose collections of the whole
    heap took a TP worker 5-30 s on a busy host while its orchestrator waited for the exit."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def connect_agent(cfg: WorkerConfig) -> AgentClient:
    """The client of this host's kvtransfer agent (`--kv-agent`), once it answers (within
    `--kv-agent-wait-s`, else ConnectionError)."""
    agent = AgentClient(cfg.kv_agent, security=ChannelSecurity.from_options(cfg),
                        socket_address=cfg.kv_agent_socket)
    try:
        agent.wait_ready(timeout_s=cfg.kv_agent_wait_s)
    except BaseException:
        agent.close()
        raise
    return agent


def worker_drain(worker: Worker) -> Callable[[], None]:
    def drain() -> None:
        worker.admitting = False
        worker.cache_feed.close()  # routers' event streams end now, not after the grace
    return drain
