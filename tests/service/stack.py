"""A whole pdserve stack for service tests: `pdserve up` in its own process group."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import tempfile
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from pdserve.common.ports import bindable, listener_range
from pdserve.common.security import ChannelSecurity
from pdserve.up import metrics_offset
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

from tests.support import pdserve_argv, running

_HANDED_OUT: set[int] = set()  # ports of stacks this process runs now (started side by side)
_HANDED_OUT_LOCK = threading.Lock()


def _port_block(n: int, tries: int = 50) -> int:
    """A base port with n free ports above it (checked by binding), below the ephemeral range
    (pdserve.common.ports: a port there can be taken by any outgoing connection between this
    check and the service's bind, as CI saw), none handed to another stack of this process
    that is still running. Its own ledger, not free_port_block's: stacks give their blocks
    back, the suite's single free_port() picks are never given back, and in one ledger those
    scatter until no block of 85 fits."""
    lo, hi = listener_range()
    for _ in range(tries):
        base = random.randrange(lo, hi - n)
        block = set(range(base, base + n))
        with _HANDED_OUT_LOCK:
            if block & _HANDED_OUT:
                continue
            _HANDED_OUT.update(block)
        if all(bindable(p) for p in block):
            return base
        with _HANDED_OUT_LOCK:
            _HANDED_OUT.difference_update(block)
    raise RuntimeError(f"no block of {n} free ports in {lo}-{hi - 1} after {tries} tries")


def _give_back(base: int, n: int) -> None:
    with _HANDED_OUT_LOCK:
        _HANDED_OUT.difference_update(range(base, base + n))


@dataclasses.dataclass
class Stack:
    router: str
    prefill: list[str]
    decode: list[str]
    proc: object
    metrics: dict[str, str] = dataclasses.field(default_factory=dict)  # process name -> URL
    http: str = ""  # the router's OpenAI-compatible API, http://127.0.0.1:PORT/v1

    def scrape(self, name: str) -> str:
        """The Prometheus text of one process (`router`, `prefill-0`, `decode-0`,
        `kvtransfer-a` (prefill's host), `kvtransfer-b` (decode's), `colocated`)."""
        with urllib.request.urlopen(self.metrics[name], timeout=10) as reply:
            return reply.read().decode()

    def generate(self, timeout_s: float = 120.0, **fields) -> list[router_pb2.GenerateResponse]:
        with grpc.insecure_channel(self.router) as ch:
            return list(router_pb2_grpc.RouterStub(ch).Generate(
                router_pb2.GenerateRequest(**fields), timeout=timeout_s))

    def prefill_stats(self, index: int = 0, **ask) -> common_pb2.WorkerStats:
        """The prefill worker's Stats (`ask`: StatsRequest's fields)."""
        with grpc.insecure_channel(self.prefill[index]) as ch:
            return prefill_pb2_grpc.PrefillStub(ch).Stats(common_pb2.StatsRequest(**ask),
                                                          timeout=10)

    def decode_stats(self, index: int = 0, **ask) -> common_pb2.WorkerStats:
        with grpc.insecure_channel(self.decode[index]) as ch:
            return decode_pb2_grpc.DecodeStub(ch).Stats(common_pb2.StatsRequest(**ask),
                                                        timeout=10)


@contextlib.contextmanager
def pdserve_stack(*args: str, prefill: int = 1, decode: int = 1, colocated: bool = False,
                  env: dict[str, str] | None = None,
                  security: ChannelSecurity | None = None) -> Iterator[Stack]:
    """`pdserve up ARGS` on free ports; `security`: how to reach the router's health over TLS
    (with `--tls`)."""
    base = _port_block(40)
    metrics_base = _port_block(45)  # never overlaps `base`: that block is handed out
    ports = dict(port=base, prefill_port=base + 10, decode_port=base + 20, agent_port=base + 30,
                 colocated_port=base + 35, http_port=base + 38, metrics_port=metrics_base)
    argv = pdserve_argv("up", "--prefill", str(prefill), "--decode", str(decode),
                        "--kv-cache-mb", "32", *args,
                        *(x for k, v in ports.items()
                          for x in (f"--{k.replace('_', '-')}", str(v))))
    if colocated:
        argv.append("--colocated")
    router = f"127.0.0.1:{base}"
    names = ["router", *(["colocated"] if colocated else [
        *(f"prefill-{i}" for i in range(prefill)), *(f"decode-{i}" for i in range(decode)),
        "kvtransfer-a", "kvtransfer-b"])]
    metrics = {name: f"http://127.0.0.1:{metrics_base + metrics_offset(name)}/metrics"
               for name in names}
    http = f"http{'s' if '--tls' in args else ''}://127.0.0.1:{base + 38}/v1"
    # `pdserve up` keeps its processes' logs after a failed exit (a test that kills a worker):
    # they go to a folder this removes.
    logs = tempfile.TemporaryDirectory(prefix="pdserve-test-up-")
    argv += ["--log-dir", logs.name]
    try:
        with logs, running(argv, router, env=env, timeout_s=240, security=security) as proc:
            if colocated:
                workers = [f"127.0.0.1:{ports['colocated_port']}"]
                yield Stack(router, workers, workers, proc, metrics, http)
            else:
                yield Stack(router, [f"127.0.0.1:{base + 10 + i}" for i in range(prefill)],
                            [f"127.0.0.1:{base + 20 + i}" for i in range(decode)], proc, metrics,
                            http)
    finally:
        _give_back(base, 40)
        _give_back(metrics_base, 45)


@contextlib.contextmanager
def pdserve_stacks(*arg_lists: tuple[str, ...], env: dict[str, str] | None = None,
                   envs: Sequence[dict[str, str]] = ()) -> Iterator[list[Stack]]:
    """Several `pdserve up ARGS` stacks started, and stopped, side by side, so their start-up
    and shut-down waits overlap; each on ports of its own. `envs`: each stack's own
    environment on top of `env`."""
    managers = [pdserve_stack(*args, env={**(env or {}), **(envs[i] if i < len(envs) else {})})
                for i, args in enumerate(arg_lists)]
    entered: list[tuple[contextlib.AbstractContextManager[Stack], Stack]] = []
    with ThreadPoolExecutor(max(1, len(managers))) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        errors = []
        for manager, future in zip(managers, futures):
            try:
                entered.append((manager, future.result()))
            except BaseException as exc:  # the others still get stopped
                errors.append(exc)
        try:
            if errors:
                raise errors[0]
            yield [stack for _, stack in entered]
        finally:
            list(pool.map(lambda pair: pair[0].__exit__(None, None, None), entered))


def collect(
    responses: list[router_pb2.GenerateResponse],
) -> tuple[list[int], str, router_pb2.Timing, router_pb2.Finish]:
    """(token ids, text, timing, finish) of one finished stream."""
    ids: list[int] = []
    text = ""
    timing = finish = None
    for r in responses:
        kind = r.WhichOneof("kind")
        if kind == "delta":
            ids += r.delta.token_ids
            text += r.delta.text
        elif kind == "timing":
            timing = r.timing
        elif kind == "finish":
            finish = r.finish
    assert timing is not None and finish is not None, "stream ended without timing or finish"
    return ids, text, timing, finish
