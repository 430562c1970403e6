"""Workers join and leave a serving router under steady load, and no request is lost.

A router (in this process, real gRPC) discovers scripted workers (real gRPC servers on
loopback) through a DNS answer the test changes between rounds, while client threads keep
requests flowing. The real resolver (getaddrinfo over /etc/hosts) is exercised by a router
process below and by the multi-host test.
"""

from __future__ import annotations

import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from pdserve.common import server
from pdserve.router.discovery import Discovery
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.pool import WorkerPool
from pdserve.router.servicer import RouterServicer
from pdserve.router.targets import parse_target, system_resolver
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc

from tests.fakes import TEXT, FakeDecode, FakePrefill, Script, make_model_dir
from tests.support import ServiceProcess, free_port, samples, value, wait_for, wait_serving

pytestmark = pytest.mark.service


class GatedDecode(FakeDecode):
    """A decode worker whose streams, while `gate` is clear, stop after their first token
    (the client has it) until it is set; `held` counts the streams stopped there. At most
    `HOLD_AT_MOST` are held, so that with the test's four clients some always keep flowing:
    holding every stream that reached the worker before the router saw it leave could park
    all four clients and stall the load the test waits on (a CI failure on a loaded machine)."""

    HOLD_AT_MOST = 2

    def __init__(self, script: Script, name: str):
        super().__init__(script, name)
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0
        self._lock = threading.Lock()

    def _hold(self) -> bool:
        with self._lock:
            if self.gate.is_set() or self.held >= self.HOLD_AT_MOST:
                return False
            self.held += 1
            return True

    def Decode(self, request, context):
        for i, message in enumerate(super().Decode(request, context)):
            yield message
            if i == 1 and self._hold():
                self.gate.wait(120)  # a safety bound only: the test sets the gate, and its
                # own waits while the gate is clear add up to 60 s


@dataclass
class Load:
    """Client threads sending one request after another until stopped."""

    stub: router_pb2_grpc.RouterStub
    expected: str
    results: list[tuple[str, str, str, str]] = field(default_factory=list)  # code, text, p, d
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            text, timing, code = "", None, "OK"
            try:
                for r in self.stub.Generate(router_pb2.GenerateRequest(prompt="x", max_tokens=64),
                                            timeout=30):
                    text += r.delta.text
                    timing = r.timing if r.HasField("timing") else timing
            except grpc.RpcError as exc:
                code = f"{exc.code().name}: {exc.details()}"
            self.results.append((code, text, timing.prefill_worker if timing else "",
                                 timing.decode_worker if timing else ""))

    def done(self) -> int:
        return len(self.results)

    def served_by(self) -> Counter[str]:
        return Counter(x for _, _, p, d in self.results for x in (p, d))


@pytest.fixture
def workers(tok) -> Iterator[dict[str, tuple[str, object, dict]]]:
    """p0, p1 (prefill) and d0, d1 (decode): name -> (address, servicer, {"ready": bool});
    p1 starts NOT_SERVING."""
    script = Script(tokens=tok.encode(TEXT))
    made, handles = {}, []
    for name in ("p0", "p1", "d0", "d1"):
        state = {"ready": name != "p1"}
        if name.startswith("p"):
            servicer: object = FakePrefill(script, name)
            add = prefill_pb2_grpc.add_PrefillServicer_to_server
        else:
            servicer = GatedDecode(script, name)
            add = decode_pb2_grpc.add_DecodeServicer_to_server
        handle = server.start(name, 0, lambda s, a=add, v=servicer: a(v, s), host="127.0.0.1",
                              ready=lambda st=state: st["ready"])
        handles.append(handle)
        made[name] = (f"127.0.0.1:{handle.port}", servicer, state)
    yield made
    for handle in handles:
        handle.server.stop(0)


