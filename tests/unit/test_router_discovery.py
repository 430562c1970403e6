"""The router's targets and pool membership, with a resolver the test controls.

No worker is ever called: membership, use counting and channel closing are checked on the
pool's own state (a gRPC channel opens no socket until a call is made on it)."""

from __future__ import annotations

import contextlib
import logging
import socket

import grpc
import pytest
from pdserve.common.config import parse_config
from pdserve.router.calls import reply
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import Discovery
from pdserve.router.placement import rank_prefill
from pdserve.router.pool import WorkerPool
from pdserve.router.targets import parse_target, system_resolver

from tests.support import wait_for

pytestmark = pytest.mark.unit


class FakeDns:
    """name -> addresses; a name set to an exception raises it, like a failing lookup."""

    def __init__(self, **records: list[str] | OSError):
        self.records = dict(records)

    def __call__(self, name: str, port: int) -> list[str]:
        answer = self.records.get(name, socket.gaierror(socket.EAI_NONAME, "Name unknown"))
        if isinstance(answer, OSError):
            raise answer
        return [f"{ip}:{port}" for ip in answer]


def test_targets_parse_both_forms():
    assert parse_target("10.0.0.1:50061") == parse_target("10.0.0.1:50061")
    static = parse_target("[::1]:50061")
    assert (static.host, static.port, static.dns, static.address) == \
        ("::1", 50061, False, "[::1]:50061")
    dns = parse_target("dns:///prefill-headless.pd.svc:50061")
    assert (dns.host, dns.port, dns.dns) == ("prefill-headless.pd.svc", 50061, True)


