"""Cache-aware routing with real processes: conversations stay where their history is (two
decode workers), the router's index follows the workers' cache events, and a restarted
worker's old entries are gone from it until new events say otherwise."""

from __future__ import annotations

import signal
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from pdserve.v1 import router_pb2, router_pb2_grpc

from tests.service.stack import collect, pdserve_stack
from tests.support import ServiceProcess, free_port, running, wait_for, wait_serving

pytestmark = pytest.mark.service

MAX_TOKENS = 6


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(address: str, **fields) -> list[router_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(**fields),
                                                             timeout=120))


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{" + want) or (not labels and line.startswith(name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_conversations_stay_with_their_history_and_spread_over_decode_workers():
    with pdserve_stack(decode=2) as s:
        # The router serves once one decode worker is healthy: wait for both (a bounded poll).
        assert wait_for(lambda: _metric(s.scrape("router"), "pdserve_workers_healthy",
                                        role="decode") == 2, timeout_s=60)
        conversations = {c: _tokens(10 + c, 40) for c in range(4)}
        home: dict[int, str] = {}
        perfect = got = 0
        shared = dict.fromkeys(conversations, 0)  # tokens whose KV the last turn left
        for turn in range(3):
            for c, history in conversations.items():
                ids, _, timing, _ = collect(s.generate(token_ids=history, max_tokens=MAX_TOKENS,
                                                       temperature=0.0, ignore_eos=True))
                if turn == 0:
                    home[c] = timing.decode_worker
                else:
                    assert timing.decode_worker == home[c], (c, turn, timing)
                    # A perfect cache skips the full pages the previous turn left in KV.
                    perfect += min(shared[c], len(history) - 1) // 16 * 16
                    got += timing.decode_cached_tokens
                shared[c] = len(history) + MAX_TOKENS - 1  # its last token never ran
                conversations[c] = history + ids + _tokens(100 * turn + c, 20)
        per_worker = [list(home.values()).count(w) for w in set(home.values())]
        assert sorted(per_worker) == [2, 2]  # ties spread, then each conversation stays
        assert got >= 0.9 * perfect, (got, perfect)
        router = s.scrape("router")
        assert _metric(router, "pdserve_router_cache_index_pages") > 0
        assert "pdserve_router_cache_index_evicted_pages_total 0.0" in router  # under its cap
        # What a router in front of a pool too large for streams reads instead, with Stats:
        # a snapshot of what the prefill worker holds, then the changes after that cursor.
        snap = s.prefill_stats(cache_events=True).cache
        assert snap.snapshot and len(snap.stored) >= 12 and snap.fingerprint.block_size == 16
        assert not s.prefill_stats().HasField("cache")  # only when asked
        fresh = _tokens(999, 40)
        collect(s.generate(token_ids=fresh, max_tokens=2, temperature=0.0))

        def changed():
            return s.prefill_stats(cache_events=True, cache_epoch=snap.epoch,
                                   cache_sequence=snap.sequence).cache

        assert wait_for(lambda: len(changed().stored) == 2, timeout_s=10)  # 40 tokens: 2 pages
        change = changed()
        assert (change.snapshot, change.since, change.epoch) == (False, snap.sequence, snap.epoch)
        assert not set(change.stored) & set(snap.stored)


def test_a_restarted_worker_starts_empty_in_the_index(tiny_model_dir, tmp_path):
    """Kill -9 the decode worker and start it again on its port: its stream breaks, the
    router drops its entries, and the new incarnation's snapshot (empty) replaces them."""
    ports = {n: free_port() for n in ("a", "b", "prefill", "decode", "router", "metrics")}
    addr = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
    py = [sys.executable, "-m"]
    quiet = ["--metrics-port", "-1"]
    decode = [*py, "pdserve.decode.main", *quiet, "--port", str(ports["decode"]),
              "--kv-agent", addr["b"], "--model", str(tiny_model_dir), "--kv-cache-mb", "16"]
    first = ServiceProcess(decode)  # killed below: not a context of its own
    try:
        with running([*py, "pdserve.kvtransfer.main", *quiet, "--port", str(ports["a"])],
                     addr["a"]), \
                running([*py, "pdserve.kvtransfer.main", *quiet, "--port", str(ports["b"])],
                        addr["b"]), \
                running([*py, "pdserve.prefill.main", *quiet, "--port", str(ports["prefill"]),
                         "--kv-agent", addr["a"], "--model", str(tiny_model_dir),
                         "--kv-cache-mb", "16"], addr["prefill"]):
            wait_serving(addr["decode"], 90, first.proc)
            with running([*py, "pdserve.router.main", "--port", str(ports["router"]),
                          "--metrics-port", str(ports["metrics"]), "--http-port", "-1",
                          "--prefill", addr["prefill"], "--decode", addr["decode"],
                          "--model", str(tiny_model_dir)], addr["router"]):
                _restart_and_check(addr, ports, first, decode)
    finally:
        first.stop()


def _restart_and_check(addr: dict[str, str], ports: dict[str, int], first: ServiceProcess,
                       decode: list[str]) -> None:
    scrape = f"http://127.0.0.1:{ports['metrics']}/metrics"

    def _scrape() -> str:
        with urllib.request.urlopen(scrape, timeout=10) as reply:
            return reply.read().decode()

    def indexed() -> float:
        return _metric(_scrape(), "pdserve_router_cache_index_pages", worker=addr["decode"])

    def wait_index(ok, what: str) -> float:
        deadline = time.monotonic() + 30
        for _ in range(600):
            value = indexed()
            if ok(value) or time.monotonic() > deadline:
                assert ok(value), f"{what}: index holds {value}"
                return value
            time.sleep(0.05)  # a bounded poll of the router's metrics
        raise AssertionError(what)

    collect(_generate(addr["router"], token_ids=_tokens(1, 70), max_tokens=MAX_TOKENS,
                      temperature=0.0, ignore_eos=True))
    wait_index(lambda v: v >= 4, "after a 70-token request")
    first.signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    wait_index(lambda v: v == 0, "after the worker died")
    with running(decode, addr["decode"]):
        wait_index(lambda v: v == 0, "after the restart")
        assert wait_for(lambda: _metric(_scrape(), "pdserve_workers_healthy",
                                        role="decode") == 1, timeout_s=30)
        _, _, timing, _ = collect(_generate(
            addr["router"], token_ids=_tokens(1, 70), max_tokens=MAX_TOKENS,
            temperature=0.0, ignore_eos=True))
        assert timing.decode_cached_tokens == 0  # the new incarnation held nothing
        wait_index(lambda v: v >= 4, "after a request to the new incarnation")