def test_workers_join_and_leave_under_load_and_no_request_is_lost(tok, workers):
    answer = {"prefill": ["p0"], "decode": ["d0"]}

    def resolve(name: str, port: int) -> list[str]:
        return [workers[w][0] for w in answer[name]]

    pool = WorkerPool(interval_s=0.2)
    discovery = Discovery(pool, [parse_target("dns:///prefill:1")],
                          [parse_target("dns:///decode:1")], interval_s=3600, resolve=resolve)
    lifecycle = Lifecycle(pool, tok, "tiny-test", max_retries=0)  # a lost request shows
    router = server.start("router", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(lifecycle), s), host="127.0.0.1", ready=pool.ready)
    discovery.start()
    pool.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}")
    load = Load(router_pb2_grpc.RouterStub(channel), TEXT)
    clients = [threading.Thread(target=load.run) for _ in range(4)]
    try:
        assert wait_for(pool.ready, timeout_s=10)
        for t in clients:
            t.start()
        assert wait_for(lambda: load.done() >= 8, timeout_s=30)

        # p1 and d1 join; p1 is not SERVING yet, so it gets nothing until it is.
        answer.update(prefill=["p0", "p1"], decode=["d0", "d1"])
        discovery.refresh()
        assert wait_for(lambda: load.served_by()["d1"] >= 4, timeout_s=30), load.served_by()
        assert load.served_by()["p1"] == 0
        workers["p1"][2]["ready"] = True
        assert wait_for(lambda: load.served_by()["p1"] >= 4, timeout_s=30), load.served_by()

        # d0 leaves while streams it serves are held after their first tokens; p0 leaves.
        d0 = workers["d0"][1]
        d0.gate.clear()
        assert wait_for(lambda: d0.held >= 1, timeout_s=30)
        answer.update(prefill=["p1"], decode=["d1"])
        discovery.refresh()
        held, done_on_d0 = d0.held, load.served_by()["d0"]
        assert pool.counts()["decode"].leaving == 1
        finished = load.done()
        assert wait_for(lambda: load.done() >= finished + 8, timeout_s=30)
        reserves_on_d0 = d0.script.reserves.count("d0")
        assert wait_for(lambda: load.done() >= finished + 16, timeout_s=30)
        assert d0.script.reserves.count("d0") == reserves_on_d0  # no new work for d0
        assert pool.counts()["decode"].leaving == 1  # its channel stays open for its streams
        d0.gate.set()
        assert wait_for(lambda: pool.counts()["decode"].leaving == 0, timeout_s=30)
        assert workers["d0"][0] not in pool._channels  # closed after its last call
        # The held streams finished (their clients record them a moment after d0's last
        # call was released: the router still streams the final message to them).
        assert wait_for(lambda: load.served_by()["d0"] >= done_on_d0 + held, timeout_s=30), \
            (load.served_by(), done_on_d0, held)
        served = load.served_by()

        # d0 comes back and is used again.
        answer.update(decode=["d0", "d1"])
        discovery.refresh()
        assert wait_for(lambda: load.served_by()["d0"] > served["d0"], timeout_s=30)
    finally:
        load.stop.set()
        for t in clients:
            t.join(60)
        channel.close()
        discovery.close()
        pool.close()
        router.server.stop(0)
    failed = [r for r in load.results if r[0] != "OK" or r[1] != TEXT]
    assert not failed, failed[:3]
    counts = pool.counts()
    assert (counts["prefill"].joins, counts["prefill"].leaves) == (2, 1)
    assert (counts["decode"].joins, counts["decode"].leaves) == (3, 1)


class LeavesWhenChecked:
    """A worker's calls whose first health check retires the worker and closes its channel
    before the call goes out: the interleaving a check round meets when a worker leaves (and
    its last call ends) between the round's snapshot of the members and its calls to them."""

    def __init__(self, pool: WorkerPool, worker, stay: list[str]):
        self.pool, self.worker, self.stay, self.real = pool, worker, stay, worker.unary
        self.fired = threading.Event()

    @property
    def check(self):
        if not self.fired.is_set():
            self.fired.set()
            self.pool.set_members("decode", self.stay)
            self.worker.channel.close()
        return self.real.check

    @property
    def stats(self):
        return self.real.stats


def test_a_worker_leaving_during_a_check_round_does_not_stop_the_checks(workers):
    """A CI failure: the checker thread died on "Cannot invoke RPC: Channel closed!" when
    a worker's channel closed inside a round, so a worker that came back (or joined) later
    was never checked and never used. The round skips the gone worker and goes on."""
    d0, d1 = workers["d0"][0], workers["d1"][0]
    pool = WorkerPool(prefill=[workers["p0"][0]], decode=[d0], interval_s=0.2)
    try:
        leaving = pool._workers[("decode", d0)]
        trap = LeavesWhenChecked(pool, leaving, stay=[d1])
        leaving.unary = trap
        pool.start()
        assert wait_for(trap.fired.is_set, timeout_s=10)
        # The newcomer is checked (so the checker lives), and d0 comes back and is checked.
        assert wait_for(lambda: pool.ready() and pool.counts()["decode"].healthy == 1,
                        timeout_s=10), pool.counts()
        assert [w.address for w in pool._workers.values() if w.role == "decode"] == [d1]
        pool.set_members("decode", [d0, d1])
        assert wait_for(lambda: pool.counts()["decode"].healthy == 2, timeout_s=10), \
            pool.counts()
        assert pool._thread is not None and pool._thread.is_alive()
    finally:
        pool.close()


def test_router_process_discovers_workers_through_the_system_resolver(tmp_path, tok):
    """`--prefill dns:///localhost:P`: every address record of localhost is a worker (on
    machines that also map ::1 to localhost, the one nobody listens on stays unhealthy)."""
    script = Script(tokens=tok.encode(TEXT))
    prefill = server.start("p", 0, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(
        FakePrefill(script, "p"), s), host="127.0.0.1")
    decode = server.start("d", 0, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(
        FakeDecode(script, "d"), s), host="127.0.0.1")
    port, metrics_port = free_port(), free_port()
    proc = ServiceProcess([sys.executable, "-m", "pdserve.router.main", "--host", "127.0.0.1",
                           "--port", str(port), "--metrics-port", str(metrics_port),
                           "--model", str(make_model_dir(tmp_path / "m", max_context=256)),
                           "--prefill", f"dns:///localhost:{prefill.port}",
                           "--decode", f"127.0.0.1:{decode.port}",
                           "--discovery-interval-s", "0.5"])
    try:
        wait_serving(f"127.0.0.1:{port}", timeout_s=30, proc=proc.proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            out = list(router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(prompt="x", max_tokens=64), timeout=20))
        assert "".join(r.delta.text for r in out) == TEXT
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=10) as reply:
            found = samples(reply.read().decode())
        records = system_resolver("localhost", prefill.port)
        assert value(found, "pdserve_workers", role="prefill") == len(records)
        assert value(found, "pdserve_workers_healthy", role="prefill") == 1
        assert value(found, "pdserve_worker_joins_total", role="prefill") == len(records)
        assert f"prefill worker 127.0.0.1:{prefill.port} joins" in proc.output()
    finally:
        proc.stop()
        prefill.server.stop(0)
        decode.server.stop(0)
