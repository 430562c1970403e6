"""Clients that multi-host tests run inside a host's namespace:
`python -m tests.multihost.driver COMMAND JSON-ARGS`; prints one JSON object on its last line.

- `ready`: wait until the workers and the router are SERVING and the router counts the
  expected healthy workers per role (read from its /metrics).
- `generate`: greedy requests, a few at a time; per request its token ids and Timing.
- `probe`: what peers are told: a decode worker's reservation destination, agents' info.
- `kill_under_load`: client threads keep requests flowing; once `before` have finished and
  the victim prefill worker holds a prompt (computing it, or its pages not yet handed off: a
  tiny prompt computes in a few ms), every pid in `pids` is SIGKILLed; after
  `after` more requests, the clients stop. Per request: its tokens, status and attempts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from pdserve.common.health import wait_serving
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def ready(args: dict[str, Any]) -> dict[str, Any]:
    for address in (*args["workers"], args["router"]):
        wait_serving(address, 180)
    counted = wait_for(lambda: all(metric(args["router_metrics"], "pdserve_workers_healthy",
                                      role=role) == n for role, n in args["healthy"].items()),
                   60, 0.2)
    return {"ready": counted}


def one_request(stub: router_pb2_grpc.RouterStub, prompt: str, max_tokens: int,
                record: dict[str, Any]) -> dict[str, Any]:
    """Stream one greedy request into `record` (ids as they arrive, the Timing, the end)."""
    record.update(prompt=prompt, ids=[], code="OK", details="", timing={})
    try:
        for m in stub.Generate(router_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0.0), timeout=120):
            if m.HasField("delta"):
                record["ids"] = record["ids"] + list(m.delta.token_ids)
            elif m.HasField("timing"):
                t = m.timing
                record["timing"] = {"prefill_worker": t.prefill_worker, "attempts": t.attempts,
                                    "decode_worker": t.decode_worker, "kv_bytes": t.kv_bytes,
                                    "kv_transport": t.kv_transport}
    except grpc.RpcError as exc:
        record.update(code=exc.code().name, details=exc.details() or "")
    return record


def generate(args: dict[str, Any]) -> dict[str, Any]:
    with grpc.insecure_channel(args["router"]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with ThreadPoolExecutor(args.get("concurrency", 3)) as pool:
            results = list(pool.map(lambda p: one_request(stub, p, args["max_tokens"], {}),
                                    args["prompts"]))
    return {"results": results}


def probe(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"agents": {}}
    with grpc.insecure_channel(args["decode"]) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        reply = stub.Reserve(decode_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=4,
                                                       lease_ms=10_000), timeout=10)
        out["destination_agent"] = reply.destination.agent_address
        out["ticket_decode_worker"] = reply.ticket.decode_worker
        stub.Abort(decode_pb2.AbortRequest(ticket=reply.ticket, reason="probe"), timeout=10)
    for address in args["agents"]:
        with grpc.insecure_channel(address) as channel:
            info = kvtransfer_pb2_grpc.KVTransferStub(channel).GetAgentInfo(
                kvtransfer_pb2.GetAgentInfoRequest(), timeout=10)
        out["agents"][address] = {"agent_id": info.agent_id, "tcp_address": info.tcp_address,
                                   "ucx": bool(info.ucx_worker_address)}
    return out


def kill_under_load(args: dict[str, Any]) -> dict[str, Any]:
    prompts, clients = args["prompts"], args.get("clients", 4)
    results: list[dict[str, Any]] = []
    in_flight: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    channel = grpc.insecure_channel(args["router"])
    stub = router_pb2_grpc.RouterStub(channel)

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            record: dict[str, Any] = {}
            with lock:
                in_flight.append(record)
            one_request(stub, prompts[i % len(prompts)], args["max_tokens"], record)
            with lock:
                in_flight.remove(record)
                results.append(record)
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    out: dict[str, Any] = {}
    try:
        out["warm"] = wait_for(lambda: len(results) >= args["before"], 120)
        victim = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(args["victim"]))

        def computing() -> bool:  # the victim holds a prompt it has not finished handing off
            s = victim.Stats(common_pb2.StatsRequest(), timeout=5)  # (free_pages counts the
            return (s.queued_prompt_tokens > 0 or s.running_sequences > 0  # unheld cache)
                    or s.free_pages < s.num_pages)
        out["victim_busy"] = wait_for(computing, 60, 0.005)
        with lock:
            for record in in_flight:
                record["streamed_at_kill"] = len(record.get("ids", []))
            done_at_kill = len(results)
            for pid in args["pids"]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out["finished_after"] = wait_for(lambda: len(results) >= done_at_kill + args["after"], 180)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
        channel.close()
    out["results"] = results
    return out


COMMANDS = {"ready": ready, "generate": generate, "probe": probe,
            "kill_under_load": kill_under_load}

if __name__ == "__main__":
    print(json.dumps(COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))), flush=True)
