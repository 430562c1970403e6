"""Where a stack's processes run, and how much CPU the ones beside its workers take from each
worker's cores (Linux `/proc`).

`pdserve up` pins a disaggregated stack's prefill and decode workers to a core (or set) each
and leaves the router and the KV agents (and a benchmark client on the same machine) free to
run on any core, so the scheduler decides whose core they slow down. `CoreSampler` samples
every thread of a set of processes (and their descendants) every `period_s`: the CPU time it
ran since the last sample (`/proc/PID/task/TID/schedstat`) is counted on the core it was last
on (`stat` field 39). `shared_by_worker` turns that into, per worker role, the CPU per output
token that the processes that are not workers spent on that worker's cores (its affinity).
A worker's own threads beside its engine (receiving requests, streaming tokens, shipping KV)
are not counted: the serving overheads calibrated one request at a time hold them.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")
WORKER_MODULES = {"prefill": "pdserve.prefill.main", "decode": "pdserve.decode.main",
                  "colocated": "pdserve.colocated.main"}


def worker_role(pid: int, proc: Path = PROC) -> str | None:
    """`prefill`, `decode` or `colocated` for a worker process, None for any other."""
    try:
        cmd = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return next((role for role, module in WORKER_MODULES.items() if f"{module} " in f"{cmd} "),
                None)


def descendants(roots: Iterable[int], proc: Path = PROC) -> list[int]:
    """`roots` and every process below them (parents from `/proc/PID/stat`)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(entry.name))
    out: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def _task_ns(task: str) -> int | None:
    """CPU ns one thread (`/proc/PID/task/TID`) has run so far."""
    try:
        return int(_read(f"{task}/schedstat").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _task_core(task: str) -> int | None:
    """The core one thread last ran on."""
    try:
        return int(_read(f"{task}/stat").rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


class CoreSampler:
    """While entered: per process (the `roots` and their descendants, found again every
    `rescan_s`), its threads' CPU seconds per core. `cpu_s[pid][core]`.

    Worker processes are found (`roles`, `cores`) but not sampled: they run on their own
    cores, and only the others' CPU is charged. A thread's core is read only when it ran since
    the last sample. Sampling a 1P+1D stack's 81 threads every 20 ms took 0.12 of a core before
    both (on a 2-core machine, while the run it measures needs the cores)."""

    def __init__(self, roots: Iterable[int], period_s: float = 0.02, rescan_s: float = 0.5,
                 proc: Path = PROC):
        self.roots = list(roots)
        self.period_s, self.rescan_s, self.proc = period_s, rescan_s, proc
        self.cpu_s: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.roles: dict[int, str | None] = {}
        self.cores: dict[int, list[int]] = {}
        self._last: dict[tuple[int, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sampler", daemon=True)

    def add(self, pid: int) -> None:
        """Sample `pid` (and what it starts) too, from the next rescan on."""
        self.roots.append(pid)

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pids: list[int] = []
        rescan = 0.0
        waited = self.rescan_s  # rescan at once
        while True:
            if waited >= rescan:
                pids, rescan, waited = self._scan(), self.rescan_s, 0.0
            self.sample(pids)
            if self._stop.wait(self.period_s):
                self.sample(pids)
                return
            waited += self.period_s

    def _scan(self) -> list[int]:
        pids = descendants(self.roots, self.proc)
        for pid in pids:
            if pid not in self.roles:
                self.roles[pid] = worker_role(pid, self.proc)
                try:
                    self.cores[pid] = sorted(os.sched_getaffinity(pid))
                except OSError:
                    self.cores[pid] = []
        return pids

    def sample(self, pids: Iterable[int]) -> None:
        for pid in pids:
            if self.roles.get(pid) is not None:
                continue  # a worker: its own CPU is not charged
            tasks_dir = f"{self.proc}/{pid}/task"
            try:
                tids = os.listdir(tasks_dir)
            except OSError:
                continue
            for tid in tids:
                task = f"{tasks_dir}/{tid}"
                ns = _task_ns(task)
                if ns is None:
                    continue
                key = (pid, tid)
                last = self._last.get(key)
                self._last[key] = ns
                if last is None or ns <= last:
                    continue
                core = _task_core(task)
                if core is not None:
                    self.cpu_s[pid][core] += (ns - last) / 1e9


def shared_by_worker(cpu_s: dict[int, dict[int, float]], roles: dict[int, str | None],
                     cores: dict[int, list[int]], output_tokens: int
                     ) -> dict[str, tuple[float, float]]:
    """Per worker role: (ms per output token that the processes that are not workers spent
    on the cores that role's workers may run on, those cores' count). Roles of several workers
    count each core once."""
    if output_tokens <= 0:
        return {}
    worker_cores: dict[str, set[int]] = defaultdict(set)
    for pid, role in roles.items():
        if role is not None:
            worker_cores[role].update(cores.get(pid, []))
    others: dict[int, float] = defaultdict(float)
    for pid, per_core in cpu_s.items():
        if roles.get(pid) is None:
            for core, seconds in per_core.items():
                others[core] += seconds
    return {role: (sum(others[c] for c in own) * 1e3 / output_tokens, float(len(own)))
            for role, own in worker_cores.items() if own}
