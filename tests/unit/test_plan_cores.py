"""`pdserve.plan.cores`: the CPU that the processes beside the workers take on each worker's
cores, from a sampler of /proc (run on this process and a child)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pdserve.plan.cores import CoreSampler, descendants, shared_by_worker, worker_role

pytestmark = pytest.mark.unit
linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_others_cpu_is_charged_to_the_cores_each_worker_may_run_on():
    roles = {1: "prefill", 2: "decode", 3: None, 4: None}
    cores = {1: [0], 2: [1], 3: [0, 1], 4: [0, 1]}
    cpu_s = {1: {0: 9.0}, 2: {1: 9.0},            # the workers' own CPU is not counted
             3: {0: 0.3, 1: 0.1}, 4: {0: 0.1, 1: 0.5}}
    found = shared_by_worker(cpu_s, roles, cores, output_tokens=1000)
    assert found["prefill"] == (pytest.approx(0.4), 1.0)
    assert found["decode"] == (pytest.approx(0.6), 1.0)
    colocated = shared_by_worker({1: {0: 5.0}, 3: {0: 0.2, 1: 0.2}}, {1: "colocated", 3: None},
                                 {1: [0, 1], 3: [0, 1]}, 100)
    assert colocated == {"colocated": (pytest.approx(4.0), 2.0)}
    assert shared_by_worker(cpu_s, roles, cores, 0) == {}


@linux
def test_the_sampler_sees_a_childs_cpu_on_the_cores_it_ran_on():
    code = "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", code])
    # a worker (by its command line) is found but not sampled: only the others' CPU counts
    worker = subprocess.Popen([sys.executable, "-c", code, "pdserve.decode.main"])
    try:
        assert child.pid in descendants([os.getpid()])
        with CoreSampler([os.getpid()], period_s=0.01, rescan_s=0.05) as sampler:
            time.sleep(0.4)  # sampling, not synchronisation
    finally:
        child.wait()
        worker.wait()
    assert sampler.roles[worker.pid] == "decode" and worker.pid not in sampler.cpu_s
    busy = sum(sampler.cpu_s[child.pid].values())
    assert 0 < busy < 0.5  # at most the 0.4 s sampled, less on a busy machine
    assert set(sampler.cpu_s[child.pid]) <= set(os.sched_getaffinity(child.pid)
                                                  if child.poll() is None else range(1024))
    assert sampler.roles[child.pid] is None and worker_role(os.getpid()) is None
