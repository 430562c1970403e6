"""kill -9 of each role at each phase of a request, with other streams in flight.

The fault tests' shared stack (router, one prefill and one decode worker, an agent per
"host", TCP between the agents), fail points parking requests at each phase. Per role, one
round: four requests are parked, one at each phase (queued, prefilling, handing off,
decoding), two bystanders keep streaming, the role's process is killed with SIGKILL, the
parked requests are let go, and every stream's end is checked (matrix.check_stream: never a
repeated or reordered token, exact when OK, else a named status with a message naming the
peer and the phase). Then: every surviving worker's free pages back at their starting count,
the killed process restarted (an agent with a new epoch: the workers register their pools
again), every service SERVING and a request exact again. The decode worker is restarted
before the parked requests go on: the three whose handoff went to its dead pages had sent
the client nothing, so the router must retry them on the restarted worker (a one-worker
pool still retries on the worker that failed, ranked last) and they must end exact. The
rows go to the matrix table (build/fault-matrix.md, printed at the end of the run).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.faults.conftest import serving
from tests.faults.matrix import ROWS, check_stream, park, release
from tests.faults.stack import FaultStack
from tests.support import wait_for

pytestmark = pytest.mark.faults

PROMPT = PROMPTS[3]
ROLES = ["router", "prefill-0", "decode-0", "agent-a", "agent-b"]
# Restarted before the parked requests go on: those before their first token (whose handoff
# went to the dead worker's pages) must be retried on the restarted worker and end exact.
RESTARTED_FIRST = {"decode-0"}
BEFORE_FIRST_TOKEN = ("queued", "prefilling", "handing off")


@pytest.fixture
def matrix(fault_stack):
    return fault_stack, fault_stack.pause_dir, fault_stack.rules


class Bystanders:
    """Two streams at a time, one after another, until stopped; every one is checked."""

    def __init__(self, fs: FaultStack, expected: list[int], killed: str):
        self.outcomes: list[str] = []
        self._fs, self._expected, self._killed = fs, expected, killed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def __enter__(self) -> Bystanders:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self._fs.stream(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0).join()
            self.outcomes.append(check_stream(s, self._expected, self._killed))
            if s.code != "OK":
                self._stop.wait(0.2)  # the path is down: do not spin on it


def _exact_again(fs: FaultStack, expected: list[int]) -> bool:
    def once() -> bool:
        s = fs.stream(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0).join()
        return s.code == "OK" and s.tokens == expected
    return wait_for(once, 60, interval_s=0.2)


@pytest.mark.parametrize("role", ROLES)
def test_kill_at_every_phase(matrix, reference, role):
    fs, pause_dir, rules = matrix
    expected = reference[1][PROMPT][1]
    start = fs.free_pages()
    with Bystanders(fs, expected, role) as bystanders:
        parked = park(fs, pause_dir, PROMPT, expected, f"kill-{role}", MAX_TOKENS)
        fs.kill(role)
        left = fs.segments()  # a killed worker's pool must not outlive it
        if role in RESTARTED_FIRST:  # back before the parked requests go on
            fs.restart(role, rules.get(role, ""))
            assert _exact_again(fs, expected), fs.logs()
        release(pause_dir)
        outcomes = {p.phase: check_stream(p.stream.join(), p.expected, role) for p in parked}
    killed_at = time.monotonic()
    survivors = {k: v for k, v in start.items() if k != role or role in RESTARTED_FIRST}
    assert fs.pages_back(survivors, 15), (fs.free_pages(), start, fs.logs())
    back_s = time.monotonic() - killed_at
    if role in RESTARTED_FIRST:
        # Nothing had reached the client: the router retried on the restarted worker.
        retried = {phase: outcomes[phase] for phase in BEFORE_FIRST_TOKEN}
        assert retried == dict.fromkeys(BEFORE_FIRST_TOKEN, "OK, exact"), (retried, fs.logs())
    else:
        fs.restart(role, rules.get(role, ""))
        assert _exact_again(fs, expected), fs.logs()
    for name in fs.nodes:  # health is polled (the router's every 0.25 s): a bounded wait
        assert wait_for(functools.partial(serving, fs, name), 15), \
            f"{name} not SERVING after {role} came back"
    for phase, outcome in outcomes.items():
        ROWS.append((f"kill -9 {role}", phase, outcome))
    ok = sum(o == "OK, exact" for o in bystanders.outcomes)
    ROWS.append((f"kill -9 {role}", "bystanders",
                 f"{ok}/{len(bystanders.outcomes)} OK exact, the rest named; pages back "
                 f"{back_s:.1f} s after the parked requests ended"
))
    assert not left, f"kill -9 of {role} left {left} in /dev/shm"