@pytest.mark.parametrize("entry, message", [
    ("dns://8.8.8.8/prefill:50061", "a DNS server of its own (dns://8.8.8.8/...) is not "
                                    "supported"),
    ("dns:prefill:50061", "dns:///NAME:PORT (three slashes)"),
    ("dns:///prefill", "no port"),
    ("dns:///prefill:0", "bad port '0'"),
    ("prefill:http", "bad port 'http'"),
    ("ipv4:10.0.0.1:50061", "unsupported scheme"),
    ("http://prefill:50061", "unsupported scheme"),
    ("::1:50061", "an IPv6 address needs brackets"),
    ("nohost", "no port"),
])
def test_bad_targets_are_refused_naming_the_entry(entry, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(RouterConfig, "router", ["--prefill", f"p:1,{entry}", "--decode", "d:1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"prefill={entry!r}: " in err and message in err


def test_discovery_flags_and_env_twins():
    cfg = parse_config(RouterConfig, "router", [], env={
        "PDSERVE_ROUTER_PREFILL": "dns:///prefill:50061,10.0.0.9:50061",
        "PDSERVE_ROUTER_DECODE": "dns:///decode:50071",
        "PDSERVE_ROUTER_DISCOVERY_INTERVAL_S": "0.5"})
    assert [t.dns for t in cfg.targets("prefill")] == [True, False]
    assert cfg.targets("decode")[0].host == "decode" and cfg.discovery_interval_s == 0.5
    with pytest.raises(SystemExit):
        parse_config(RouterConfig, "router", ["--prefill", "p:1", "--decode", "d:1",
                                              "--discovery-interval-s", "0"])


def test_system_resolver_reads_the_hosts_file():
    addresses = system_resolver("localhost", 50061)
    assert addresses and set(addresses) <= {"127.0.0.1:50061", "[::1]:50061"}
    with pytest.raises(OSError):
        system_resolver("no-such-host.invalid", 50061)


def make(dns: FakeDns, prefill: str = "dns:///prefill:1", decode: str = "d:2"
         ) -> tuple[WorkerPool, Discovery]:
    pool = WorkerPool(interval_s=60)
    return pool, Discovery(pool, [parse_target(t) for t in prefill.split(",")],
                           [parse_target(t) for t in decode.split(",")], resolve=dns)


def test_every_record_is_a_worker_used_only_once_healthy():
    dns = FakeDns(prefill=["10.0.0.1", "10.0.0.2"])
    pool, discovery = make(dns, "dns:///prefill:1,10.0.0.2:1,10.0.0.3:1")
    discovery.refresh()
    assert pool.addresses("prefill") == ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    assert pool.addresses("decode") == ["d:2"]
    assert rank_prefill(pool.prefill_loads()) == []  # no health check said SERVING yet
    assert not pool.ready()
    counts = pool.counts()["prefill"]
    assert (counts.members, counts.healthy, counts.joins, counts.leaves) == (3, 0, 3, 0)
    pool.close()


def test_a_worker_that_leaves_finishes_its_calls_then_closes():
    dns = FakeDns(prefill=["10.0.0.1", "10.0.0.2"])
    pool, discovery = make(dns)
    discovery.refresh()
    busy = pool.acquire("prefill", "10.0.0.1:1", prompt_tokens=7)
    assert busy is not None
    dns.records["prefill"] = ["10.0.0.2"]
    discovery.refresh()
    assert pool.addresses("prefill") == ["10.0.0.2:1"]
    assert [w.address for w in pool.prefill_loads()] == ["10.0.0.2:1"]  # no new requests
    assert pool.acquire("prefill", "10.0.0.1:1") is None
    counts = pool.counts()["prefill"]
    assert (counts.members, counts.leaving, counts.leaves) == (1, 1, 1)
    # Its call is still in flight: the channel stays open until the call ends.
    assert "10.0.0.1:1" in pool._channels
    pool.release(busy, prompt_tokens=7)
    assert pool.counts()["prefill"].leaving == 0 and "10.0.0.1:1" not in pool._channels
    assert wait_for(lambda: _closed(busy), timeout_s=5)
    pool.close()


def _closed(worker) -> bool:
    """A closed channel refuses a call at once, before any connection attempt. (Through the
    worker's own unregistered method: grpc registering a method on a closed channel, as a new
    stub does, crashes the process.)"""
    from grpc_health.v1 import health_pb2
    try:
        call = worker.unary.check(health_pb2.HealthCheckRequest(), timeout=0.01)
    except ValueError as exc:
        return "closed channel" in str(exc)
    with contextlib.suppress(grpc.RpcError):
        reply(call)  # read to its end (a deadline, here)
    return False


def test_an_idle_worker_that_leaves_is_closed_at_once_and_can_come_back():
    dns = FakeDns(prefill=["10.0.0.1", "10.0.0.2"])
    pool, discovery = make(dns)
    discovery.refresh()
    first = pool.acquire("prefill", "10.0.0.1:1")
    assert first is not None
    pool.release(first)
    first.healthy = True
    dns.records["prefill"] = ["10.0.0.2"]
    discovery.refresh()
    assert pool.counts()["prefill"].leaving == 0 and "10.0.0.1:1" not in pool._channels
    dns.records["prefill"] = ["10.0.0.2", "10.0.0.1"]
    discovery.refresh()
    again = pool.acquire("prefill", "10.0.0.1:1")
    assert again is not None and again is not first and not again.healthy
    counts = pool.counts()["prefill"]
    assert (counts.members, counts.joins, counts.leaves) == (2, 3, 1)
    pool.release(again)
    pool.close()


def test_a_worker_back_before_its_calls_ended_is_checked_again():
    dns = FakeDns(prefill=["10.0.0.1"])
    pool, discovery = make(dns)
    discovery.refresh()
    busy = pool.acquire("prefill", "10.0.0.1:1")
    assert busy is not None
    busy.healthy = True
    dns.records["prefill"] = []
    discovery.refresh()  # an empty answer counts as a failure: the last set is kept
    assert pool.addresses("prefill") == ["10.0.0.1:1"]
    dns.records["prefill"] = ["10.0.0.9"]
    discovery.refresh()
    assert pool.addresses("prefill") == ["10.0.0.9:1"]
    dns.records["prefill"] = ["10.0.0.9", "10.0.0.1"]
    discovery.refresh()
    assert pool.acquire("prefill", "10.0.0.1:1") is busy and not busy.healthy
    pool.release(busy)
    pool.release(busy)
    assert pool.addresses("prefill") == ["10.0.0.1:1", "10.0.0.9:1"]
    pool.close()


def test_failed_lookups_keep_the_last_workers_and_are_logged_once(caplog):
    dns = FakeDns(prefill=["10.0.0.1"])
    pool, discovery = make(dns)
    discovery.refresh()
    dns.records["prefill"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure")
    with caplog.at_level(logging.INFO, logger="pdserve.router.discovery"):
        for _ in range(3):
            discovery.refresh()
        assert pool.addresses("prefill") == ["10.0.0.1:1"]
        assert discovery.failures == 3
        assert caplog.text.count("does not resolve") == 1
        assert "keeping its last 1 workers" in caplog.text
        dns.records["prefill"] = ["10.0.0.2"]
        discovery.refresh()
        assert "resolves again: 1 workers" in caplog.text
    assert pool.addresses("prefill") == ["10.0.0.2:1"]
    pool.close()


def test_a_name_unknown_at_start_leaves_the_role_empty_until_it_resolves():
    pool, discovery = make(FakeDns())
    discovery.refresh()
    assert pool.addresses("prefill") == [] and discovery.failures == 1
    pool.close()


def test_co_located_worker_shares_one_channel_closed_after_both_roles_left():
    dns = FakeDns(worker=["10.0.0.1"])
    pool, discovery = make(dns, "dns:///worker:1", "dns:///worker:1")
    discovery.refresh()
    prefill = pool.acquire("prefill", "10.0.0.1:1")
    decode = pool.acquire("decode", "10.0.0.1:1")
    assert prefill is not None and decode is not None and prefill.channel is decode.channel
    dns.records["worker"] = ["10.0.0.2"]
    discovery.refresh()
    pool.release(prefill)
    assert "10.0.0.1:1" in pool._channels  # decode still uses it
    pool.release(decode)
    assert "10.0.0.1:1" not in pool._channels
    pool.close()
