"""Worker pools discovered by DNS across four hosts, the way a Kubernetes cluster runs them.

Four network namespaces on one bridge: a router host, two prefill hosts and a decode host,
each worker host with its own kvtransfer agent reached at 127.0.0.1 (a pod's sidecar) and
advertising the host's address. Names resolve through each namespace's hosts file
(/etc/netns/NS/hosts, which `ip netns exec` mounts over /etc/hosts): `prefill-pool` has one
record per prefill host, `decode-pool` one for the decode host, and the router is given only
`dns:///prefill-pool:50061` and `dns:///decode-pool:50071`, as with headless Services.

Checked: every address a peer is told is the advertised one; greedy outputs equal
transformers; every handoff crossed from its prefill host to the decode host (each agent's
per-peer byte counters, and the prefill hosts' link counters); killing every process of one
prefill host under load loses no request that had not streamed a token, and repeats none;
its record leaving DNS takes it out of the router's pool; nothing is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pdserve.common.shm import leftover_segments

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.multihost.conftest import (
    AGENT_METRICS,
    AGENT_PORT,
    DECODE_PORT,
    NETNS_ETC,
    PREFILL_PORT,
    ROUTER_METRICS,
    ROUTER_PORT,
    Host,
    PoolStack,
    bridged_hosts,
    pool_stack,
    scrape,
)
from tests.support import samples, wait_for

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("router", "prefill-1", "prefill-2", "decode")


def drive(stack: PoolStack, command: str, args: dict[str, Any],
          timeout_s: float = 300) -> dict[str, Any]:
    """Run tests.multihost.driver COMMAND on the router host."""
    done = subprocess.run(stack.router.argv(sys.executable, "-m", "tests.multihost.driver",
                                            command, json.dumps(args)),
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}\n{stack.logs()}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def metrics(stack: PoolStack, host: Host, port: int) -> dict[tuple[str, frozenset], float]:
    return samples(scrape(stack.router, f"http://{host.ip}:{port}/metrics"))


def total(found: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in found.items()
               if n == name and all((k, x) in ls for k, x in labels.items()))


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_pools_discovered_by_dns_hand_off_across_hosts_and_survive_a_host_loss(
        transport, reference, tiny_model_dir):
    _, refs = reference
    with bridged_hosts(HOSTS) as net:
        namespaces = [h.ns for h in net.hosts.values()]
        with pool_stack(net, transport, tiny_model_dir, router="router",
                        prefill=["prefill-1", "prefill-2"], decode=["decode"],
                        worker_flags=("--chunk-size", "8"),
                        # prefill-1 holds each computed prompt 100 ms before shipping it, so
                        # the kill below lands while one is in flight there (a tiny prompt
                        # computes and ships in a few ms)
                        worker_env={"prefill-1": {"PDSERVE_FAILPOINTS":
                                                  "prefill.handoff=sleep:100"}}) as stack:
            pids = [p.proc.pid for p in stack.processes.values()]
            run_checks(stack, transport, refs)
    # Nothing left behind: namespaces (with the bridge and links), hosts files, processes.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout
    assert not any(ns in listed for ns in namespaces), listed
    assert not any((NETNS_ETC / ns).exists() for ns in namespaces)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not [name for pid in pids for name in leftover_segments(pid)]


def run_checks(stack: PoolStack, transport: str, refs: dict[str, tuple[int, list[int]]]) -> None:
    p1, p2 = stack.prefill
    decode = stack.decode[0]
    router = f"{stack.router.ip}:{ROUTER_PORT}"
    router_metrics = f"http://{stack.router.ip}:{ROUTER_METRICS}/metrics"
    workers = [f"{h.ip}:{PREFILL_PORT}" for h in stack.prefill] + [f"{decode.ip}:{DECODE_PORT}"]
    up = drive(stack, "ready", {"workers": workers, "router": router,
                                "router_metrics": router_metrics,
                                "healthy": {"prefill": 2, "decode": 1}})
    assert up["ready"], stack.logs()
    found = metrics(stack, stack.router, ROUTER_METRICS)
    assert total(found, "pdserve_worker_joins_total", role="prefill") == 2  # both records

    # What peers are told is the advertised address, never loopback or 0.0.0.0.
    probe = drive(stack, "probe", {"decode": f"{decode.ip}:{DECODE_PORT}",
                                   "agents": [f"{h.ip}:{AGENT_PORT}"
                                              for h in (p1, p2, decode)]})
    assert probe["destination_agent"] == f"{decode.ip}:{AGENT_PORT}"
    assert probe["ticket_decode_worker"] == f"decode@{decode.ip}:{DECODE_PORT}"
    for host in (p1, p2, decode):
        info = probe["agents"][f"{host.ip}:{AGENT_PORT}"]
        assert info["agent_id"] == f"kv-{host.name}"
        if transport == "tcp":
            assert info["tcp_address"].startswith(f"{host.ip}:"), info
        else:
            assert info["ucx"], info

    # Greedy outputs equal transformers; each handoff crossed from its prefill host to the
    # decode host: the prefill agent counts the bytes as sent to kv-decode, the decode agent
    # as received from that prefill agent, and the prefill host's link carried at least them.
    agents = {h.name: h for h in (p1, p2, decode)}
    before = {name: metrics(stack, h, AGENT_METRICS) for name, h in agents.items()}
    tx_before = {h.name: h.counter("tx_bytes") for h in (p1, p2)}
    results = drive(stack, "generate", {"router": router, "prompts": PROMPTS,
                                        "max_tokens": MAX_TOKENS})["results"]
    after = {name: metrics(stack, h, AGENT_METRICS) for name, h in agents.items()}
    sent_by = {h.name: 0 for h in (p1, p2)}
    for r in results:
        assert r["code"] == "OK", r
        assert r["ids"] == refs[r["prompt"]][1], r["prompt"]
        t = r["timing"]
        assert t["kv_transport"] == transport and t["decode_worker"] == \
            f"decode@{decode.ip}:{DECODE_PORT}"
        prefill_host = next(h for h in (p1, p2)
                            if t["prefill_worker"] == f"prefill@{h.ip}:{PREFILL_PORT}")
        sent_by[prefill_host.name] += int(t["kv_bytes"])
    assert all(n > 0 for n in sent_by.values()), f"both prefill hosts serve: {sent_by}"

    def moved(agent: str, **labels: str) -> float:
        name = "pdserve_kv_transfer_bytes_total"
        return total(after[agent], name, **labels) - total(before[agent], name, **labels)
    for host in (p1, p2):
        sent = sent_by[host.name]
        assert moved(host.name, transport=transport, direction="send",
                     peer="kv-decode") == sent
        assert moved(host.name, direction="send") == sent  # to no other peer, nothing local
        assert moved("decode", transport=transport, direction="receive",
                     peer=f"kv-{host.name}") == sent
        assert host.counter("tx_bytes") - tx_before[host.name] >= sent
    assert moved("decode", direction="receive") == sum(sent_by.values())

    # Every process of prefill-1 killed while it computes a prompt, under load from 4 clients.
    victim_pids = p1.pids()
    assert len(victim_pids) == 2, victim_pids  # its agent and its worker
    load = drive(stack, "kill_under_load", {
        "router": router, "victim": f"{p1.ip}:{PREFILL_PORT}", "pids": victim_pids,
        "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "before": 4, "after": 8, "clients": 4})
    assert load["warm"] and load["victim_busy"] and load["finished_after"], stack.logs()
    assert p1.pids() == []
    for r in load["results"]:
        expected = refs[r["prompt"]][1]
        if r["code"] == "OK":
            assert r["ids"] == expected, r  # nothing lost, nothing repeated
        else:  # only a request that had streamed may fail, with a named status
            assert r["ids"] and r["ids"] == expected[:len(r["ids"])], r
            assert r["code"] in ("UNAVAILABLE", "ABORTED", "INTERNAL") and r["details"], r
    retried = [r for r in load["results"] if r["timing"].get("attempts", 1) > 1]
    assert retried, "no request was in flight on the killed host"
    assert all(r["code"] == "OK" for r in retried)

    # Its record leaves DNS: the router drops it from the pool (no calls left on it).
    stack.network.set_records({"prefill-pool": ["prefill-2"], "decode-pool": ["decode"]})

    def left() -> bool:
        found = metrics(stack, stack.router, ROUTER_METRICS)
        return (total(found, "pdserve_workers", role="prefill") == 1
                and total(found, "pdserve_worker_leaves_total", role="prefill") == 1
                and total(found, "pdserve_workers_leaving", role="prefill") == 0)
    assert wait_for(left, timeout_s=30, interval_s=0.2)
    last = drive(stack, "generate", {"router": router, "prompts": PROMPTS[:1],
                                     "max_tokens": MAX_TOKENS})["results"][0]
    assert last["ids"] == refs[PROMPTS[0]][1]
    assert last["timing"]["prefill_worker"] == f"prefill@{p2.ip}:{PREFILL_PORT}"
