"""kill -9 of one tensor-parallel rank: the whole worker fails cleanly, the router routes around
it, nothing else is lost (a row of the fault matrix per role).

A stack of its own: two prefill and two decode workers, prefill-0 and decode-0 of TP size 2
(rank 0 the worker process, rank 1 a process it started), the others of TP 1 (so handoffs
also change TP on the way), TCP between the agents. With two streams in flight, rank 1 of
prefill-0 is killed with SIGKILL: prefill-0 must notice at once (not hang its rank 0 in a
collective), stop serving and exit with status 1 naming the rank; every stream ends exact or
with a named status; requests go on exact through prefill-1; the decode side's pages
all come back. Then the same for decode-0's rank 1 (its reservations released, streams served
by decode-1). No process or segment of the stack is left at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import PROMPTS
from tests.faults.matrix import ROWS
from tests.faults.stack import FaultStack, iter_pids
from tests.faults.test_kill_matrix import Bystanders, _exact_again
from tests.support import wait_for

pytestmark = pytest.mark.faults

PROMPT = PROMPTS[3]


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir):
    fs = FaultStack(tiny_model_dir, transport="tcp", prefill=2, decode=2, num_pages=64,
                    node_args={"prefill-0": ("--tp", "2"), "decode-0": ("--tp", "2")})
    try:
        fs.start()
        yield fs
    finally:
        fs.close()
        left = list(iter_pids(fs.spawned))
        assert not left, f"processes left running: {left}"
        assert not _ranks_of(fs.spawned), "tensor-parallel ranks left running"
        assert not fs.segments(), f"shared-memory segments left: {fs.segments()}"


def _ranks_of(pids: list[int]) -> list[int]:
    """Rank processes (pdserve.engine.tp_rank) whose parent is one of `pids`."""
    out = subprocess.run(["pgrep", "-f", "pdserve.engine.tp_rank"], capture_output=True,
                         text=True, check=False).stdout.split()
    ranks = []
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent in pids:
            ranks.append(pid)
    return ranks


@pytest.mark.parametrize("role", ["prefill-0", "decode-0"])
def test_killing_one_rank_fails_its_worker_cleanly_and_the_rest_serves(tp_stack, reference,
                                                                       role):
    fs = tp_stack
    expected = reference[1][PROMPT][1]
    assert _exact_again(fs, expected), fs.logs()
    node = fs.nodes[role]
    ranks = _ranks_of([node.pid])
    assert len(ranks) == 1, f"{role} should have one rank process besides itself: {ranks}"
    start = {k: v for k, v in fs.free_pages().items() if k != role}
    with Bystanders(fs, expected, role) as bystanders:
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: not node.alive(), 30), f"{role} still up:\n{fs.log(role)}"
        exit_s = time.monotonic() - killed
    assert node.proc is not None and node.proc.proc.returncode == 1, fs.log(role)
    log = fs.log(role)
    assert "tensor-parallel rank 1 exited (code -9); the worker stops" in log, log[-3000:]
    assert _exact_again(fs, expected), fs.logs()  # through the other worker of the pool
    assert fs.pages_back(start, 15), (fs.free_pages(), start, fs.logs())
    ok = sum(o == "OK, exact" for o in bystanders.outcomes)
    ROWS.append((f"kill -9 {role}'s TP rank 1", "bystanders",
                 f"{ok}/{len(bystanders.outcomes)} OK exact, the rest named; {role} exited 1 "
                 f"naming the rank {exit_s:.1f} s after; later requests exact through the "
                 f"other worker"))
    fs.restart(role)  # back for the next row: a new rank 0 and rank 1
    assert len(_ranks_of([fs.nodes[role].pid])) == 1
    assert _exact_again(fs, expected), fs.logs()
