"""Fixtures of the fault tests: one shared loopback stack for the fuzzers, and a canary that
streams greedy requests alongside and checks every one of them token for token."""

from __future__ import annotations

import itertools
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.faults.matrix import ROWS, node_rules, write_table
from tests.faults.protofuzz import EXAMPLES, OUTCOMES
from tests.faults.stack import FaultStack, iter_pids


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault matrix (also written to build/fault-matrix.md) and the fuzzers' outcomes per
    method (status code: examples), for the record."""
    if ROWS:
        terminalreporter.section("fault matrix: fault x phase -> outcome")
        terminalreporter.write(write_table())
    if OUTCOMES:
        terminalreporter.section("fuzzed RPCs: status codes returned")
        for method, tally in sorted(OUTCOMES.items()):
            codes = ", ".join(f"{code} {n}" for code, n in tally.most_common())
            terminalreporter.write_line(f"{method:<36} {codes}")
        if terminalreporter.config.option.verbose > 0:
            for (method, code), details in sorted(EXAMPLES.items()):
                terminalreporter.write_line(f"  {method} {code}: {details}")


LEASE_S = 1.0


@pytest.fixture(scope="package")
def fault_stack(tiny_model_dir, tmp_path_factory):
    """The stack every fault test here shares (TCP between the agents; the fail points of the
    kill matrix armed, which only requests with its tags meet). Each test leaves it healthy:
    the fuzzers and the storm check that, the kill matrix restarts what it killed. At the end
    no process it ever started is left."""
    pause_dir = tmp_path_factory.mktemp("pauses")
    fs = FaultStack(tiny_model_dir, transport="tcp", num_pages=96,
                    router_args=("--lease-ms", str(LEASE_S * 1e3)),
                    # longer than a decode worker's restart: the kill matrix's handoff parked
                    # at the receiving agent must outlive it to be retried on the new worker
                    prefill_args=("--transfer-timeout-s", "20"))
    fs.pause_dir = pause_dir  # type: ignore[attr-defined]
    fs.rules = node_rules(fs, pause_dir)  # type: ignore[attr-defined]
    try:
        fs.start(fs.rules)  # type: ignore[attr-defined]
        yield fs
    finally:
        fs.close()
        left = list(iter_pids(fs.spawned))
        assert not left, f"processes left running: {left}"
        assert not fs.segments(), f"shared-memory segments left: {fs.segments()}"


@pytest.fixture
def fuzz_stack(fault_stack):
    return fault_stack


_CANARY_IDS = itertools.count()


class Canary:
    """Greedy requests one after another until stopped; every output must be the reference.
    Each has its own request id, so a failure names the one request that failed."""

    def __init__(self, fs: FaultStack, reference, prompt: str = PROMPTS[2]):
        self._fs = fs
        self._prompt = prompt
        self._expected = reference[1][prompt][1]
        self._stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set() or self.done == 0:
            n = next(_CANARY_IDS)
            s = self._fs.stream(prompt=self._prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                request_id=f"canary-{n}").join()
            if s.code != "OK" or s.tokens != self._expected:
                self.failures.append(f"canary-{n}: {s.code} {s.details} {s.tokens}")
            self.done += 1


def serving(fs: FaultStack, name: str) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(fs.channel(name)).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def guarded(fuzz_stack, reference):
    """The shared stack with a canary running alongside; after the test: the canary's every
    output exact, every process alive and SERVING, every page and reservation back."""
    start = fuzz_stack.free_pages()
    with Canary(fuzz_stack, reference) as canary:
        yield fuzz_stack
    assert not canary.failures, "\n".join(canary.failures[:3]) + fuzz_stack.logs()
    assert canary.done >= 1
    for name, node in fuzz_stack.nodes.items():
        assert node.alive(), f"{name} died:\n{fuzz_stack.log(name)[-3000:]}"
        assert serving(fuzz_stack, name), f"{name} is not SERVING"
    assert fuzz_stack.pages_back(start, 40), (fuzz_stack.free_pages(), start)
