"""CPU allowance and partitioning: how many cores this process may use (affinity and cgroup
quota, as a Kubernetes pod's limits set them), and how `pdserve up` splits one host's cores
between the prefill and decode sides so they never fight over the same core.

Standard library only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


def parse_cpu_list(text: str) -> list[int]:
    """`"0-3,6"` -> [0, 1, 2, 3, 6] (the format of taskset, cpusets and /sys)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not an ascending range")
        cpus += [c for c in range(first, last + 1) if c not in cpus]
    if not cpus:
        raise ValueError(f"CPU list {text!r} names no CPU")
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for cpu in sorted(set(cpus)):
        if out and "-" not in out[-1] and int(out[-1]) == cpu - 1:
            out[-1] = f"{out[-1]}-{cpu}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == cpu - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Cores granted by the cgroup v2 CPU quota (`cpu.max`), None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def cpu_allowance(root: Path = Path("/sys/fs/cgroup")) -> int:
    """Threads worth running: the CPUs this process may run on, capped by the cgroup quota
    (rounded up: a 1.5-core limit still lets two threads make progress)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota(root)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


@dataclass(frozen=True)
class Partition:
    """Cores per side of one host: the prefill workers share `prefill`, the decode workers
    share `decode`; the router and agents run on `others` (the engines' cores too when the
    host has no core to spare for them)."""

    prefill: list[int]
    decode: list[int]
    others: list[int]


def partition(cpus: list[int], decode_share: float = 0.5) -> Partition:
    """Split `cpus` between prefill and decode (decode gets `decode_share`, at least one each);
    with four or more cores, one core is kept for the router and agents."""
    if len(cpus) < 2:
        return Partition(list(cpus), list(cpus), list(cpus))
    pool = list(cpus)
    others = [pool.pop()] if len(pool) >= 4 else list(cpus)
    n_decode = min(len(pool) - 1, max(1, round(len(pool) * decode_share)))
    return Partition(pool[:len(pool) - n_decode], pool[len(pool) - n_decode:], others)
